"""View ops whose result upstream cannot lay out: redistribute the input instead of failing.

Upstream's view strategy raises when the output of a view cannot keep the input's sharding:
flattening an unevenly sharded dim (``view(3 * 5, ...)`` of a ``(3, 5, ...)`` tensor sharded
on dim 0 over 2 ranks: what the math attention decomposition does on an uneven batch), or
expanding a size-1 dim that is "sharded" (``expand_as`` of a ``(n, 1)`` tensor sharded on
dim 1); and it computes wrong local shapes for a dim sharded over two mesh dims where some
rank's shard is empty (2 rows over a 2x2 mesh), which is treated the same way. A
reshape of an interleaved (strided) shard, or of a dim sharded over several mesh dims, is
checked to map every rank's elements to its own (by layout algebra, once per distinct case:
:func:`_maps_elements`), because upstream claims layouts for some that are not what the
local view holds (``(96, 30)`` as ``InterleavedShard(0, 4)`` viewed as ``(8, 12, 30)``;
``(16, 3)`` as ``(Shard(0), Shard(0))`` on 2x2 viewed as ``(2, 8, 3)``): a claim that does not map every
rank's elements to its own is refused like an error. Here the strategy is retried with the
input's interleaved shards made plain, then with the input replicated on the fewest mesh
dims that make it work (each one alone, innermost first, then all): the dispatcher
redistributes the input to it (or raises in explicit mode), and every view the strategy
accepts is unchanged. A reshape of an empty tensor is answered here (upstream's
``view_groups`` never returns for some zero-size shapes); upstream's
``_StridedShard(d, split_factor=1)`` outputs are stated as the ``Shard(d)`` they are.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vescale._torch_compat import (
    DTensorSpec,
    OpSchema,
    OpSpec,
    OpStrategy,
    StridedShard,
    disable_current_modes,
    redistribute_cost,
)
from vescale.dtensor.layout import (
    Digit,
    empty_shard_dims,
    interleave_factor,
    local_indices,
    shard_digits,
    shards,
)
from vescale.dtensor.ops._registry import wrap_upstream_strategy
from vescale.dtensor.placement_types import Placement, Replicate, Shard

__all__ = ["RETRIED_VIEW_OPS"]

aten = torch.ops.aten
RETRIED_VIEW_OPS = [
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
]


def _with_input(schema: OpSchema, placements: tuple[Placement, ...]) -> OpSchema:
    first = schema.args_schema[0]
    assert isinstance(first, OpStrategy)
    spec = first.strategies[0].output_spec
    replaced = OpStrategy(
        [OpSpec(DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta))]
    )
    return OpSchema(
        schema.op, (replaced, *schema.args_schema[1:]), schema.kwargs_schema, schema.schema_info
    )


def _candidates(placements: tuple[Placement, ...]) -> list[tuple[Placement, ...]]:
    plain = tuple(Shard(p.dim) if isinstance(p, StridedShard) else p for p in placements)
    sharded = [i for i, p in enumerate(placements) if p.is_shard()]
    one = [
        tuple(Replicate() if i == m else p for i, p in enumerate(placements))
        for m in reversed(sharded)
    ]
    return [*([plain] if plain != placements else []), *one, (Replicate(),) * len(placements)]


def _dim_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """The dims of ``src`` and ``dst`` (same numel, > 0) that a reshape maps onto each other:
    runs between the prefix products both shapes share."""
    bounds = sorted(
        {math.prod(src[:k]) for k in range(len(src) + 1)}
        & {math.prod(dst[:k]) for k in range(len(dst) + 1)}
    )[1:]

    def group(shape: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in bounds]
        for d in range(len(shape)):
            end = math.prod(shape[: d + 1])
            out[next(i for i, b in enumerate(bounds) if b >= end)].append(d)
        return out

    return list(zip(group(src), group(dst)))


def _flat(indices: Sequence[Any], shape: Sequence[int], dims: list[int]) -> Any:
    flat = torch.zeros(1, dtype=torch.int64)
    for d in dims:
        flat = (flat.view(-1, 1) * shape[d] + indices[d].view(1, -1)).flatten()
    return flat


def _canonical(digits: list[Digit]) -> list[Digit]:
    """``digits`` with neighbours that mean one digit merged: free ones, and consecutive
    places of one mesh dim."""
    out: list[Digit] = []
    for size, m, place in digits:
        if out and out[-1][1] is None and m is None:
            out[-1] = (out[-1][0] * size, None, 0)
        elif out and m is not None and out[-1][1] == m and out[-1][2] == place * size:
            out[-1] = (out[-1][0] * size, m, place)
        else:
            out.append((size, m, place))
    return out


@functools.lru_cache(maxsize=4096)
def _maps_by_digits(
    mesh_sizes: tuple[int, ...],
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    src_shape: tuple[int, ...],
    dst_shape: tuple[int, ...],
) -> bool | None:
    """:func:`_maps_elements` by layout algebra: per group of dims the reshape maps onto each
    other, both sides' flat index digits (:func:`shard_digits`, row-major) must be the same
    digits fixed by the same mesh dims. ``None`` where a shard is no product of digits."""
    for a, b in _dim_groups(src_shape, dst_shape):
        sides = []
        for shape, placements, dims in ((src_shape, src, a), (dst_shape, dst, b)):
            digits: list[Digit] | None = []
            for d in dims:
                try:
                    found = shard_digits(shape[d], mesh_sizes, placements, d)
                except ValueError:  # a layout no rank can hold
                    return False
                digits = None if found is None or digits is None else digits + found
            sides.append(None if digits is None else _canonical(digits))
        if None in sides:  # uneven: a dim the reshape keeps, cut alike on both sides, maps
            kept = len(a) == len(b) == 1 and src_shape[a[0]] == dst_shape[b[0]]
            plain = not any(
                interleave_factor(p) is not None and p.dim == d  # type: ignore[attr-defined]
                for ps, d in ((src, a[0]), (dst, b[0]))
                for p in ps
            )
            same = _splits(mesh_sizes, src, a[0]) == _splits(mesh_sizes, dst, b[0])
            if not (kept and plain and same):
                return None
        elif sides[0] != sides[1]:
            return False
    return True


def _splits(mesh_sizes: tuple[int, ...], placements: tuple[Placement, ...], dim: int) -> Any:
    """How ``placements`` split tensor dim ``dim``: (mesh dim, interleave factor) in order."""
    return [
        (m, interleave_factor(p))
        for m, (n, p) in enumerate(zip(mesh_sizes, placements))
        if n > 1 and shards(p, dim)
    ]


def _maps_elements(src: DTensorSpec, dst: DTensorSpec, shape: Sequence[int]) -> bool:
    """Whether, on every rank, the local reshape of ``src``'s shard holds exactly ``dst``'s
    shard of global ``shape``, in order (each group of dims the reshape maps onto each other
    compared apart). Decided once per distinct case by :func:`_maps_by_digits`; shards that
    are no product of digits (uneven, or cut across an interleave) by
    :func:`_maps_by_index`."""
    if src.mesh != dst.mesh or math.prod(shape) == 0:
        return True
    sizes = (tuple(src.shape), tuple(shape))
    if all(type(s) is int for s in (*sizes[0], *sizes[1])):
        found = _maps_by_digits(
            tuple(src.mesh.shape), tuple(src.placements), tuple(dst.placements), *sizes
        )
        if found is not None:
            return found
    return _maps_by_index(src, dst, shape)


def _maps_by_index(src: DTensorSpec, dst: DTensorSpec, shape: Sequence[int]) -> bool:
    """:func:`_maps_elements` by comparing every rank's global indices (index arithmetic on
    real tensors, also while a compile traces under fake tensors)."""
    groups = _dim_groups(list(src.shape), list(shape))
    with disable_current_modes():
        for coord in itertools.product(*(range(n) for n in src.mesh.shape)):
            ins = local_indices(src.shape, src.mesh, src.placements, coord)
            outs = local_indices(shape, dst.mesh, dst.placements, coord)
            for a, b in groups:
                if not torch.equal(_flat(ins, src.shape, a), _flat(outs, shape, b)):
                    return False
    return True


def _checked(spec: DTensorSpec) -> bool:
    """Layouts whose reshapes upstream may mislay: an interleaved (strided) shard, or a
    tensor dim sharded over several mesh dims."""
    dims = [p.dim for p in spec.placements if p.is_shard() or isinstance(p, StridedShard)]  # type: ignore[attr-defined]
    return len(set(dims)) < len(dims) or any(isinstance(p, StridedShard) for p in spec.placements)


def _check_reshape(schema: OpSchema, out: Any) -> None:
    """Refuse a reshape strategy that mislays elements (see module docstring)."""
    if schema.op is aten.expand.default or not isinstance(out, OpStrategy):
        return
    first = schema.args_schema[0]
    assert isinstance(first, OpStrategy)
    given = first.strategies[0].output_spec
    size: Any = schema.args_schema[1]
    shape = torch.empty(given.shape, device="meta").view(size).shape
    for spec in out.strategies:
        src = spec.input_specs[0] if spec.input_specs else given
        dst = spec.output_spec
        if (_checked(src) or _checked(dst)) and not _maps_elements(src, dst, shape):
            raise ValueError(f"{schema.op}: {src} does not view as {dst}")


def _nested_empty(spec: DTensorSpec) -> bool:
    """A dim sharded over several mesh dims with an empty shard somewhere: upstream computes
    wrong local view shapes for it."""
    return any(sum(p.is_shard(d) for p in spec.placements) > 1 for d in empty_shard_dims(spec))


def _of_empty(schema: OpSchema) -> OpStrategy | None:
    """A reshape of an empty tensor: every input layout as it is (each shard empty), the
    output replicated (nothing to lay out). Upstream's ``view_groups`` never returns for some
    such shapes (``(2, 0)`` viewed as ``(0, 2)``): every rank would hang in it."""
    first = schema.args_schema[0]
    if schema.op is aten.expand.default or not isinstance(first, OpStrategy):
        return None
    meta = first.strategies[0].output_spec.tensor_meta
    if meta is None or math.prod(meta.shape) != 0:
        return None
    specs = [s.output_spec for s in first.strategies]
    return OpStrategy(
        [
            OpSpec(
                output_specs=DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim),
                input_specs=(spec,),
                redistribute_cost=[[redistribute_cost(src, spec) for src in specs]],
            )
            for spec in specs
        ]
    )


def _unit_strides_plain(out: Any) -> Any:
    """``out`` with upstream's ``_StridedShard(d, split_factor=1)`` (a flattened dim whose
    leading part has one element per shard) as the ``Shard(d)`` it is, so handlers that need
    contiguous shards (the loss's batch rows) take it and equal layouts compare equal."""
    if not isinstance(out, OpStrategy):
        return out

    def plain(spec: DTensorSpec) -> DTensorSpec:
        if not any(isinstance(p, StridedShard) and p.split_factor == 1 for p in spec.placements):
            return spec
        placements = tuple(
            Shard(p.dim) if isinstance(p, StridedShard) and p.split_factor == 1 else p
            for p in spec.placements
        )
        return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)

    for s in out.strategies:
        s.output_specs = plain(s.output_spec)
    return out


