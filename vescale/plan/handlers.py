"""Strategies of the ops vescale's eager layer runs with its own dispatch handlers.

``vescale/dtensor/ops/loss.py`` handles ``_log_softmax`` (and its backward) over a sharded
dim and ``nll_loss_forward``/``nll_loss_backward`` on sharded input itself, instead of
upstream's strategies (Megatron's vocabulary-parallel loss: the logits are never gathered).
The propagator must offer what those handlers do, or the plan path would price a gather the
program never issues and choose differently from eager. For each such op: the registry's
strategies for the inputs the handler passes on, plus one strategy per input layout the
handler takes over, with the collectives the handler issues inside the op
(``NodeStrategies.internal``). These describe the handlers; they add no rule of their own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from vescale.dtensor.placement_types import InterleavedShard
from vescale.plan.cost import CommStep, local_bytes
from vescale.plan.propagate import NodeStrategies, Placements

__all__ = ["HANDLED", "handler_strategies"]

aten = torch.ops.aten
MEAN = 1


def _plain(placements: Placements) -> bool:
    """Contiguous shards only, no Partial (what the log-softmax handlers take)."""
    return all(
        (type(p) is Shard or isinstance(p, Replicate)) and not isinstance(p, InterleavedShard)
        for p in placements
    )


def _dims(placements: Placements, dim: int, mesh: DeviceMesh) -> list[int]:
    return [i for i, p in enumerate(placements) if p.is_shard(dim) and mesh.size(i) > 1]


def _rows(t: torch.Tensor, placements: Placements, dim: int, mesh: DeviceMesh) -> int:
    shape = list(t.shape)
    shape[dim] = 1
    return local_bytes(placements, tuple(shape), t.element_size(), tuple(mesh.shape))


def _log_softmax(node: torch.fx.Node, cands: list[list[Placements]], mesh: DeviceMesh) -> list[Any]:
    x = node.args[0].meta["val"]  # type: ignore[union-attr]
    dim = int(node.args[1]) % x.ndim  # type: ignore[arg-type]
    out = []
    for p in cands[0]:
        dims = _dims(p, dim, mesh)
        if _plain(p) and dims and not node.args[2]:
            rows = _rows(x, p, dim, mesh)
            steps = tuple(
                CommStep("all_reduce", d, mesh.size(d), rows) for d in dims for _ in (0, 1)
            )
            out.append(((p,), (p,), steps))
    return out


def _log_softmax_backward(
    node: torch.fx.Node, cands: list[list[Placements]], mesh: DeviceMesh
) -> list[Any]:
    o = node.args[1].meta["val"]  # type: ignore[union-attr]
    dim = int(node.args[2]) % o.ndim  # type: ignore[arg-type]
    out = []
    for p in cands[1]:
        dims = _dims(p, dim, mesh)
        if _plain(p) and dims and o.dtype == node.args[3]:
            steps = tuple(
                CommStep("all_reduce", d, mesh.size(d), _rows(o, p, dim, mesh)) for d in dims
            )
            out.append(((p,), (p, p), steps))
    return out


def _nll_applies(x: torch.Tensor, p: Placements, mesh: DeviceMesh) -> bool:
    return (
        x.ndim in (1, 2)
        and not any(
            isinstance(q, InterleavedShard) or type(q).__name__ == "_StridedShard" for q in p
        )
        and any(not q.is_replicate() and mesh.size(i) > 1 for i, q in enumerate(p))
    )


def _target_placements(x: torch.Tensor, p: Placements) -> Placements:
    return tuple(q if x.ndim == 2 and q.is_shard(0) else Replicate() for q in p)


def _nll_forward(node: torch.fx.Node, cands: list[list[Placements]], mesh: DeviceMesh) -> list[Any]:
    x = node.args[0].meta["val"]  # type: ignore[union-attr]
    weight, reduction = node.args[2], node.args[3]
    if weight is not None or reduction == 0:
        return []
    out = []
    for p in cands[0]:
        if not _nll_applies(x, p, mesh):
            continue
        class_dim = 1 if x.ndim == 2 else 0
        batch = _dims(p, 0, mesh) if x.ndim == 2 else []
        loss_dims = (
            set(_dims(p, class_dim, mesh))
            | set(batch)
            | {i for i, q in enumerate(p) if q.is_partial()}
        )
        loss: Placements = tuple(
            Partial() if i in loss_dims else Replicate() for i in range(mesh.ndim)
        )
        if reduction == MEAN:
            total: Placements = (Replicate(),) * mesh.ndim
            steps = tuple(CommStep("all_reduce", d, mesh.size(d), x.element_size()) for d in batch)
        else:
            total = tuple(Partial() if i in batch else Replicate() for i in range(mesh.ndim))
            steps = ()
        out.append(((loss, total), (p, _target_placements(x, p)), steps))
    return out


def _nll_backward(
    node: torch.fx.Node, cands: list[list[Placements]], mesh: DeviceMesh
) -> list[Any]:
    x = node.args[1].meta["val"]  # type: ignore[union-attr]
    weight, reduction = node.args[3], node.args[4]
    if weight is not None or reduction == 0:
        return []
    rep: Placements = (Replicate(),) * mesh.ndim
    out = []
    for p in cands[1]:
        if _nll_applies(x, p, mesh):
            grad_in: Placements = tuple(Replicate() if q.is_partial() else q for q in p)
            out.append(((grad_in,), (rep, p, _target_placements(x, p), rep), ()))
    return out


HANDLED: dict[Any, tuple[Any, Any]] = {
    # op: (strategies the handler takes over, does the handler take this input layout)
    aten._log_softmax.default: (
        _log_softmax,
        lambda n, ins, m: bool(_log_softmax(n, [[ins[0]]], m)),
    ),
    aten._log_softmax_backward_data.default: (
        _log_softmax_backward,
        lambda n, ins, m: bool(_log_softmax_backward(n, [[ins[0]], [ins[1]]], m)),
    ),
    aten.nll_loss_forward.default: (
        _nll_forward,
        lambda n, ins, m: _nll_applies(n.args[0].meta["val"], ins[0], m),
    ),
    aten.nll_loss_backward.default: (
        _nll_backward,
        lambda n, ins, m: _nll_applies(n.args[1].meta["val"], ins[1], m),
    ),
}


def handler_strategies(
    ns: NodeStrategies, mesh: DeviceMesh, table: dict[torch.fx.Node, NodeStrategies]
) -> NodeStrategies:
    """For a handled op: ``ns`` (the registry's strategies) without the input layouts the
    handler takes over, plus the handler's own strategies for them; other ops: ``ns``."""
    if ns.node.target not in HANDLED:
        return ns
    candidates = [table[v[0]].out_candidates(v[1]) for v in ns.inputs]
    take, applies = HANDLED[ns.node.target]
    kept = [
        (o, i) for o, i in zip(ns.outputs, ns.input_placements) if not applies(ns.node, i, mesh)
    ]
    mine = take(ns.node, candidates, mesh)
    outputs = [o for o, _ in kept] + [o for o, _, _ in mine]
    inputs = [i for _, i in kept] + [i for _, i, _ in mine]
    internal = [()] * len(kept) + [s for _, _, s in mine]
    return NodeStrategies(ns.node, ns.inputs, outputs, inputs, ns.source, internal=internal)
