"""Vocabulary-parallel ``embedding`` (table sharded on dim 0) on 1-D and 2-D meshes.

Per mesh dim the table may be ``Shard(0)`` (rows: vocabulary), ``Shard(1)`` (columns),
``Partial`` (lookup is linear: the output is ``Partial`` too) or ``Replicate``; the indices may
be sharded on mesh dims where the table is replicated and are replicated elsewhere. Each rank looks up the indices that fall in its rows
(others read row 0 and are zeroed), so the output is ``Partial`` (sum) over the
vocabulary-sharding mesh dims until the user reduces it, ``Shard(-1)`` over column-sharding
ones, and follows the indices elsewhere. No communication; the table is never gathered.

The backward is local too: the gradient arrives in the table's own placements (its rows
on each rank, ``Partial`` over mesh dims sharding the indices). The table's layout is not
an argument of ``embedding_dense_backward``, so the forward remembers it for its indices
(weakly, by object); a backward traced without it (e.g. by AOTAutograd, which re-wraps
tensors) goes through upstream's strategy, which is also correct.

Upstream's own row-wise rule (``_MaskPartial``) shares one mask between mesh dims and fails
on 2-D meshes (``MaskBuffer has been materialized with conflicting data``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale.dtensor.dtensor import wrap_local
from vescale.dtensor.explicit import redistribute_for
from vescale.dtensor.hooks import bypass_dispatch
from vescale.dtensor.inflight import wait_local
from vescale.dtensor.layout import contiguous_shards, local_range, sharding_mesh_dims
from vescale.dtensor.op_args import bind
from vescale.dtensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["vocab_parallel_embedding", "vocab_parallel_embedding_backward"]

aten = torch.ops.aten


Layout = tuple[torch.Size, Any, tuple[Placement, ...]]  # a table's shape, mesh, placements
_table_of: dict[int, Layout] = {}  # id(indices) -> layout, dropped when the indices die


def _remember(indices: torch.Tensor, layout: Layout) -> None:
    if id(indices) not in _table_of:
        weakref.finalize(indices, _table_of.pop, id(indices), None)
    _table_of[id(indices)] = layout


def _layout(weight: _UpstreamDTensor) -> Layout:
    return weight.shape, weight.device_mesh, tuple(weight.placements)


def _vocab_dims(layout: Layout) -> list[int]:
    _, mesh, placements = layout
    return sharding_mesh_dims(mesh, placements, 0)


def _index_placements(layout: Layout, indices: _UpstreamDTensor) -> list[Placement]:
    """Indices replicated over the table's sharded and Partial mesh dims, as they are elsewhere."""
    return [
        Replicate() if w.is_shard() or w.is_partial() or p.is_partial() else p
        for w, p in zip(layout[2], indices.placements)
    ]


def _out_placements(
    layout: Layout, index_placements: list[Placement], ndim: int
) -> list[Placement]:
    out: list[Placement] = []
    for w, p in zip(layout[2], index_placements):
        if w.is_shard(0) or w.is_partial():
            out.append(Partial())
        elif w.is_shard(1):
            out.append(Shard(ndim - 1))
        else:
            out.append(p)
    return out


def _local_rows(layout: Layout, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(local row of each index, mask of indices this rank holds, local row count)."""
    start, rows = local_range(*layout, 0)
    mine = (indices >= start) & (indices < start + rows)
    return torch.where(mine, indices - start, torch.zeros_like(indices)), mine, rows


def _vocab_parallel(op: torch._ops.OpOverload, args: Any, kwargs: Any) -> bool:
    """DTensor table and indices; the table of contiguous shards, vocabulary-sharded or Partial."""
    a = bind(op, args, kwargs)
    weight, indices = a["weight"], a["indices"]
    return (
        isinstance(weight, _UpstreamDTensor)
        and isinstance(indices, _UpstreamDTensor)
        and bool(_vocab_dims(_layout(weight)) or any(p.is_partial() for p in weight.placements))
        and contiguous_shards(weight.placements)
    )


@bypass_dispatch(aten.embedding.default, when=_vocab_parallel)
def vocab_parallel_embedding(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``embedding(weight, indices, ...)`` with a vocabulary-sharded table (module docstring)."""
    a = bind(op, args, kwargs)
    weight, indices = a["weight"], a["indices"]
    layout = _layout(weight)
    index_placements = _index_placements(layout, indices)
    indices = redistribute_for(op, indices, index_placements)
    rows, mine, _ = _local_rows(layout, wait_local(indices._local_tensor))
    out = F.embedding(rows, wait_local(weight._local_tensor)) * mine.unsqueeze(-1)
    placements = _out_placements(layout, index_placements, indices.ndim + 1)
    _remember(indices, layout)
    return wrap_local(out, weight.device_mesh, placements, (*indices.shape, weight.shape[1]))


def _remembered_table(op: torch._ops.OpOverload, args: Any, kwargs: Any) -> bool:
    """The forward remembered the table's layout for these indices; no frequency scaling."""
    a = bind(op, args, kwargs)
    indices = a["indices"]
    return (
        isinstance(indices, _UpstreamDTensor)
        and id(indices) in _table_of
        and not a["scale_grad_by_freq"]
    )


@bypass_dispatch(aten.embedding_dense_backward.default, when=_remembered_table)
def vocab_parallel_embedding_backward(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The table's gradient in the table's placements, computed locally (module docstring)."""
    a = bind(op, args, kwargs)
    grad, indices, padding_idx = a["grad_output"], a["indices"], a["padding_idx"]
    layout = _table_of[id(indices)]
    shape, mesh, w_placements = layout
    index_placements = list(indices.placements)
    out_placements = _out_placements(layout, index_placements, indices.ndim + 1)
    grad = redistribute_for(
        op, grad, [Replicate() if p.is_partial() else p for p in out_placements]
    )
    idx = wait_local(indices._local_tensor)
    rows, mine, n_rows = _local_rows(layout, idx)
    mine &= idx != padding_idx
    g = wait_local(grad._local_tensor) * mine.unsqueeze(-1)
    local = aten.embedding_dense_backward(g, rows, n_rows, -1, False)
    grad_placements = [
        w if w.is_shard() else (Partial() if i.is_shard() else Replicate())
        for w, i in zip(w_placements, index_placements)
    ]
    return wrap_local(local, mesh, grad_placements, tuple(shape))
