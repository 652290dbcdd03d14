"""Infinity norms over a dim on which some rank holds an empty shard.

``max`` / ``min`` of nothing has no identity, so the local ``linalg_vector_norm`` or
``_foreach_norm`` with ``ord=±inf`` raises on an empty shard of a reduced dim ((5, 7) as
``Shard(0)`` on 4 ranks holds 2, 2, 1 and 0 rows), and the other ranks then wait in the
norm's all-reduce until it times out (upstream's own DTensors hang the same way). Here the
mesh dims sharding such a dim are replicated first (an all-gather; explicit mode applies),
so no rank reduces an empty shard; every other norm runs as upstream runs it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale.dtensor.dispatch import bypass_dispatch, python_dispatch, redistribute_for
from vescale.dtensor.layout import empty_shard_dims
from vescale.dtensor.placement_types import Replicate

__all__ = ["INF_NORMS", "inf_norm_without_empty_shards"]

aten = torch.ops.aten
INF_NORMS = [aten.linalg_vector_norm.default, aten._foreach_norm.Scalar]


def _reduced(x: _UpstreamDTensor, dim: int | Sequence[int] | None) -> set[int]:
    """The dims ``linalg_vector_norm`` reduces (all for ``None`` or ``[]``), non-negative."""
    dims = [dim] if isinstance(dim, int) else list(dim or range(x.ndim))
    return {d % max(x.ndim, 1) for d in dims}


def _without_empty_shards(op: torch._ops.OpOverload, x: Any, dims: set[int]) -> Any:
    """``x`` with the mesh dims sharding an empty-shard dim among ``dims`` replicated."""
    if not isinstance(x, _UpstreamDTensor):
        return x
    empty = set(empty_shard_dims(x._spec)) & dims
    if not empty:
        return x
    placements = [Replicate() if any(p.is_shard(d) for d in empty) else p for p in x.placements]
    return redistribute_for(op, x, placements)


@bypass_dispatch(INF_NORMS)
def inf_norm_without_empty_shards(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """An infinity norm reducing no empty shard (see module docstring)."""
    order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    if not math.isinf(float(order)):
        return python_dispatch(op, args, kwargs)
    if op is aten._foreach_norm.Scalar:
        first: Any = [_without_empty_shards(op, t, set(range(t.ndim))) for t in args[0]]
    else:
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
        first = _without_empty_shards(op, args[0], _reduced(args[0], dim))
    return python_dispatch(op, (first, *args[1:]), kwargs)
