"""``vescale.parallelize``: a plain single-device model + a placement plan -> a module whose
parameters are this rank's shards and whose step runs the placed joint graph."""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement

from vescale.dtensor.deferred_init import materialize_module
from vescale.passes.options import BackendOptions
from vescale.plan.capture import capture_joint
from vescale.plan.cost import AlphaBeta, calibrate
from vescale.plan.explain import Explanation, explain
from vescale.plan.lower import run_program, to_placements
from vescale.plan.program import PlacedProgram, place
from vescale.plan.propagate import Placements
from vescale.plan.validate import PlanError, normalize_placements, normalize_plan, validate_inputs

__all__ = ["PlanError", "PlannedModule", "parallelize"]

PlanValue = Sequence[Placement] | Mapping[str, Placement]


class _AttachGrads(torch.autograd.Function):
    """The loss, whose backward hands the joint graph's gradients to the parameters."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, *params_and_grads: torch.Tensor) -> torch.Tensor:
        n = len(params_and_grads) // 2
        ctx.grads = params_and_grads[n:]
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        n = len(ctx.grads)
        return (None, *(g * grad for g in ctx.grads), *((None,) * n))


class PlannedModule(nn.Module):
    """The parallelized model: ``module`` holds this rank's shards (DTensor parameters in the
    chosen placements); ``forward(*args)`` runs the placed joint graph (compiled by the
    ``vescale`` backend unless ``compile=False``) and returns the output; when it is a loss,
    ``loss.backward()`` gives every parameter its gradient in the parameter's placements."""

    def __init__(
        self,
        module: nn.Module,
        program: PlacedProgram,
        inputs: Sequence[Placements],
        compile: bool,
        options: dict[str, Any] | None,
    ) -> None:
        super().__init__()
        self.module = module
        self.program = program
        self.input_placements = [tuple(p) for p in inputs]
        self._compile = compile
        self._options = options
        self._step: Any = None

    def explain(self) -> Explanation:
        """What was chosen and why (:func:`vescale.plan.explain`)."""
        return explain(self.program)

    def _flat_state(self) -> list[torch.Tensor]:
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        joint = self.program.joint
        return [params[n] for n in joint.param_names] + [buffers[n] for n in joint.buffer_names]

    def _compiled(self, flat: list[torch.Tensor]) -> Any:
        if self._step is None:
            program = self.program

            def placed_joint_step(*args: Any) -> tuple[Any, ...]:
                return run_program(program, *args)

            if not self._compile:
                self._step = placed_joint_step
            else:
                from vescale.backend import vescale_backend

                graph = torch.fx.Graph()
                phs = [graph.placeholder(f"arg{i}") for i in range(len(flat))]
                graph.output(graph.call_function(placed_joint_step, tuple(phs)))
                gm = torch.fx.GraphModule(nn.Module(), graph)
                self._step = vescale_backend(gm, flat, self._options)
        return self._step

    def forward(self, *args: torch.Tensor) -> Any:
        if len(args) != len(self.input_placements):
            raise TypeError(
                f"vescale.parallelize: expected {len(self.input_placements)} inputs, got {len(args)}"
            )
        state = self._flat_state()
        dargs = [to_placements(a, self.program, p) for a, p in zip(args, self.input_placements)]
        flat = [t.detach() for t in state] + dargs
        outs = self._compiled(flat)(*flat)
        joint = self.program.joint
        if not joint.grad_of:
            return outs[0]
        params = dict(self.module.named_parameters())
        with_grad = [params[joint.grad_of[i]] for i in sorted(joint.grad_of)]
        return _AttachGrads.apply(outs[0], *with_grad, *outs[1:])


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: Mapping[str, PlanValue],
    *,
    inputs: Sequence[PlanValue],
    example_inputs: Sequence[torch.Tensor],
    outputs: Sequence[PlanValue] | None = None,
    solver: str = "global",
    alpha_beta: AlphaBeta | None = None,
    compile: bool = True,
    options: dict[str, Any] | None = None,
) -> PlannedModule:
    """Place ``model`` on ``mesh`` from a partial plan.

    ``plan`` maps parameter/buffer name patterns (``fnmatch``, first match wins) to placements:
    a sequence with one placement per mesh dim, or ``{mesh dim name: placement}`` (other mesh
    dims replicated). ``inputs`` are the placements of the forward arguments, ``example_inputs``
    global tensors (or fake tensors) of their shapes; ``outputs`` those of the model outputs
    (default replicated). Every other tensor's placement is chosen by ``solver``: "global"
    (minimum total communication time over the joint forward+backward graph) or "greedy"
    (op by op, as eager dispatch). ``alpha_beta`` overrides the calibrated cost model; when
    compiled with bucketing on, collectives the ``bucket`` pass merges pay one latency.
    ``model`` is changed in place: its parameters become DTensors in the chosen placements
    (materialized shard-only when it was built with ``vescale.deferred_init``). ``compile``
    compiles the placed step with the ``vescale`` backend (``options`` are its options).
    With ``options["dump_dir"]`` or ``VESCALE_DUMP_DIR``, ``rank<r>/placements.md`` holds
    :func:`vescale.fx.explain`'s report.
    The plan is checked before anything communicates (:class:`PlanError`)."""
    if solver not in ("global", "greedy"):
        raise ValueError(
            f"vescale.parallelize: solver must be 'global' or 'greedy', got {solver!r}"
        )
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    shapes = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]}
    fixed_by_name = normalize_plan(plan, shapes, mesh)
    input_placements = validate_inputs(inputs, example_inputs, mesh)
    output_placements = (
        None
        if outputs is None
        else [normalize_placements(f"outputs[{i}]", p, mesh) for i, p in enumerate(outputs)]
    )
    joint = capture_joint(model, example_inputs)
    fixed = {
        ph: fixed_by_name[n] for n, ph in zip(names, joint.placeholder_names) if n in fixed_by_name
    }
    for ph, p in zip(joint.placeholder_names[len(names) :], input_placements):
        fixed[ph] = p
    cost_model = alpha_beta if alpha_beta is not None else calibrate(mesh)
    buckets = compile and BackendOptions.resolve(options).bucket_cap_mb > 0
    program = place(joint, mesh, fixed, output_placements, cost_model, solver, buckets)
    dump_dir = (options or {}).get("dump_dir") or os.environ.get("VESCALE_DUMP_DIR")
    if dump_dir:
        rank = dist.get_rank() if dist.is_initialized() else 0
        explain(program).write(Path(dump_dir) / f"rank{rank}")
    chosen = program.param_placements()
    materialize_module(model, {glob.escape(n): (mesh, chosen[n]) for n in names})
    return PlannedModule(model, program, input_placements, compile, options)
