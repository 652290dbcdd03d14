"""``vescale.parallelize``: a plain single-device model + a placement plan -> a module whose
parameters are this rank's shards and whose step runs the placed joint graph."""

from __future__ import annotations

import glob
import inspect
from collections.abc import Mapping, Sequence
from operator import getitem
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor as _UpstreamDTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from vescale import _progress
from vescale._torch_compat import (
    FakeTensorMode,
    TracingContext,
    compute_local_shape_and_global_offset,
    current_graph_task_keep_graph,
    tracing,
)
from vescale.dtensor import DTensor
from vescale.dtensor.deferred_init import materialize_module
from vescale.dtensor.dtensor import new_dtensor, to_local
from vescale.dtensor.placement_types import make_spec
from vescale.passes.options import BackendOptions
from vescale.plan import consistency, replaced
from vescale.plan.batch import Batch, batch_choices
from vescale.plan.capture import capture_joint
from vescale.plan.cost import AlphaBeta, cost_model_of
from vescale.plan.explain import Explanation, explain
from vescale.plan.lower import output_leaves, run_program, to_placements
from vescale.plan.memory import optimizer_states
from vescale.plan.program import PlacedProgram, place
from vescale.plan.propagate import Placements
from vescale.plan.solve import MAX_TIME_LIMIT_S, TIME_LIMIT_S, solving_group
from vescale.plan.validate import PlanError, normalize_placements, normalize_plan, validate_inputs

__all__ = ["PlanError", "PlannedModule", "parallelize"]

PlanValue = Sequence[Placement] | Mapping[str, Placement]
aten = torch.ops.aten


