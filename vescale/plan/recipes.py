"""The standard recipes as candidate choices of the solve (:attr:`Problem.candidates`): per
mesh dim DDP (parameters replicated, the batch split), FSDP (parameters ``Shard(0)``, the
batch split) or Megatron TP (column-parallel weights, with their biases, ``Shard`` on their
output features, the row-parallel weights they feed on their input features, the rest
replicated, the batch whole), in every assignment to the mesh dims with at most one TP dim.

A recipe fixes only what the plan leaves open: the free parameters (a placement their
strategies lack is replicated on that dim) and the inputs given a choice
(:class:`vescale.plan.Batch`: the one split over exactly the recipe's data-parallel dims, if
any); the solve completes it greedily and prices it like any choice.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from vescale.plan.capture import JointGraph
from vescale.plan.propagate import NodeStrategies, Placements

__all__ = ["ROLES", "recipe_candidates"]

ROLES = ("DDP", "FSDP", "TP")
aten = torch.ops.aten
_MATMULS = {aten.mm.default, aten.addmm.default}
_NORMS = {aten.native_layer_norm.default, aten.embedding.default}
_VIEWS = {aten.t.default, aten.view.default, aten._unsafe_view.default, aten.transpose.int}


def recipe_candidates(
    joint: JointGraph, table: dict[torch.fx.Node, NodeStrategies], mesh: DeviceMesh
) -> list[tuple[str, dict[torch.fx.Node, int]]]:
    """Every recipe (module docstring) as ``(name, {placeholder: strategy index})``, e.g.
    ``("FSDP over dp x TP over tp", ...)``; recipes fixing the same choices are listed once."""
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    split = [d for d in range(mesh.ndim) if mesh.size(d) > 1]
    tp = megatron_shard_dims(joint)
    params = set(joint.placeholder_names[: len(joint.param_names)])
    out: list[tuple[str, dict[torch.fx.Node, int]]] = []
    seen: list[dict[torch.fx.Node, int]] = []
    for roles in itertools.product(ROLES, repeat=len(split)):
        if roles.count("TP") > 1 or (len(split) > 1 and roles.count("TP") == len(split)):
            continue
        role = dict(zip(split, roles))
        chosen: dict[torch.fx.Node, int] = {}
        for node, ns in table.items():
            if ns.source == "free" and node.name in params:
                want = tuple(
                    _param_placement(role.get(d), tp.get(node.name)) for d in range(mesh.ndim)
                )
                chosen[node] = _index(ns, want)
            elif ns.source == "input":
                dp = {d for d, r in role.items() if r != "TP"}
                s = next((s for s, (p,) in enumerate(ns.outputs) if _split_dims(p) == dp), None)
                if s is not None:
                    chosen[node] = s
        if chosen in seen:
            continue
        seen.append(chosen)
        out.append((_name(role, names), chosen))
    return out


def _param_placement(role: str | None, tp_dim: int | None) -> Placement:
    if role == "FSDP":
        return Shard(0)
    if role == "TP" and tp_dim is not None:
        return Shard(tp_dim)
    return Replicate()


def _index(ns: NodeStrategies, want: Placements) -> int:
    """The strategy of a free parameter placed ``want``, each dim its strategies lack
    replicated."""
    outs = [p for (p,) in ns.outputs]
    for keep in range(len(want), -1, -1):
        for dims in itertools.combinations(range(len(want)), keep):
            p = tuple(want[d] if d in dims else Replicate() for d in range(len(want)))
            if p in outs:
                return outs.index(p)
    return 0


def _split_dims(p: Placements | None) -> set[int]:
    return {d for d, q in enumerate(p or ()) if q.is_shard()}


def _name(role: dict[int, str], names: tuple[str, ...]) -> str:
    parts: dict[str, list[str]] = {}
    for d, r in role.items():
        parts.setdefault(r, []).append(names[d])
    if not parts:
        return "one device's program on every rank"
    return " x ".join(f"{r} over {'+'.join(dims)}" for r, dims in parts.items())


def megatron_shard_dims(joint: JointGraph) -> dict[str, int]:
    """``{placeholder name: tensor dim}`` Megatron TP shards: a weight used by a matmul
    whose activation input comes only from column-parallel matmuls (through any ops but a
    norm or an embedding) is row-parallel, sharded on its input features; every other
    matmul's weight is column-parallel, sharded on its output features, with its ``addmm``
    bias. ``F.linear``'s ``t(W)`` shards ``W`` as the transpose."""
    nparams = len(joint.param_names)
    params = {n for n in joint.gm.graph.nodes if n.op == "placeholder"}
    params = {n for n in params if n.name in joint.placeholder_names[:nparams]}
    out: dict[str, int] = {}
    column: dict[torch.fx.Node, bool] = {}  # activation -> computed from column-parallel only

    def from_column(node: torch.fx.Node) -> bool:
        if node not in column:
            ins = [a for a in node.all_input_nodes if _source(a, params) is None]
            column[node] = (
                node.op == "call_function"
                and node.target not in _MATMULS | _NORMS
                and bool(ins)
                and all(from_column(a) for a in ins)
            )
        return column[node]

    for node in joint.gm.graph.nodes:
        if node.op != "call_function" or node.target not in _MATMULS:
            continue
        args = list(node.args[1:] if node.target == aten.addmm.default else node.args[:2])
        found = [
            (i, _source(a, params)) for i, a in enumerate(args) if isinstance(a, torch.fx.Node)
        ]
        weights = [(i, w) for i, w in found if w is not None]
        if len(weights) != 1 or len(args) != 2:
            continue
        i, (weight, transposed) = weights[0]
        if weight.name in out or i != 1:
            column[node] = False
            continue
        row = from_column(args[0])  # type: ignore[arg-type]
        out[weight.name] = (1 if row else 0) if transposed else (0 if row else 1)
        column[node] = not row
        bias = node.args[0] if node.target == aten.addmm.default else None
        source = _source(bias, params) if isinstance(bias, torch.fx.Node) else None
        if not row and source is not None:
            out.setdefault(source[0].name, 0)
    return out


def _source(node: torch.fx.Node, params: set[torch.fx.Node]) -> tuple[torch.fx.Node, bool] | None:
    """The parameter ``node`` is a view of (and whether transposed), else ``None``."""
    transposed = False
    while node not in params:
        if node.op != "call_function" or node.target not in _VIEWS:
            return None
        transposed ^= node.target in (aten.t.default, aten.transpose.int)
        node = node.args[0]  # type: ignore[assignment]
    return node, transposed