def _retrying(upstream: Callable[[OpSchema], Any]) -> Callable[[OpSchema], Any]:
    def strategy(schema: OpSchema) -> Any:
        return _unit_strides_plain(_first_that_views(schema))

    def _first_that_views(schema: OpSchema) -> Any:
        empty = _of_empty(schema)
        if empty is not None:
            return empty
        first = schema.args_schema[0]
        spec = (
            first.strategies[0].output_spec
            if isinstance(first, OpStrategy) and len(first.strategies) == 1
            else None
        )
        try:
            if spec is not None and _nested_empty(spec):
                raise ValueError("nested uneven sharding with an empty shard")
            out = upstream(schema)
            _check_reshape(schema, out)
            return out
        except (RuntimeError, KeyError, AssertionError, ValueError) as err:
            if spec is None:
                raise
            for candidate in _candidates(tuple(spec.placements)):
                if _nested_empty(DTensorSpec(spec.mesh, candidate, tensor_meta=spec.tensor_meta)):
                    continue
                retried = _with_input(schema, candidate)
                try:
                    out = upstream(retried)
                    _check_reshape(retried, out)
                    return out
                except (RuntimeError, KeyError, AssertionError, ValueError):
                    continue
            raise err

    return strategy


for _op in RETRIED_VIEW_OPS:
    wrap_upstream_strategy(_op, _retrying, "retrying")