class _AttachGrads(torch.autograd.Function):
    """The loss, whose backward hands the joint graph's gradients (this rank's shards) to the
    parameters as DTensors laid out as the parameters (``specs``; a plain parameter's, ``None``,
    gets its plain gradient), scaled by the loss's gradient on its device: no host sync on any
    device, and ``loss.backward()``'s implicit 1 leaves every gradient bit for bit as the step
    computed it. Scaled in place (one fused multiply, no copy) unless the graph is retained,
    whose next backward hands the same gradients again."""

    @staticmethod
    def forward(
        ctx: Any, loss: torch.Tensor, specs: list[Any], *params_and_grads: torch.Tensor
    ) -> torch.Tensor:
        # saved, not kept on ctx: autograd drops them after a backward that does not retain
        # the graph, so AccumulateGrad takes each gradient as it is instead of copying it
        ctx.save_for_backward(*params_and_grads[len(params_and_grads) // 2 :])
        ctx.specs = specs
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = list(ctx.saved_tensors)
        n = len(grads)
        g = (grad.full_tensor() if isinstance(grad, _UpstreamDTensor) else grad).reshape(())
        if current_graph_task_keep_graph():
            scaled = list(aten._foreach_mul.Tensor(grads, g))
        else:
            aten._foreach_mul_.Tensor(grads, g)  # x * 1 == x exactly: the implicit 1 keeps them
            scaled = grads
        wrapped = (
            t if s is None else new_dtensor(t, s, requires_grad=False)
            for t, s in zip(scaled, ctx.specs)
        )
        return (None, None, *wrapped, *((None,) * n))


def _no_grad(t: torch.Tensor) -> torch.Tensor:
    """``t``, detached only where it requires grad (a parameter's local shard rarely does)."""
    return t.detach() if t.requires_grad else t


def _slot(module: nn.Module, name: str, kind: str) -> tuple[dict[str, Any], str]:
    """The dict holding parameter or buffer ``name`` of ``module`` (its owner's
    ``_parameters`` or ``_buffers``) and its key there: read at every step, so a parameter
    the user replaces is the one the step uses."""
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner)
    return (sub._parameters if kind == "parameter" else sub._buffers), leaf


Narrows = tuple[tuple[int, int, int], ...]


def _narrows(spec: Any) -> Narrows | None:
    """(dim, start, length) slices taking this rank's shard of a whole tensor laid out as
    ``spec``; ``None`` unless every placement is a plain ``Shard`` or ``Replicate``."""
    if any(type(p) not in (Shard, Replicate) for p in spec.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
    return tuple(
        (d, int(o), int(n)) for d, (o, n, w) in enumerate(zip(offset, shape, spec.shape)) if n != w
    )


def _take(t: torch.Tensor, narrows: Narrows) -> torch.Tensor:
    """This rank's shard of the whole ``t`` (:func:`_narrows`), contiguous."""
    for d, start, length in narrows:
        t = t.narrow(d, start, length)
    return t.contiguous()


def _spec_or_none(t: torch.Tensor) -> Any:
    """A DTensor's spec; ``None`` for a plain tensor."""
    return t._spec if isinstance(t, _UpstreamDTensor) else None


class PlannedModule(nn.Module):
    """The parallelized model: ``module`` holds this rank's shards (DTensor parameters in the
    chosen placements, or its plain tensors when every one is replicated and the plan named
    none: :func:`parallelize`); ``forward(*args)`` runs the placed joint graph (compiled by the
    ``vescale`` backend unless ``compile=False``) and returns the output; when it is a loss,
    ``loss.backward()`` gives every parameter its gradient in the parameter's placements.
    Its inputs must have the shapes and dtypes of ``example_inputs`` (the plan is made for
    them): any other is a :class:`PlanError` naming the input, the planned and the given
    shape, on every rank at the first call (ranks compare theirs), on the ranks given it later."""

    def __init__(
        self,
        module: nn.Module,
        program: PlacedProgram,
        inputs: Sequence[Placements],
        examples: Sequence[torch.Tensor],
        compile: bool,
        options: dict[str, Any] | None,
        progress: bool,
    ) -> None:
        super().__init__()
        self.module = module
        self.program = program
        self.input_placements = [tuple(p) for p in inputs]
        self._planned = [(tuple(t.shape), t.dtype) for t in examples]
        self._input_names = _positional_names(module, len(examples))
        self._compile = compile
        self._options = options
        self._progress = progress
        self._step: Any = None
        self._out_specs: list[Any] = []  # the outputs' layouts, recorded when the step is traced
        joint = program.joint
        self._slots = [_slot(module, n, "parameter") for n in joint.param_names] + [
            _slot(module, n, "buffer") for n in joint.buffer_names
        ]
        self._grad_slots = [
            _slot(module, joint.grad_of[i], "parameter") for i in sorted(joint.grad_of)
        ]
        # the layouts of plain (replicated) parameters and buffers, fixed; a DTensor's is its own
        held = [slots[key] for slots, key in self._slots]
        rep = (Replicate(),) * program.mesh.ndim
        self._plain_specs = [
            None
            if isinstance(t, _UpstreamDTensor)
            else make_spec(program.mesh, rep, t.shape, t.stride(), t.dtype)
            for t in held
        ]
        self._in_specs: list[Any] = []  # the inputs' layouts, fixed at the first call
        self._in_narrows: list[Narrows | None] = []

    def explain(self) -> Explanation:
        """What was chosen and why (:func:`vescale.plan.explain`)."""
        return explain(self.program)

    def _inputs(self, args: Sequence[Any]) -> list[torch.Tensor]:
        """The local shards of ``args`` in the planned input placements, contiguous (the
        compiled step is specialized to its inputs' strides). A whole (plain) input is
        sliced locally as the first call's redistribution did (``_in_specs`` records its
        layouts); a DTensor input is redistributed."""
        if not self._in_specs:
            whole = [a if isinstance(a, _UpstreamDTensor) else a.contiguous() for a in args]
            dargs = [
                to_placements(a, self.program, p) for a, p in zip(whole, self.input_placements)
            ]
            self._in_specs = [d._spec for d in dargs]
            self._in_narrows = [_narrows(d._spec) for d in dargs]
            return [d._local_tensor.contiguous() for d in dargs]
        return [
            _take(a, n)
            if n is not None and not isinstance(a, _UpstreamDTensor)
            else to_placements(a, self.program, p)._local_tensor.contiguous()
            for a, n, p in zip(args, self._in_narrows, self.input_placements)
        ]

    def _compiled(self, specs: list[Any], flat: list[torch.Tensor]) -> Any:
        """The placed step on local tensors (``flat``: this rank's shards laid out as
        ``specs``), returning local tensors: no DTensor crosses the compiled region, so a
        step pays no subclass wrapping of its parameters and gradients. The outputs' layouts
        are kept in ``self._out_specs``."""
        if self._step is None:
            program = self.program
            out_specs = self._out_specs
            traced = self._compile  # eager: the outputs waited (no AsyncCollectiveTensor out)

            def placed_joint_step(*local: torch.Tensor) -> tuple[Any, ...]:
                args = [
                    DTensor.from_local(
                        t, s.mesh, s.placements, run_check=False, shape=s.shape, stride=s.stride
                    )
                    for t, s in zip(local, specs)
                ]
                outs = run_program(program, *args)
                out_specs[:] = [o._spec if isinstance(o, _UpstreamDTensor) else None for o in outs]
                return tuple(
                    to_local(o, async_output=traced) if isinstance(o, _UpstreamDTensor) else o
                    for o in outs
                )

            if not self._compile:
                self._step = placed_joint_step
            else:
                graph = torch.fx.Graph()
                phs = [graph.placeholder(f"arg{i}") for i in range(len(flat))]
                step = graph.call_function(placed_joint_step, tuple(phs))
                n_out = len(output_leaves(program))  # a tuple of outputs, as Dynamo's graphs
                graph.output(tuple(graph.call_function(getitem, (step, i)) for i in range(n_out)))
                gm = torch.fx.GraphModule(nn.Module(), graph)
                self._step = self._compile_step(gm, specs, flat)
        return self._step

    def _compile_step(
        self, gm: torch.fx.GraphModule, specs: list[Any], flat: list[torch.Tensor]
    ) -> Any:
        """``gm`` (the placed step) compiled by the ``vescale`` backend, or its Inductor code
        loaded when an earlier run compiled the same step (:mod:`vescale.plan.step_cache`)."""
        from vescale.backend import compile_or_load, record_inductor_forwards, vescale_backend
        from vescale.plan import step_cache

        key = step_cache.step_key(self.program, specs, flat, self._options)
        entry = step_cache.read(key, len(flat)) if key is not None else None
        # fake examples of a mode with a shape env, in a tracing context, as Dynamo hands a
        # backend: without them Inductor bypasses its FX graph cache and recompiles every run
        fake = FakeTensorMode(shape_env=ShapeEnv())
        examples = [fake.from_tensor(t, static_shapes=True) for t in flat]
        with (
            _progress.forced(self._progress),
            tracing(TracingContext(fake)),
            record_inductor_forwards() as forwards,
        ):
            if entry is None:
                step = vescale_backend(gm, examples, self._options)
            else:
                step = compile_or_load(gm, examples, self._options, entry.forward)
        if entry is not None and not self._out_specs:  # loaded: no trace recorded them
            self._out_specs[:] = step_cache.output_specs(self.program, entry)
        elif key is not None and len(forwards) == 1:
            (forward,) = forwards
            outputs = step_cache.outputs_of(self.program, self._out_specs)
            if forward.plain and forward.inputs == len(flat) and outputs is not None:
                step_cache.write(key, step_cache.Entry(forward, outputs))
        return step

    def _mismatch(self, args: Sequence[Any], rank: int | None) -> str | None:
        """The first input unlike its example (shape, dtype), as an error text."""
        for i, (arg, (shape, dtype)) in enumerate(zip(args, self._planned)):
            given = (
                f"has shape {tuple(arg.shape)} {arg.dtype}"
                if isinstance(arg, torch.Tensor)
                else f"is a {type(arg).__name__}"
            )
            if given == f"has shape {shape} {dtype}":
                continue
            name = f" ({self._input_names[i]})" if self._input_names[i] else ""
            where = "" if rank is None else f" on rank {rank}"
            return (
                f"vescale.parallelize: input {i}{name}{where} {given}, but the plan was made "
                f"for example_inputs[{i}] of shape {shape} {dtype}: pass inputs of the planned "
                "shapes and dtypes, or parallelize again with example_inputs like these"
            )
        return None

    def _check_inputs(self, args: Sequence[Any]) -> None:
        """Each call: the inputs' shapes and dtypes. The first call, when the mesh spans the
        world: also that the ranks agree (:mod:`vescale.plan.consistency`), in one gather;
        every rank raises the same error."""
        group = solving_group(self.program.mesh) if self._step is None else None
        if group is None:  # later calls: each rank checks its own, no communication
            problem = self._mismatch(args, None)
            if problem:
                raise PlanError(problem)
            return
        mine = self._mismatch(args, dist.get_rank(group))
        digests = [] if mine or not consistency.enabled() else self._digests(args)
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (mine, digests), group=group)
        problem = next((p for p, _ in gathered if p), None)
        if problem is None and all(d for _, d in gathered):
            problem = consistency.first_difference([d for _, d in gathered])
        if problem:
            raise PlanError(problem)

    def _digests(self, args: Sequence[Any]) -> list[consistency.Digest]:
        joint = self.program.joint
        names = [f"parameter {n!r}" for n in joint.param_names]
        names += [f"buffer {n!r}" for n in joint.buffer_names]
        state = [(n, slots[key]) for n, (slots, key) in zip(names, self._slots)]
        inputs = [
            (f"input {i}" + (f" ({n})" if n else ""), a)
            for i, (n, a) in enumerate(zip(self._input_names, args))
        ]
        return consistency.digests(state, inputs)

    def _step_inputs(self, args: Sequence[Any]) -> tuple[list[Any], list[torch.Tensor]]:
        """The compiled step's inputs (parameters, buffers, then ``args``: this rank's local
        tensors) and their layouts."""
        state: list[Any] = [slots[key] for slots, key in self._slots]
        local = self._inputs(args)
        plain = self._plain_specs
        specs = [t._spec if s is None else s for t, s in zip(state, plain)] + self._in_specs
        flat = [_no_grad(t._local_tensor if s is None else t) for t, s in zip(state, plain)]
        return specs, flat + local

    def forward(self, *args: torch.Tensor) -> Any:
        if len(args) != len(self.input_placements):
            raise TypeError(
                f"vescale.parallelize: expected {len(self.input_placements)} inputs, got {len(args)}"
            )
        self._check_inputs(args)
        specs, flat = self._step_inputs(args)
        outs = self._compiled(specs, flat)(*flat)
        spec = self._out_specs[0]
        out = outs[0] if spec is None else new_dtensor(outs[0], spec, requires_grad=False)
        if not self._grad_slots:
            return out
        with_grad: list[Any] = [slots[key] for slots, key in self._grad_slots]
        grad_specs = [_spec_or_none(p) for p in with_grad]
        return _AttachGrads.apply(out, grad_specs, *with_grad, *outs[1 : 1 + len(with_grad)])


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: Mapping[str, PlanValue],
    *,
    inputs: Sequence[PlanValue | Batch],
    example_inputs: Sequence[torch.Tensor],
    outputs: Sequence[PlanValue] | None = None,
    solver: str = "global",
    alpha_beta: AlphaBeta | None = None,
    cost: AlphaBeta | str | None = None,
    compile: bool = True,
    options: dict[str, Any] | None = None,
    progress: bool | None = None,
    memory_budget: int | None = None,
    optimizer: str = "sgd",
    time_limit_s: float = TIME_LIMIT_S,
) -> PlannedModule:
    """Place ``model`` on ``mesh`` from a partial plan.

    ``plan`` maps parameter/buffer name patterns (``fnmatch``, first match wins) to placements:
    a sequence with one placement per mesh dim, or ``{mesh dim name: placement}`` (other mesh
    dims replicated). ``inputs`` are the placements of the forward arguments (or
    :class:`vescale.plan.Batch`: a batch dim the compiler splits over one or more of the
    mesh dims it names, its choice), ``example_inputs``
    global tensors (or fake tensors) of their shapes; ``outputs`` those of the model outputs
    (default replicated). Every other tensor's placement is chosen by ``solver``: "global"
    (minimum total communication time over the joint forward+backward graph) or "greedy"
    (op by op, as eager dispatch). ``cost`` prices them: a GPU name ("h100", "a100",
    "h200", "b200": :mod:`vescale.cost.gpus`), a :class:`vescale.cost.CostModel`, or ``None``:
    on CUDA the detected GPU's, else calibrated on this machine; a meta or fake mesh needs
    one (:class:`PlanError`). ``alpha_beta``: the same as a ``CostModel`` ``cost``. When
    compiled with bucketing on, collectives the ``bucket`` pass merges pay one latency.
    ``model`` is changed in place: its parameters become DTensors in the chosen placements
    (materialized shard-only when it was built with ``vescale.deferred_init``), except when
    the plan names none of them and the choice replicates every one (the program is data
    parallel): they then stay plain tensors, as under upstream DDP (a DTensor wrapper would
    only add DTensor dispatch to every gradient hand-over and optimizer step). ``compile``
    compiles the placed step with the ``vescale`` backend (``options`` are its options).
    With ``options["dump_dir"]`` or ``VESCALE_DUMP_DIR``, ``rank<r>/placements.md`` holds
    :func:`vescale.plan.explain`'s report. ``progress``: one line per long stage (capture,
    propagate, solve, materialize, the step's compile) on rank 0's stderr (:mod:`vescale._progress`;
    default: ``VESCALE_PROGRESS``, on).
    ``memory_budget``: bytes per rank the choice may hold (parameters, gradients, the state
    of ``optimizer`` ("sgd", "sgd_momentum", "adam", ...), buffers, inputs and the
    activations the backward reads; :mod:`vescale.plan.memory`): a constraint of the solve;
    a :class:`PlanError` naming the smallest budget that fits when none does. The explain
    report shows the choice's memory and the recipe it amounts to.
    ``time_limit_s``: the global solve's limit (a positive number of seconds, at most
    3600), spent as a fixed amount of solver work, so the choice does not depend on the
    machine's load; the standard recipes (DDP, FSDP, FSDP x TP over each mesh dim
    assignment) are priced as candidates, so a solve stopped at the limit returns the
    cheapest of them (named in ``explain()``'s status, with a warning on rank 0) unless it
    found better.
    The plan is checked before anything communicates (:class:`PlanError`); a failure of the
    solve, which rank 0 runs for every rank, is a :class:`PlanError` on every rank."""
    if solver not in ("global", "greedy"):
        raise ValueError(
            f"vescale.parallelize: solver must be 'global' or 'greedy', got {solver!r}"
        )
    opts = BackendOptions.resolve(options)  # checked before anything is traced
    shown = _progress.enabled() if progress is None else progress  # a bad env value: every rank
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    shapes = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]}
    fixed_by_name = normalize_plan(plan, shapes, mesh)
    if memory_budget is not None and (
        isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0
    ):
        raise PlanError(
            f"vescale.parallelize: memory_budget must be a positive int (bytes per rank), "
            f"got {memory_budget!r}"
        )
    _check_time_limit(time_limit_s)
    optimizer_states(optimizer)  # a known optimizer, before anything is traced
    batch = {
        i: batch_choices(f"inputs[{i}]", p, t, mesh)
        for i, (p, t) in enumerate(zip(inputs, example_inputs))
        if isinstance(p, Batch)
    }
    given = [batch[i][0] if i in batch else p for i, p in enumerate(inputs)]
    input_placements = validate_inputs(given, example_inputs, mesh)
    output_placements = (
        None
        if outputs is None
        else [normalize_placements(f"outputs[{i}]", p, mesh) for i, p in enumerate(outputs)]
    )
    if alpha_beta is not None and cost is not None:
        raise PlanError("vescale.parallelize: pass cost= or alpha_beta=, not both")
    cost_model = cost_model_of(cost if alpha_beta is None else alpha_beta, mesh)
    with _progress.forced(shown):
        with _progress.stage("capture") as stage:
            joint = capture_joint(model, example_inputs)
            stage.detail = f"{len(joint.gm.graph.nodes)} nodes"
        fixed: dict[str, Placements | list[Placements]] = {
            ph: fixed_by_name[n]
            for n, ph in zip(names, joint.placeholder_names)
            if n in fixed_by_name
        }
        for i, (ph, p) in enumerate(zip(joint.placeholder_names[len(names) :], input_placements)):
            fixed[ph] = batch.get(i, p)
        buckets = compile and opts.bucket_cap_mb > 0
        program = place(
            joint,
            mesh,
            fixed,
            output_placements,
            cost_model,
            solver,
            buckets,
            memory_budget=memory_budget,
            optimizer=optimizer,
            time_limit_s=float(time_limit_s),
        )
        input_placements = program.input_placements()  # a Batch input's: the solver's choice
        if opts.dump_dir is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            explain(program).write(Path(opts.dump_dir) / f"rank{rank}")
        chosen = program.param_placements()
        plain = not fixed_by_name and all(
            all(isinstance(p, Replicate) for p in chosen[n]) for n in names
        )
        placed = {} if plain else {glob.escape(n): (mesh, chosen[n]) for n in names}
        with _progress.stage("materialize") as stage:
            before = replaced.params_of(model)
            materialize_module(model, placed)
            replaced.record(before, model)  # an optimizer over the originals: refused at step
            stage.detail = f"{len(names)} parameters and buffers"
    return PlannedModule(model, program, input_placements, example_inputs, compile, options, shown)


def _check_time_limit(time_limit_s: Any) -> None:
    """:class:`PlanError` unless ``time_limit_s`` is a number in (0, MAX_TIME_LIMIT_S]."""
    number = isinstance(time_limit_s, int | float) and not isinstance(time_limit_s, bool)
    if not number or not 0 < time_limit_s <= MAX_TIME_LIMIT_S:
        raise PlanError(
            f"vescale.parallelize: time_limit_s must be a positive number of seconds, at "
            f"most {MAX_TIME_LIMIT_S:g}, got {time_limit_s!r}"
        )


def _positional_names(model: nn.Module, n: int) -> list[str]:
    """The names of ``model.forward``'s first ``n`` positional parameters ("" where none)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read (e.g. a C function)
        params = []  # type: ignore[assignment]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in params if p.kind in positional]
    return (names + [""] * n)[:n]
