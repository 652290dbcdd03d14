"""A placed joint graph: every node's chosen strategy, from the plan and the cost model."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Replicate, Shard

from vescale.plan.capture import JointGraph
from vescale.plan.cost import AlphaBeta, CommStep, local_bytes, redistribution_steps
from vescale.plan.handlers import handler_strategies
from vescale.plan.propagate import NodeStrategies, Placements, Value, propagate, value_of
from vescale.plan.solve import Demand, Problem, solve_global, solve_greedy

__all__ = ["PlacedProgram", "place"]


@dataclass
class PlacedProgram:
    """The joint graph with ``chosen[node]`` (an index into ``table[node]``'s strategies) and
    the placements each output must arrive in (``output_placements``, one per output leaf)."""

    joint: JointGraph
    mesh: DeviceMesh
    table: dict[torch.fx.Node, NodeStrategies]
    chosen: dict[torch.fx.Node, int]
    demands: list[Demand]
    alpha_beta: AlphaBeta
    solver: str
    timings_s: dict[str, float] = field(default_factory=dict)

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

    def steps(self, value: Value, src: Placements, dst: Placements) -> list[CommStep]:
        return _steps(self.mesh, value, src, dst) or []

    def param_placements(self) -> dict[str, Placements]:
        names = self.joint.placeholder_names
        by_name = {n.name: n for n in self.table}
        owned = self.joint.param_names + self.joint.buffer_names
        return {owner: self.placements((by_name[ph], None)) for owner, ph in zip(owned, names)}


def _val(value: Value) -> torch.Tensor:
    node, k = value
    val = node.meta["val"]
    return val if k is None else val[k]


def _held(mesh: DeviceMesh, t: torch.Tensor, placements: Placements) -> int:
    return local_bytes(placements, tuple(t.shape), t.element_size(), tuple(mesh.shape))


def _steps(
    mesh: DeviceMesh, value: Value, src: Placements, dst: Placements
) -> list[CommStep] | None:
    t = _val(value)
    return redistribution_steps(src, dst, tuple(t.shape), t.element_size(), tuple(mesh.shape))


def place(
    joint: JointGraph,
    mesh: DeviceMesh,
    fixed: dict[str, Placements],
    output_placements: Sequence[Placements] | None,
    alpha_beta: AlphaBeta,
    solver: str = "global",
) -> PlacedProgram:
    """Propagate strategies over ``joint`` (placeholders named in ``fixed`` are fixed) and
    choose per node with ``solver`` ("global" or "greedy"). The model output must arrive in
    ``output_placements`` (default replicated); gradients in their parameters' placements."""
    start = time.perf_counter()
    table = propagate(joint.gm, mesh, fixed, handler_strategies)
    propagated = time.perf_counter()
    demands = _demands(joint, mesh, table, output_placements)
    dp_dims = _data_parallel_dims(joint, fixed, mesh)
    activations = _derived_from_inputs(joint)

    @functools.cache
    def cost(value: Value, a: Placements, b: Placements) -> float | None:
        steps = _steps(mesh, value, a, b)
        if steps is None:
            return None
        penalty = 0.0
        if value[0] in activations and any(
            s.mesh_dim in dp_dims and s.kind == "all_gather" for s in steps
        ):
            penalty = DP_GATHER_PENALTY_US  # data-parallel work stays split (_data_parallel_dims)
        return penalty + sum(alpha_beta.time(s) for s in steps) * 1e6

    def compute(node: torch.fx.Node, s: int) -> float:
        ns = table[node]
        if ns.source in ("plan", "free", "constant"):
            return 0.0
        held = 0
        for value, p in zip(ns.inputs, ns.input_placements[s]):
            held += _held(mesh, _val(value), p)
        vals = node.meta.get("val")
        outs = vals if isinstance(vals, tuple | list) else (vals,)
        for v, q in zip(outs, ns.outputs[s]):
            if q is not None and isinstance(v, torch.Tensor):
                held += _held(mesh, v, q)
        inside = ns.internal[s] if ns.internal else ()
        return (alpha_beta.gamma * held + sum(alpha_beta.time(c) for c in inside)) * 1e6

    problem = Problem(table, demands, cost, compute)
    chosen = _solve_once(problem, solver, mesh)
    timings = {"propagate": propagated - start, "solve": time.perf_counter() - propagated}
    return PlacedProgram(joint, mesh, table, chosen, demands, alpha_beta, solver, timings)


DP_GATHER_PENALTY_US = 1e6  # 1 s: taken only where no strategy keeps the batch split


def _data_parallel_dims(
    joint: JointGraph, fixed: dict[str, Placements], mesh: DeviceMesh
) -> set[int]:
    """Mesh dims on which the plan shards a model input along dim 0 (the batch). Gathering a
    value computed from the inputs over them costs :data:`DP_GATHER_PENALTY_US` more: the user
    asked for data parallelism there, and on models too small to amortize a gradient
    reduction the cost model alone would rather replicate the whole computation."""
    args = joint.placeholder_names[len(joint.param_names) + len(joint.buffer_names) :]
    return {
        d
        for name in args
        for d, p in enumerate(fixed.get(name, ()))
        if isinstance(p, Shard) and p.dim == 0 and mesh.size(d) > 1
    }


def _derived_from_inputs(joint: JointGraph) -> set[torch.fx.Node]:
    args = set(joint.placeholder_names[len(joint.param_names) + len(joint.buffer_names) :])
    out: set[torch.fx.Node] = set()
    for node in joint.gm.graph.nodes:
        if (node.op == "placeholder" and node.name in args) or any(
            a in out for a in node.all_input_nodes
        ):
            out.add(node)
    return out


def _solve_once(problem: Problem, solver: str, mesh: DeviceMesh) -> dict[torch.fx.Node, int]:
    """Solve on the first rank and broadcast the choice when the mesh spans the whole world
    (every rank then holds the same choice by construction); otherwise every rank solves the
    same problem, deterministically."""
    solve = solve_global if solver == "global" else solve_greedy
    spans_world = (
        dist.is_initialized()
        and mesh.device_type != "meta"
        and dist.get_backend() != "fake"
        and mesh.size() == dist.get_world_size() > 1
    )
    if not spans_world:
        return solve(problem)
    nodes = list(problem.table)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        chosen = solve(problem)
        box = [[chosen[n] for n in nodes]]
    dist.broadcast_object_list(box, src=0)
    return dict(zip(nodes, box[0]))


def _demands(
    joint: JointGraph,
    mesh: DeviceMesh,
    table: dict[torch.fx.Node, NodeStrategies],
    output_placements: Sequence[Placements] | None,
) -> list[Demand]:
    out: list[Demand] = []
    for node, ns in table.items():
        for i, value in enumerate(ns.inputs):
            options: dict[Placements, list[int]] = {}
            for s, ins in enumerate(ns.input_placements):
                options.setdefault(ins[i], []).append(s)
            reason = f"input {i} of {node.target}"
            out.append(Demand(value, [(b, node, ss) for b, ss in options.items()], reason))
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
            out.append(Demand(value, tied, reason))  # type: ignore[arg-type]
        else:
            want = tuple(output_placements[i]) if output_placements else rep
            out.append(Demand(value, [(want, None, [])], f"output {i} as asked"))
    return out
