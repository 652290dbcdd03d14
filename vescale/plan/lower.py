"""Run a placed joint graph on DTensors: before each node its inputs are redistributed to the
placements its chosen strategy wants, then the op runs through eager DTensor dispatch (local
shapes, local kernels, vescale's op handlers); traced by the ``vescale`` backend this gives
the local program with functional collectives, bucketed and scheduled by the usual passes."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._torch_compat import pytree
from vescale.dtensor import DTensor, Replicate, Shard
from vescale.dtensor.dispatch import explicit_redistribute
from vescale.plan.cost import CommStep, group_of
from vescale.plan.program import PlacedProgram
from vescale.plan.propagate import Placements

_VIEW, _CLONE = torch.ops.aten.view.default, torch.ops.aten.clone.default
__all__ = ["output_leaves", "run_program", "to_placements"]


def to_placements(t: Any, program: PlacedProgram, placements: Placements) -> Any:
    """``t`` (a DTensor, or a tensor every rank holds whole) in ``placements``."""
    if not isinstance(t, _UpstreamDTensor):
        rep = (Replicate(),) * program.mesh.ndim
        t = DTensor.from_local(t, program.mesh, rep, run_check=False)
    if tuple(t.placements) != tuple(placements):
        t = t.redistribute(program.mesh, placements)
    return t


def _is_tensor_node(a: Any) -> bool:
    return isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def run_program(program: PlacedProgram, *flat: Any) -> tuple[Any, ...]:
    """``program`` on ``flat`` (parameters, buffers, then model arguments, as DTensors in
    their chosen placements); returns the output leaves in their demanded placements. The
    program inserts its redistributions itself; where eager dispatch still wants another one
    (its own strategy differs from the chosen one) it is allowed here, explicit mode or not."""
    with explicit_redistribute(False):
        return _run(program, flat)


Early = dict[tuple[torch.fx.Node, Placements], Any]


def output_leaves(program: PlacedProgram) -> list[torch.fx.Node]:
    """The joint graph's output leaves, in the order :func:`run_program` returns them."""
    out = program.joint.gm.graph.output_node()
    return [a for a in pytree.tree_leaves(out.args) if isinstance(a, torch.fx.Node)]


def _run(program: PlacedProgram, flat: tuple[Any, ...]) -> tuple[Any, ...]:
    env: dict[torch.fx.Node, Any] = {}
    inputs = iter(flat)
    nodes = list(program.joint.gm.graph.nodes)
    for node in nodes:
        if node.op == "placeholder":
            env[node] = next(inputs)
    first = program.parameter_nodes
    for node in first:
        env[node] = _eval(program, node, env, {})
    early = _gather_parameters(program, env)
    done = set(first)
    for node in nodes:
        if node.op == "output":
            return _outputs(program, [env[leaf] for leaf in output_leaves(program)])
        if node.op != "placeholder" and node not in done:
            env[node] = _eval(program, node, env, early)
    raise AssertionError("graph without output")


def _eval(
    program: PlacedProgram, node: torch.fx.Node, env: dict[torch.fx.Node, Any], early: Early
) -> Any:
    if node.target is operator.getitem:
        source, index = node.args
        assert isinstance(source, torch.fx.Node)
        return env[source][index]  # type: ignore[index]
    return _run_node(program, node, env, early)


