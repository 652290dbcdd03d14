"""Infinity norms and ``amax`` / ``amin`` over sharded dims, and reductions over an empty dim
list.

Upstream reduces ``linalg_vector_norm`` / ``_foreach_norm`` with ``ord=±inf`` (and ``amax`` /
``amin``) shard by shard
and combines the local maxima (minima); ``max`` / ``min`` of nothing has no identity, so a
rank holding an empty shard of a reduced dim ((5, 7) as ``Shard(0)`` on 4 ranks holds 2, 2,
1 and 0 rows) raises while the others wait in the all-reduce until it times out (upstream's
own DTensors do the same). Here the mesh dims sharding such a dim are replicated first (an
all-gather; explicit mode applies), so no rank reduces an empty shard; every other norm runs
as upstream runs it (local extrema combined as ``Partial(max)`` / ``Partial(min)``), the
pending extremum of a ±inf norm marked as the norm's own (``ExtremumNormPartial``, like
upstream's ``_NormPartial`` for finite p), so explicit mode lets a later op finish it
(docs/explicit-mode.md).

A norm's backward over all dims (``dim=None``) counts the extrema with
``sum(mask, dim=[], keepdim=True)``: an empty dim list reduces every dim, but upstream's
reduction strategies read it as "reduce nothing" and keep the input's shards, so each rank
divided by the count in its own shard (NaN gradients where a shard holds no extremum, and
ranks that then disagree on shapes and hang in a collective). For :data:`ALL_DIMS_OPS` the
strategy sees every dim in place of ``[]``; the kernel still gets the caller's ``[]``, except
``nansum``, whose meta kernel (which gives the global shape) reduces nothing for ``[]``: it
gets every dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._torch_compat import DTensorSpec, OpSchema
from vescale.dtensor.dtensor import as_vescale_spec
from vescale.dtensor.explicit import redistribute_for
from vescale.dtensor.hooks import bypass_dispatch, pre_dispatch_patch, python_dispatch
from vescale.dtensor.layout import empty_shard_dims
from vescale.dtensor.op_args import bind, unbind
from vescale.dtensor.ops._registry import wrap_upstream_strategy
from vescale.dtensor.placement_types import ExtremumNormPartial, Replicate

__all__ = [
    "ALL_DIMS_OPS",
    "EXTREMA",
    "INF_NORMS",
    "inf_norm_without_empty_shards",
    "nansum_all_dims",
]

aten = torch.ops.aten
INF_NORMS = [aten.linalg_vector_norm.default, aten._foreach_norm.Scalar]
EXTREMA = [aten.amax.default, aten.amin.default]
ALL_DIMS_OPS: dict[torch._ops.OpOverload, int] = {
    aten.sum.dim_IntList: 1,
    aten.mean.dim: 1,
    aten.nansum.default: 1,
    aten.amax.default: 1,
    aten.amin.default: 1,
    aten.std.correction: 1,
    aten.var.correction: 1,
    aten.var_mean.correction: 1,
    aten.linalg_vector_norm.default: 2,
    aten.linalg__powsum.default: 2,
}
"""Reductions whose empty dim list means every dim, with the position of that list."""


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


def _infinite(op: torch._ops.OpOverload, args: Any, kwargs: Any) -> bool:
    """``amax`` / ``amin``, or a norm of infinite order."""
    return op in EXTREMA or math.isinf(float(bind(op, args, kwargs)["ord"]))


@bypass_dispatch([*INF_NORMS, *EXTREMA], when=_infinite)
def inf_norm_without_empty_shards(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """An infinity norm, ``amax`` or ``amin`` reducing no empty shard (see module docstring)."""
    a = bind(op, args, kwargs)
    x = a["self"]
    if op is aten._foreach_norm.Scalar:
        a["self"] = [_without_empty_shards(op, t, set(range(t.ndim))) for t in x]
    else:
        a["self"] = _without_empty_shards(op, x, _reduced(x, a["dim"]))
    out = python_dispatch(op, *unbind(op, a))
    if op in INF_NORMS:
        for t in out if isinstance(out, list | tuple) else (out,):
            _mark_norm_partial(t, float(a["ord"]))
    return out


def _mark_norm_partial(t: _UpstreamDTensor, order: float) -> None:
    """``t``'s pending max/min (a ±inf norm's result) marked as the norm's own
    (:class:`ExtremumNormPartial`), so explicit mode lets the op that needs it reduced
    finish the norm (docs/explicit-mode.md); a new spec, the cached one is shared."""
    spec = t._spec
    if not any(p.is_partial() for p in spec.placements):
        return
    placements = tuple(ExtremumNormPartial(order) if p.is_partial() else p for p in spec.placements)
    t._spec = as_vescale_spec(DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta))


def _all_dims(upstream: Callable[[OpSchema], Any]) -> Callable[[OpSchema], Any]:
    """``upstream`` seeing every dim of the input where the schema names an empty dim list."""

    def strategy(schema: OpSchema) -> Any:
        args, pos = schema.args_schema, ALL_DIMS_OPS[schema.op]
        ndim = getattr(args[0], "ndim", 0)
        if len(args) > pos and isinstance(args[pos], (list, tuple)) and not args[pos] and ndim:
            args = (*args[:pos], list(range(ndim)), *args[pos + 1 :])
            schema = OpSchema(schema.op, args, schema.kwargs_schema, schema.schema_info)
        return upstream(schema)

    return strategy


for _op in ALL_DIMS_OPS:
    wrap_upstream_strategy(_op, _all_dims, "all_dims")


def _empty_dims(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    a = bind(op, args, kwargs)
    return isinstance(a["dim"], (list, tuple)) and not a["dim"] and a["self"].ndim > 0


@pre_dispatch_patch(aten.nansum.default, when=_empty_dims)
def nansum_all_dims(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``nansum(x, [])`` as ``nansum(x, every dim)`` (see module docstring)."""
    a = bind(op, args, kwargs)
    a["dim"] = list(range(a["self"].ndim))
    return unbind(op, a)
