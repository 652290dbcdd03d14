"""Infinity norms over sharded dims.

Upstream reduces ``linalg_vector_norm`` / ``_foreach_norm`` with ``ord=±inf`` shard by shard
and combines the local maxima (minima), which fails two ways: ``max`` / ``min`` of nothing
has no identity, so a rank holding an empty shard of a reduced dim ((5, 7) as ``Shard(0)`` on
4 ranks holds 2, 2, 1 and 0 rows) raises while the others wait in the all-reduce until it
times out; and the backward divides by the number of elements equal to the norm *in the local
shard*, which is 0 on every shard not holding the extremum: NaN gradients (upstream's own
DTensors do both). Here the mesh dims sharding a reduced dim, and Partial mesh dims, are
replicated first (an all-gather / all-reduce; explicit mode applies), so the norm and its
backward are computed on whole rows; every other norm runs as upstream runs it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale.dtensor.explicit import redistribute_for
from vescale.dtensor.hooks import bypass_dispatch, python_dispatch
from vescale.dtensor.placement_types import Replicate

__all__ = ["INF_NORMS", "inf_norm_on_whole_rows"]

aten = torch.ops.aten
INF_NORMS = [aten.linalg_vector_norm.default, aten._foreach_norm.Scalar]


def _reduced(x: _UpstreamDTensor, dim: int | Sequence[int] | None) -> set[int]:
    """The dims ``linalg_vector_norm`` reduces (all for ``None`` or ``[]``), non-negative."""
    dims = [dim] if isinstance(dim, int) else list(dim or range(x.ndim))
    return {d % max(x.ndim, 1) for d in dims}


def _whole_rows(op: torch._ops.OpOverload, x: Any, dims: set[int]) -> Any:
    """``x`` with the mesh dims sharding a dim among ``dims``, and Partial ones, replicated."""
    if not isinstance(x, _UpstreamDTensor):
        return x
    placements = [
        Replicate() if p.is_partial() or any(p.is_shard(d) for d in dims) else p
        for p in x.placements
    ]
    if placements == list(x.placements):
        return x
    return redistribute_for(op, x, placements)


@bypass_dispatch(INF_NORMS)
def inf_norm_on_whole_rows(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """An infinity norm computed on whole rows of its reduced dims (see module docstring)."""
    order = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    if not math.isinf(float(order)):
        return python_dispatch(op, args, kwargs)
    if op is aten._foreach_norm.Scalar:
        first: Any = [_whole_rows(op, t, set(range(t.ndim))) for t in args[0]]
    else:
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
        first = _whole_rows(op, args[0], _reduced(args[0], dim))
    return python_dispatch(op, (first, *args[1:]), kwargs)
