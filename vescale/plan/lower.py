"""Run a placed joint graph on DTensors: before each node its inputs are redistributed to the
placements its chosen strategy wants, then the op runs through eager DTensor dispatch (local
shapes, local kernels, vescale's op handlers); traced by the ``vescale`` backend this gives
the local program with functional collectives, bucketed and scheduled by the usual passes."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._torch_compat import pytree
from vescale.dtensor import DTensor, Replicate
from vescale.dtensor.dispatch import explicit_redistribute
from vescale.plan.program import PlacedProgram
from vescale.plan.propagate import Placements

__all__ = ["run_program", "to_placements"]


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


def _run(program: PlacedProgram, flat: tuple[Any, ...]) -> tuple[Any, ...]:
    env: dict[torch.fx.Node, Any] = {}
    inputs = iter(flat)
    for node in program.joint.gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(inputs)
        elif node.op == "output":
            leaves = [a for a in pytree.tree_leaves(node.args) if isinstance(a, torch.fx.Node)]
            outs = []
            for leaf, demand in zip(leaves, program.demands[-len(leaves) :]):
                outs.append(to_placements(env[leaf], program, program.required(demand)))
            return tuple(outs)
        elif node.target is operator.getitem:
            env[node] = env[node.args[0]][node.args[1]]
        else:
            env[node] = _run_node(program, node, env)
    raise AssertionError("graph without output")


def _run_node(program: PlacedProgram, node: torch.fx.Node, env: dict[torch.fx.Node, Any]) -> Any:
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
        return to_placements(env[a], program, next(wanted))

    args = tuple(arg(a) for a in node.args)
    kwargs = {k: arg(v) for k, v in node.kwargs.items()}
    out = node.target(*args, **kwargs)  # type: ignore[operator]
    expected = ns.outputs[program.chosen[node]]
    if isinstance(out, tuple | list):
        return type(out)(
            to_placements(o, program, p) if p is not None and isinstance(o, torch.Tensor) else o
            for o, p in zip(out, expected)
        )
    return to_placements(out, program, expected[0]) if expected[0] is not None else out
