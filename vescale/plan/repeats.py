"""Repeated blocks of a joint graph (the layers of a ``ModuleList``): every node of block
``k + 1`` mapped to its twin in block ``k``, so the solve takes one choice per class of twins
and prices one edge per class of twin edges, times its members (:mod:`vescale.plan.solve`):
the program is one block's size plus its boundaries', whatever the number of blocks.

Twins: a parameter or buffer named as another but for its first module index, one less
(``blocks.1.attn.q.weight`` -> ``blocks.0.attn.q.weight``); then, until nothing changes, an
op and a user of its inputs' twins with the same target, non-tensor arguments, output
shapes, strategies and dependence on the model inputs, whose inputs pair up as the same
node, twins, or two activations not both with twins (a block's boundary: its input is the
previous block's output, which has a twin, the first block's the embedding's, which has
none; tying their consumers needs only the consumers alike). Twins form classes; any such tying only restricts
the program (twins have the same strategies), so a choice equal in every block is what the
shared program finds, priced on the whole graph.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from vescale.plan.capture import JointGraph
from vescale.plan.propagate import NodeStrategies

__all__ = ["block_roots"]

_INDEX = re.compile(r"\.(\d+)\.")


def block_roots(
    joint: JointGraph,
    table: dict[torch.fx.Node, NodeStrategies],
    activations: set[torch.fx.Node],
) -> dict[torch.fx.Node, torch.fx.Node]:
    """``{node: the first of its class in table order}`` for every other node of ``table``
    in a class of twins (module docstring); ``activations``: the nodes computed from the
    model inputs."""
    nodes = list(joint.gm.graph.nodes)
    placeholders = {n.name: n for n in nodes if n.op == "placeholder"}
    owners = joint.param_names + joint.buffer_names
    by_owner = {o: placeholders[ph] for o, ph in zip(owners, joint.placeholder_names)}
    classes = _Classes()
    paired: set[torch.fx.Node] = set()  # a node pairs with one later and one earlier twin
    taken: set[torch.fx.Node] = set()

    def alike(a: torch.fx.Node, b: torch.fx.Node) -> bool:
        return (a in activations) == (b in activations) and _alike(a, b, table)

    for owner, node in by_owner.items():
        index = _INDEX.search(owner)
        if index is None or index[1] == "0":
            continue
        earlier = by_owner.get(
            f"{owner[: index.start()]}.{int(index[1]) - 1}.{owner[index.end() :]}"
        )
        if earlier is not None and alike(node, earlier):
            classes.union(node, earlier)
            paired.add(node)
            taken.add(earlier)

    def inputs_pair(a: torch.fx.Node, b: torch.fx.Node) -> bool:
        if a is b or classes.same(a, b):
            return True
        both = a in activations and b in activations
        return both and not (classes.has(a) and classes.has(b))

    ops = [n for n in nodes if n.op == "call_function"]
    changed = True
    while changed:
        changed = False
        for node in ops:
            if node in paired:
                continue
            inputs = node.all_input_nodes
            candidates = {u: None for a in inputs for t in classes.members(a) for u in t.users}
            for m in candidates:
                if m is node or m in taken or classes.same(m, node) or not alike(node, m):
                    continue
                theirs = m.all_input_nodes
                if len(theirs) == len(inputs) and all(map(inputs_pair, inputs, theirs)):
                    classes.union(node, m)
                    paired.add(node)
                    taken.add(m)
                    changed = True
                    break
    order = {n: i for i, n in enumerate(table)}
    roots: dict[torch.fx.Node, torch.fx.Node] = {}
    for members in classes.groups():
        placed = sorted((m for m in members if m in order), key=order.__getitem__)
        for m in placed[1:]:
            roots[m] = placed[0]
    return roots


class _Classes:
    """Union-find over nodes."""

    def __init__(self) -> None:
        self.parent: dict[torch.fx.Node, torch.fx.Node] = {}
        self.of: dict[torch.fx.Node, list[torch.fx.Node]] = {}

    def find(self, n: torch.fx.Node) -> torch.fx.Node:
        while self.parent.get(n, n) is not n:
            n = self.parent[n]
        return n

    def has(self, n: torch.fx.Node) -> bool:
        return n in self.parent

    def same(self, a: torch.fx.Node, b: torch.fx.Node) -> bool:
        return self.has(a) and self.has(b) and self.find(a) is self.find(b)

    def members(self, n: torch.fx.Node) -> list[torch.fx.Node]:
        return self.of[self.find(n)] if self.has(n) else []

    def union(self, a: torch.fx.Node, b: torch.fx.Node) -> None:
        for n in (a, b):
            if n not in self.parent:
                self.parent[n] = n
                self.of[n] = [n]
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[rb] = ra
            self.of[ra] += self.of.pop(rb)

    def groups(self) -> list[list[torch.fx.Node]]:
        return list(self.of.values())


def _shapes(val: Any) -> Any:
    vals = val if isinstance(val, tuple | list) else (val,)
    return [(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for v in vals]


def _alike(a: torch.fx.Node, b: torch.fx.Node, table: dict[torch.fx.Node, NodeStrategies]) -> bool:
    """Same op (a placeholder's target is its name), non-tensor arguments, output shapes
    and strategies."""
    if a.op != b.op or (a.op != "placeholder" and a.target != b.target):
        return False
    blank = lambda _: None  # noqa: E731
    args = torch.fx.node.map_arg((a.args, a.kwargs), blank)
    if args != torch.fx.node.map_arg((b.args, b.kwargs), blank):
        return False
    if _shapes(a.meta.get("val")) != _shapes(b.meta.get("val")):
        return False
    sa, sb = table.get(a), table.get(b)
    if sa is None or sb is None:
        return sa is sb
    return (
        sa.source == sb.source
        and sa.outputs == sb.outputs
        and sa.input_placements == sb.input_placements
        and sa.internal == sb.internal
    )
