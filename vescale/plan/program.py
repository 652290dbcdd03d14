"""A placed joint graph: every node's chosen strategy, from the plan and the cost model."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Replicate, Shard

from vescale import _progress
from vescale._torch_compat import pytree
from vescale.dtensor.flat_groups import flatten_mesh_dims, flattened_mesh
from vescale.dtensor.op_args import bind
from vescale.plan.cache import cached
from vescale.plan.capture import JointGraph
from vescale.plan.cost import (
    AlphaBeta,
    CommStep,
    bucket_copy_s,
    bucketed_steps,
    flat_bucketed_steps,
    flattened_steps,
    group_of,
    redistribution_steps,
    step_time,
    strategy_compute_s,
    tensor_bytes,
)
from vescale.plan.memory import Memory, memory_model
from vescale.plan.propagate import NodeStrategies, Placements, Value, propagate, value_of
from vescale.plan.recipes import recipe_candidates
from vescale.plan.repeats import block_roots
from vescale.plan.solve import (
    TIME_LIMIT_S,
    Demand,
    Problem,
    Solution,
    solve_global,
    solve_greedy,
    solve_once,
    solving_group,
)
from vescale.plan.validate import PlanError

__all__ = ["PlacedProgram", "place"]


@dataclass
class PlacedProgram:
    """The joint graph with ``chosen[node]`` (an index into ``table[node]``'s strategies) and
    the placements each output must arrive in (``output_placements``, one per output leaf);
    ``solution``: how the choice was found (objective, lower bound, greedy's cost)."""

    joint: JointGraph
    mesh: DeviceMesh
    table: dict[torch.fx.Node, NodeStrategies]
    chosen: dict[torch.fx.Node, int]
    demands: list[Demand]
    alpha_beta: AlphaBeta
    solver: str
    timings_s: dict[str, float] = field(default_factory=dict)
    solution: Solution | None = None
    flat: bool = False  # a same-kind step over several mesh dims: one flattened collective
    memory: Memory | None = None
    penalties: int = 0  # data-parallel gathers the choice takes (each DP_GATHER_PENALTY_US)

    def placements(self, value: Value) -> Placements:
        node, k = value
        out = self.table[node].outputs[self.chosen[node]][0 if k is None else k]
        assert out is not None
        return out

    def required(self, demand: Demand) -> Placements:
        for b, node, strategies in demand.options:
            if node is None or self.chosen[node] in strategies:
                return b
        raise AssertionError("no option of a demand is chosen")

    def bucketed(self, demand: Demand, src: Placements, dst: Placements) -> tuple[CommStep, ...]:
        """The collectives of ``demand``'s ``src -> dst`` issued with its bucket's others
        (:func:`vescale.plan.cost.bucketed_steps`; ``()``: none)."""
        if demand.bucket is None or src == dst:
            return ()
        return _bucketed_steps(self.mesh, demand.bucket, demand.value, src, dst, self.flat)

    def steps(self, value: Value, src: Placements, dst: Placements) -> list[CommStep]:
        return _steps(self.mesh, value, src, dst, self.flat) or []

    @functools.cached_property
    def parameter_nodes(self) -> list[torch.fx.Node]:
        """The ops computed from the parameters and buffers alone (no model input), in graph
        order: the program runs them first, then issues their bucketed redistributions."""
        activations = _derived_from_inputs(self.joint)
        return [
            n for n in self.joint.gm.graph.nodes if n.op == "call_function" and n not in activations
        ]

    def input_placements(self) -> list[Placements]:
        """The chosen placements of the model inputs, in argument order."""
        nargs = len(self.joint.param_names) + len(self.joint.buffer_names)
        by_name = {n.name: n for n in self.table}
        return [self.placements((by_name[ph], None)) for ph in self.joint.placeholder_names[nargs:]]

    def param_placements(self) -> dict[str, Placements]:
        names = self.joint.placeholder_names
        by_name = {n.name: n for n in self.table}
        owned = self.joint.param_names + self.joint.buffer_names
        return {owner: self.placements((by_name[ph], None)) for owner, ph in zip(owned, names)}


def _val(value: Value) -> torch.Tensor:
    node, k = value
    val = node.meta["val"]
    return val if k is None else val[k]


def flattens(mesh: DeviceMesh) -> bool:
    """Whether a same-kind step over several dims of ``mesh`` runs as one collective over
    their flattened group (a named mesh whose flattened meshes exist; created here, on every
    rank, so the compiled step finds them; a meta mesh: as a real one of its shape)."""
    if mesh.ndim < 2 or not mesh.mesh_dim_names:
        return False
    if mesh.device_type == "meta":
        return True
    flatten_mesh_dims(mesh)
    return flattened_mesh(mesh, range(mesh.ndim)) is not None


def _steps(
    mesh: DeviceMesh, value: Value, src: Placements, dst: Placements, flat: bool
) -> list[CommStep] | None:
    t = _val(value)
    steps = flattened_steps if flat else redistribution_steps
    return steps(src, dst, tuple(t.shape), t.element_size(), tuple(mesh.shape))


def _bucketed_steps(
    mesh: DeviceMesh, bucket: str, value: Value, src: Placements, dst: Placements, flat: bool
) -> tuple[CommStep, ...]:
    t = _val(value)
    shape, itemsize = tuple(t.shape), t.element_size()
    steps = flat_bucketed_steps if flat else bucketed_steps
    return steps(bucket, src, dst, shape, itemsize, tuple(mesh.shape))


def place(
    joint: JointGraph,
    mesh: DeviceMesh,
    fixed: dict[str, Placements | list[Placements]],
    output_placements: Sequence[Placements] | None,
    alpha_beta: AlphaBeta,
    solver: str = "global",
    buckets: bool = False,
    memory_budget: int | None = None,
    optimizer: str = "sgd",
    time_limit_s: float = TIME_LIMIT_S,
) -> PlacedProgram:
    """Propagate strategies over ``joint`` (placeholders named in ``fixed`` are fixed, or
    chosen among a list of placements) and choose per node with ``solver`` ("global" or
    "greedy"). The model output must arrive in ``output_placements`` (default replicated);
    gradients in their parameters' placements. ``buckets``: the step is compiled with the
    ``bucket`` pass on, so the parameters' gathers and the gradients' all-reduces are priced
    (and issued) as buckets. ``memory_budget``: bytes per rank the choice may hold
    (:mod:`vescale.plan.memory`, ``optimizer``'s state included); :class:`PlanError` naming
    the smallest budget that fits when none does. ``time_limit_s``: the global solve's
    limit, by work (:class:`vescale.plan.solve.Limits`); the standard recipes
    (:mod:`vescale.plan.recipes`) are its candidates."""
    start = time.perf_counter()
    flat = flattens(mesh)
    fixed = _whole_targets(joint, fixed, mesh)
    with _progress.stage("propagate") as shown:
        table = propagate(joint.gm, mesh, fixed)
        shown.detail = f"{len(table)} nodes"
    propagated = time.perf_counter()
    activations = _derived_from_inputs(joint)
    demands = _demands(joint, mesh, table, output_placements, activations if buckets else None)
    dp_dims = _data_parallel_dims(joint, fixed, mesh)
    memory = memory_model(joint, table, mesh, optimizer, memory_budget)
    check_budget(memory, None)

    def cost(value: Value, a: Placements, b: Placements) -> float | None:
        t = _val(value)
        return shape_cost(tuple(t.shape), t.element_size(), value[0] in activations, a, b)

    ids: dict[Placements, int] = {}
    by_id: list[Placements] = []

    def intern(p: Placements) -> int:
        if p not in ids:
            ids[p] = len(by_id)
            by_id.append(p)
        return ids[p]

    def pair_costs(value: Value, srcs: list[Placements], dsts: list[Placements]) -> np.ndarray:
        t = _val(value)
        key = (tuple(t.shape), t.element_size(), value[0] in activations)
        ia, ib = [intern(a) for a in srcs], [intern(b) for b in dsts]
        return np.array([[id_cost(key, i, j) for j in ib] for i in ia], dtype=float).reshape(
            len(ia), len(ib)
        )

    @functools.cache
    def id_cost(key: tuple[tuple[int, ...], int, bool], i: int, j: int) -> float:
        c = shape_cost(*key, by_id[i], by_id[j])
        return float("inf") if c is None else c

    @functools.cache  # values of one shape share their prices
    def shape_cost(
        shape: tuple[int, ...], itemsize: int, activation: bool, a: Placements, b: Placements
    ) -> float | None:
        steps = (flattened_steps if flat else redistribution_steps)(
            a, b, shape, itemsize, tuple(mesh.shape)
        )
        if steps is None:
            return None
        penalty = DP_GATHER_PENALTY_US if activation and _gathers(steps, dp_dims) else 0.0
        return penalty + sum(step_time(alpha_beta, s) for s in steps) * 1e6

    @functools.cache  # the greedy pass, the program and the objective ask again
    def compute(node: torch.fx.Node, s: int) -> float:
        ns = table[node]
        if ns.source in ("plan", "free", "constant", "input"):
            return 0.0
        held = 0
        for value, p in zip(ns.inputs, ns.input_placements[s]):
            held += tensor_bytes(_val(value), p, mesh)
        vals = node.meta.get("val")
        outs = vals if isinstance(vals, tuple | list) else (vals,)
        for v, q in zip(outs, ns.outputs[s]):
            if q is not None and isinstance(v, torch.Tensor):
                held += tensor_bytes(v, q, mesh)
        inside = ns.internal[s] if ns.internal else ()
        out = ns.outputs[s][0] or ()
        work = strategy_compute_s(alpha_beta, node, out, tuple(mesh.shape), held)
        return (work + sum(step_time(alpha_beta, c) for c in inside)) * 1e6

    def latency(bucket: str, value: Value, a: Placements, b: Placements) -> dict[Any, float]:
        steps = _bucketed_steps(mesh, bucket, value, a, b, flat)
        return {(s.kind, group_of(s)): alpha_beta.latency(s) * 1e6 for s in steps}

    def packing(bucket: str, value: Value, a: Placements, b: Placements) -> float:
        steps = _bucketed_steps(mesh, bucket, value, a, b, flat)
        return sum(bucket_copy_s(alpha_beta, s) for s in steps) * 1e6

    candidates = recipe_candidates(joint, table, mesh) if solver == "global" else []
    twins = block_roots(joint, table, activations) if solver == "global" else {}
    problem = Problem(
        table, demands, cost, compute, pair_costs, latency, memory, packing, candidates, twins
    )
    solve = cached(
        functools.partial(solve_global, time_limit_s=time_limit_s)
        if solver == "global"
        else solve_greedy,
        f"{solver} {alpha_beta!r} mesh={tuple(mesh.shape)} flat={flat} dp={sorted(dp_dims)} "
        f"activations={sorted(n.name for n in activations)} time_limit_s={time_limit_s!r}",
    )
    solution = solve_once(solve, problem, solving_group(mesh))  # rank 0's, when it spans the world
    check_budget(memory, solution.chosen)  # every rank holds the same choice: the same error
    timings = {"propagate": propagated - start, "solve": time.perf_counter() - propagated}
    program = PlacedProgram(
        joint,
        mesh,
        table,
        solution.chosen,
        demands,
        alpha_beta,
        solver,
        timings,
        solution,
        flat,
        memory,
    )
    for demand in demands:  # the penalties the objective holds, to report the step without
        src, dst = program.placements(demand.value), program.required(demand)
        if src != dst and demand.value[0] in activations:
            program.penalties += _gathers(program.steps(demand.value, src, dst), dp_dims)
    return program


def _gathers(steps: Sequence[CommStep], dp_dims: set[int]) -> bool:
    """Whether ``steps`` gather over a data-parallel mesh dim (:data:`DP_GATHER_PENALTY_US`)."""
    return any(s.kind == "all_gather" and dp_dims.intersection(group_of(s)) for s in steps)


def check_budget(memory: Memory, chosen: dict[torch.fx.Node, int] | None) -> None:
    """:class:`PlanError` when no choice fits ``memory.budget`` (``chosen``: the solver's,
    over budget when even the leanest choice it could reach is), naming the smallest budget
    that fits."""
    if memory.budget is None:
        return
    least = memory.least()
    if chosen is None and memory.budget >= least:
        return
    if chosen is not None and memory.of(chosen)["total"] <= memory.budget:
        return
    fits = least if chosen is None else memory.of(chosen)["total"]
    raise PlanError(
        f"vescale.parallelize: memory_budget={memory.budget} bytes per rank fits no placement "
        f"of this model ({memory.optimizer} state counted); the smallest budget that fits is "
        f"{fits} bytes ({fits / 2**20:.2f} MiB): parameters, gradients and optimizer state "
        f"sharded over every mesh dim, the batch split as far as the inputs allow. Raise "
        f"memory_budget to at least {fits}, or shard more (a larger mesh, a lighter optimizer)."
    )


DP_GATHER_PENALTY_US = 1e6  # 1 s: taken only where no strategy keeps the batch split


def _data_parallel_dims(
    joint: JointGraph, fixed: dict[str, Placements | list[Placements]], mesh: DeviceMesh
) -> set[int]:
    """Mesh dims on which the plan shards a model input along dim 0 (the batch), or over which
    a :class:`vescale.plan.Batch` input may be split (on its batch dim). Gathering a
    value computed from the inputs over them costs :data:`DP_GATHER_PENALTY_US` more: the user
    asked for data parallelism there, and on models too small to amortize a gradient
    reduction the cost model alone would rather replicate the whole computation."""
    args = joint.placeholder_names[len(joint.param_names) + len(joint.buffer_names) :]
    out = set()
    for name in args:
        given = fixed.get(name, ())
        for d, p in enumerate(given) if not isinstance(given, list) else ():
            if isinstance(p, Shard) and p.dim == 0 and mesh.size(d) > 1:
                out.add(d)
        for choice in given if isinstance(given, list) else ():
            out.update(d for d, p in enumerate(choice) if p.is_shard() and mesh.size(d) > 1)
    return out


def _whole_targets(
    joint: JointGraph, fixed: dict[str, Placements | list[Placements]], mesh: DeviceMesh
) -> dict[str, Placements | list[Placements]]:
    """``fixed`` with ``Replicate`` added to the choices of each :class:`vescale.plan.Batch`
    input used only as a loss's ``target`` (through views and reshape's copies): every rank
    is given the whole input, so holding it whole costs nothing, and a loss may then count
    the global total weight locally instead of all-reducing it. The batch itself stays split:
    the target's rows are sliced to the input's."""
    out = dict(fixed)
    nodes = {n.name: n for n in joint.gm.graph.nodes if n.op == "placeholder"}
    rep: Placements = (Replicate(),) * mesh.ndim
    for name, given in fixed.items():
        if isinstance(given, list) and rep not in given and _only_a_target(nodes[name]):
            out[name] = [*given, rep]
    return out


_COPIES = {torch.ops.aten.clone.default, torch.ops.aten._unsafe_view.default}  # reshape's


def _only_a_target(node: torch.fx.Node) -> bool:
    """Whether every use of ``node``, seen through views and copies of it, is an op's
    ``target``."""
    for user in node.users:
        op = user.target
        if not isinstance(op, torch._ops.OpOverload):
            return False
        if (op.is_view or op in _COPIES) and user.args and user.args[0] is node:
            if not _only_a_target(user):
                return False
            continue
        bound = bind(op, user.args, user.kwargs)
        if [n for n, a in bound.items() if a is node] != ["target"]:
            return False
    return bool(node.users)


def _derived_from_inputs(joint: JointGraph) -> set[torch.fx.Node]:
    args = set(joint.placeholder_names[len(joint.param_names) + len(joint.buffer_names) :])
    out: set[torch.fx.Node] = set()
    for node in joint.gm.graph.nodes:
        if (node.op == "placeholder" and node.name in args) or any(
            a in out for a in node.all_input_nodes
        ):
            out.add(node)
    return out


def _demands(
    joint: JointGraph,
    mesh: DeviceMesh,
    table: dict[torch.fx.Node, NodeStrategies],
    output_placements: Sequence[Placements] | None,
    activations: set[torch.fx.Node] | None,
) -> list[Demand]:
    """Every consumer input and output leaf; bucketed (given ``activations``): a value
    computed from the parameters alone as input of an op on the activations
    (``"parameters"``), a gradient (``"gradients"``)."""
    out: list[Demand] = []
    for node, ns in table.items():
        for i, value in enumerate(ns.inputs):
            options: dict[Placements, list[int]] = {}
            for s, ins in enumerate(ns.input_placements):
                options.setdefault(ins[i], []).append(s)
            reason = f"input {i} of {node.target}"
            param = activations is not None and value[0] not in activations and node in activations
            opts: list[tuple[Placements, torch.fx.Node | None, list[int]]]
            opts = [(b, node, ss) for b, ss in options.items()]
            out.append(Demand(value, opts, reason, "parameters" if param else None))
    output = next(n for n in joint.gm.graph.nodes if n.op == "output")
    leaves = [a for a in pytree.tree_leaves(output.args) if isinstance(a, torch.fx.Node)]
    placeholders = {n.name: n for n in table if n.op == "placeholder"}
    param_node = dict(zip(joint.param_names, [placeholders[p] for p in joint.placeholder_names]))
    rep: Placements = (Replicate(),) * mesh.ndim
    for i, leaf in enumerate(leaves):
        value = value_of(leaf)
        if i in joint.grad_of:
            pnode = param_node[joint.grad_of[i]]
            tied = [(outs[0], pnode, [s]) for s, outs in enumerate(table[pnode].outputs)]
            reason = f"gradient of {joint.grad_of[i]} in its parameter's placements"
            bucket = "gradients" if activations is not None else None
            out.append(Demand(value, tied, reason, bucket))  # type: ignore[arg-type]
        else:
            want = tuple(output_placements[i]) if output_placements else rep
            # read after the step: its reduction joins the gradients' bucket
            bucket = "gradients" if activations is not None else None
            out.append(Demand(value, [(want, None, [])], f"output {i} as asked", bucket))
    return out