def _gather_parameters(program: PlacedProgram, env: dict[torch.fx.Node, Any]) -> Early:
    """Every bucketed parameter redistribution, keyed by (value, placements): first all
    the all-gathers (a ``Shard(d)`` gathered as ``Shard(0)`` of the transposed local view, so
    no op uses a gathered tensor before the last gather), then the local moves."""
    todo: dict[tuple[torch.fx.Node, Placements], Placements] = {}
    for demand in program.demands:
        if demand.bucket == "parameters":
            src, dst = program.placements(demand.value), program.required(demand)
            if program.bucketed(demand, src, dst):
                todo[(demand.value[0], dst)] = src
    gathered = {}
    for (node, dst), src in todo.items():
        sharded = {i: p for i, p in enumerate(src) if not isinstance(p, Replicate)}
        p = next(iter(sharded.values()))  # one Shard(d) over one mesh dim or a flattened group
        assert isinstance(p, Shard)
        t = env[node] if p.dim == 0 else env[node].transpose(0, p.dim)
        mid = tuple(Replicate() if i in sharded else q for i, q in enumerate(t.placements))
        gathered[(node, dst)] = (t.redistribute(program.mesh, mid), p.dim)
    return {
        key: to_placements(t if d == 0 else t.transpose(0, d), program, key[1])
        for key, (t, d) in gathered.items()
    }


def _outputs(program: PlacedProgram, values: list[Any]) -> tuple[Any, ...]:
    """The output leaves in their demanded placements: the bucketed gradients' reductions
    first (every gradient's first reduction, then every second one), then every local move."""
    demands = program.demands[-len(values) :]
    wanted = [program.required(d) for d in demands]
    stages: list[list[Placements]] = []
    for t, demand, dst in zip(values, demands, wanted):
        src = tuple(t.placements) if isinstance(t, _UpstreamDTensor) else None
        stages.append(_reduced(src, dst, program.bucketed(demand, src, dst)) if src else [])
    out = list(values)
    for k in range(max(map(len, stages), default=0)):
        for i, after in enumerate(stages):
            if k < len(after):
                out[i] = out[i].redistribute(program.mesh, after[k])
    return tuple(to_placements(t, program, dst) for t, dst in zip(out, wanted))


def _reduced(src: Placements, dst: Placements, steps: Sequence[CommStep]) -> list[Placements]:
    """The placements after each of ``steps`` (reductions of ``src -> dst``): the mesh
    dims a step reduces become ``Replicate`` (all-reduce) or their ``dst`` (reduce-scatter)."""
    now, out = list(src), []
    for step in steps:
        for d in group_of(step):
            now[d] = Replicate() if step.kind == "all_reduce" else dst[d]
        out.append(tuple(now))
    return out


def _run_node(
    program: PlacedProgram, node: torch.fx.Node, env: dict[torch.fx.Node, Any], early: Early
) -> Any:
    ns = program.table[node]
    if ns.source == "constant":
        args, kwargs = pytree.tree_map_only(
            torch.fx.Node, env.__getitem__, (node.args, node.kwargs)
        )
        return node.target(*args, **kwargs)  # type: ignore[operator]
    wanted = iter(ns.input_placements[program.chosen[node]])

    def arg(a: Any) -> Any:
        if isinstance(a, list | tuple) and a and all(isinstance(x, torch.fx.Node) for x in a):
            return type(a)(arg(x) for x in a)
        if not isinstance(a, torch.fx.Node):
            return a
        if not _is_tensor_node(a):
            return env[a]
        want = next(wanted)
        hoisted = early.get((a, want))
        return hoisted if hoisted is not None else to_placements(env[a], program, want)

    args = tuple(arg(a) for a in node.args)
    kwargs = {k: arg(v) for k, v in node.kwargs.items()}
    try:
        out = node.target(*args, **kwargs)  # type: ignore[operator]
    except (RuntimeError, ValueError):
        if node.target is not _VIEW or not isinstance(args[0], _UpstreamDTensor):
            raise
        # a local layout the chosen placements changed (a kernel's transposed output made
        # contiguous by a redistribution) may not view as traced: viewed from a contiguous
        # copy, as reshape would (the DTensor's own strides still say it views)
        out = _VIEW(_CLONE(args[0], memory_format=torch.contiguous_format), *args[1:])
    expected = ns.outputs[program.chosen[node]]
    if isinstance(out, tuple | list):
        return type(out)(
            to_placements(o, program, p) if p is not None and isinstance(o, torch.Tensor) else o
            for o, p in zip(out, expected)
        )
    return to_placements(out, program, expected[0]) if expected[0] is not None else out
