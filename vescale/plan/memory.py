"""Per-rank memory of a placed joint graph: parameters, their gradients and optimizer state
in the parameters' placements, buffers, and an activation peak estimate (the forward values
the backward reads, each in its producer's chosen placements: all of them are alive when
the backward starts). Linear in the choice (bytes per node and strategy), so a budget is one
row of the integer program (:mod:`vescale.plan.solve`).

Not counted: the step's transient buffers (gathered parameters, unreduced gradients,
redistribution copies, the backward's temporaries) and the allocator's overhead.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh

from vescale._torch_compat import pytree
from vescale.plan.capture import JointGraph
from vescale.plan.cost import tensor_bytes
from vescale.plan.propagate import NodeStrategies, Placements, value_of

__all__ = ["OPTIMIZER_STATES", "Memory", "memory_model", "optimizer_states"]

# tensors of optimizer state per parameter, each of the parameter's shape and placements
OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "adagrad": 1, "rmsprop": 1, "adam": 2, "adamw": 2}
KINDS = ("parameters", "gradients", "optimizer", "buffers", "inputs", "activations")


def optimizer_states(name: str) -> int:
    """Optimizer-state tensors per parameter of the optimizer ``name``; ``ValueError`` naming
    the known ones otherwise."""
    if not isinstance(name, str) or name.lower() not in OPTIMIZER_STATES:
        raise ValueError(
            f"vescale.parallelize: optimizer must be one of {sorted(OPTIMIZER_STATES)} "
            f"(its state per parameter is counted in memory_budget), got {name!r}"
        )
    return OPTIMIZER_STATES[name.lower()]


@dataclass
class Memory:
    """``terms[node][s]``: per kind (:data:`KINDS`), the bytes one rank holds for ``node``
    when its strategy ``s`` is chosen. ``budget``: the bytes allowed (``None``: no limit)."""

    terms: dict[torch.fx.Node, list[dict[str, int]]]
    optimizer: str
    budget: int | None = None
    per_strategy: dict[torch.fx.Node, list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.per_strategy = {n: [sum(t.values()) for t in ts] for n, ts in self.terms.items()}

    def of(self, chosen: dict[torch.fx.Node, int]) -> dict[str, int]:
        """Bytes per kind of the choice ``chosen`` (and ``"total"``)."""
        out = dict.fromkeys(KINDS, 0)
        for node, terms in self.terms.items():
            for kind, b in terms[chosen[node]].items():
                out[kind] += b
        out["total"] = sum(out[k] for k in KINDS)
        return out

    def least(self) -> int:
        """Each node in its leanest strategy: no choice holds less."""
        return sum(min(b) for b in self.per_strategy.values())


def _bytes(t: torch.Tensor, p: Placements | None, mesh: DeviceMesh) -> int:
    if p is None:
        return 0
    return tensor_bytes(t, p, mesh)


def _saved(joint: JointGraph) -> dict[torch.fx.Node, set[int | None]]:
    """The forward values the backward reads: ``{node: output indices}`` (``None``: its only
    output), for nodes computed from the model inputs."""
    nodes = list(joint.gm.graph.nodes)
    output = nodes[-1]
    leaves = [a for a in pytree.tree_leaves(output.args) if isinstance(a, torch.fx.Node)]
    if not joint.grad_of or not leaves:
        return {}
    forward: set[torch.fx.Node] = set()
    stack = [leaves[0]]
    while stack:
        node = stack.pop()
        if node not in forward:
            forward.add(node)
            stack.extend(node.all_input_nodes)
    nargs = len(joint.param_names) + len(joint.buffer_names)
    inputs = set(joint.placeholder_names[nargs:])
    derived: set[torch.fx.Node] = set()
    for node in nodes:
        if (node.op == "placeholder" and node.name in inputs) or any(
            a in derived for a in node.all_input_nodes
        ):
            derived.add(node)

    def in_backward(user: torch.fx.Node) -> bool:
        return user not in forward and user.op == "call_function"

    saved: dict[torch.fx.Node, set[int | None]] = {}
    for node in forward & derived:
        if node.op == "placeholder" or node.target is operator.getitem:
            continue
        for user in node.users:
            if user.target is operator.getitem and user in forward:
                if any(in_backward(u) for u in user.users):
                    src, k = value_of(user)
                    saved.setdefault(src, set()).add(k)
            elif in_backward(user):
                src, k = value_of(user) if user.target is operator.getitem else (node, None)
                saved.setdefault(src, set()).add(k)
    return saved


def memory_model(
    joint: JointGraph,
    table: dict[torch.fx.Node, NodeStrategies],
    mesh: DeviceMesh,
    optimizer: str = "sgd",
    budget: int | None = None,
) -> Memory:
    """The per-rank bytes of every node's strategies (module docstring)."""
    states = optimizer_states(optimizer)
    by_name = {n.name: n for n in table}
    trained = set(joint.grad_of.values())
    owners = joint.param_names + joint.buffer_names
    terms: dict[torch.fx.Node, list[dict[str, int]]] = {}
    for i, ph in enumerate(joint.placeholder_names):
        node = by_name[ph]
        val = node.meta["val"]
        per = []
        for (p,) in table[node].outputs:
            b = _bytes(val, p, mesh)
            if i >= len(owners):
                per.append({"inputs": b})
            elif i >= len(joint.param_names):
                per.append({"buffers": b})
            elif owners[i] in trained:
                per.append({"parameters": b, "gradients": b, "optimizer": states * b})
            else:
                per.append({"parameters": b})
        terms[node] = per
    for node, ks in _saved(joint).items():
        val = node.meta["val"]
        per = []
        for outs in table[node].outputs:
            b = sum(_bytes(val if k is None else val[k], outs[k or 0], mesh) for k in ks)
            per.append({"activations": b})
        terms[node] = per
    return Memory(terms, optimizer.lower(), budget)
