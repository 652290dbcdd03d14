"""Strategies that keep ``InterleavedShard`` (``_StridedShard`` in specs) local where its layout
allows, so a merged-QKV attention block runs with no more communication than separate Q/K/V.

Upstream already keeps ``_StridedShard`` through mm/addmm/linear, views that split the merged
dim into ``(k, heads, head_dim)`` (giving ``Shard`` on heads), pointwise ops and reductions.
Here, for a tensor dim sharded on one mesh dim as ``InterleavedShard(dim, k)``:

* ``split``/``split_with_sizes``/``chunk`` into ``p`` equal pieces with ``k % p == 0``: each
  piece is ``InterleavedShard(dim, k // p)`` (``Shard(dim)`` when ``p == k``: q, k, v of a
  merged QKV), the split sizes divided by the mesh size locally;
* ``slice`` on group boundaries (``narrow``, the backward of ``cat``): the same, for the groups
  it keeps;
* ``cat`` of ``p`` equal tensors with the same placements, sharding ``dim`` on one mesh dim
  as ``Shard`` or ``InterleavedShard(dim, j)``: ``InterleavedShard(dim, p * j)`` (the backward
  of ``split``).

Every other case goes to upstream's strategy unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from vescale._patches import set_entry
from vescale._torch_compat import (
    DTensorSpec,
    OpSchema,
    OpSpec,
    OpStrategy,
    StridedShard,
    redistribute_cost,
)
from vescale.dtensor.layout import shards
from vescale.dtensor.op_args import bind
from vescale.dtensor.ops._registry import PROPAGATOR, wrap_upstream_strategy
from vescale.dtensor.placement_types import Placement, Shard

__all__ = ["interleaved_split_sizes"]

aten = torch.ops.aten
_SPLITS = [aten.split.Tensor, aten.split_with_sizes.default]


def _sharding(spec: DTensorSpec, dim: int) -> tuple[int, int] | None:
    """``(mesh_dim, k)`` when exactly one mesh dim shards tensor dim ``dim``, evenly, as
    ``Shard`` (k = 1) or ``_StridedShard(dim, k)``; else None."""
    found = [
        (m, int(p.split_factor) if isinstance(p, StridedShard) else 1)
        for m, p in enumerate(spec.placements)
        if shards(p, dim)
    ]
    if len(found) != 1:
        return None
    mesh_dim, k = found[0]
    if spec.shape[dim] % (k * spec.mesh.size(mesh_dim)):
        return None
    return mesh_dim, k


def _layout(k: int, dim: int) -> Placement:
    return Shard(dim) if k == 1 else StridedShard(dim, split_factor=k)


def _replaced(spec: DTensorSpec, mesh_dim: int, p: Placement) -> tuple[Placement, ...]:
    return tuple(p if m == mesh_dim else q for m, q in enumerate(spec.placements))


def _single(arg: object) -> DTensorSpec | None:
    """The one spec of an input (an ``OpStrategy`` in strategies, a spec in adjusters)."""
    if isinstance(arg, DTensorSpec):
        return arg
    if isinstance(arg, OpStrategy) and len(arg.strategies) == 1:
        return arg.strategies[0].output_spec
    return None


def _strategy(
    inputs: Sequence[OpStrategy], input_specs: Sequence[DTensorSpec], output: Any
) -> OpStrategy:
    costs = [
        [redistribute_cost(s.output_spec, want) for s in strat.strategies]
        for strat, want in zip(inputs, input_specs)
    ]
    return OpStrategy(
        [OpSpec(output_specs=output, input_specs=tuple(input_specs), redistribute_cost=costs)]
    )


def _bound(schema: OpSchema) -> dict[str, Any]:
    return bind(schema.op, schema.args_schema, schema.kwargs_schema)


def _split_sizes(schema: OpSchema, size: int) -> list[int]:
    arg = schema.args_schema[1]
    if isinstance(arg, int):
        return [arg] * (size // arg) + ([size % arg] if size % arg else [])
    return [int(s) for s in arg]  # type: ignore[attr-defined]


def interleaved_split_sizes(schema: OpSchema) -> tuple[int, int, int] | None:
    """``(mesh_dim, dim, k // pieces)`` when the split keeps the input's interleaved layout."""
    spec = _single(schema.args_schema[0])
    if spec is None:
        return None
    dim = int(_bound(schema)["dim"]) % spec.ndim
    found = _sharding(spec, dim)
    sizes = _split_sizes(schema, spec.shape[dim])
    if found is None or found[1] < 2 or len(set(sizes)) != 1 or found[1] % len(sizes):
        return None
    return found[0], dim, found[1] // len(sizes)


def _split_strategy(upstream: Callable[[OpSchema], Any]) -> Callable[[OpSchema], Any]:
    def strategy(schema: OpSchema) -> Any:
        plan = interleaved_split_sizes(schema)
        if plan is None:
            return upstream(schema)
        mesh_dim, dim, groups = plan
        spec = _single(schema.args_schema[0])
        assert spec is not None
        pieces = len(_split_sizes(schema, spec.shape[dim]))
        out = _replaced(spec, mesh_dim, _layout(groups, dim))
        outputs = tuple(DTensorSpec(spec.mesh, out) for _ in range(pieces))
        return _strategy([schema.args_schema[0]], [spec], outputs)  # type: ignore[list-item]

    return strategy


def _local_split(specs: list[DTensorSpec], schema: OpSchema) -> OpSchema:
    """Split sizes of the local shard (global sizes over the mesh size)."""
    plan = interleaved_split_sizes(schema)
    if plan is None:
        return schema
    n = specs[0].mesh.size(plan[0])
    arg = schema.args_schema[1]
    local = arg // n if isinstance(arg, int) else [int(s) // n for s in arg]  # type: ignore[attr-defined]
    args = (schema.args_schema[0], local, *schema.args_schema[2:])
    return OpSchema(schema.op, args, schema.kwargs_schema)


def _slice_plan(schema: OpSchema) -> tuple[int, int, int, int, int] | None:
    """``(mesh_dim, dim, start, end, groups kept)`` for a slice on group boundaries."""
    spec = _single(schema.args_schema[0])
    if spec is None:
        return None
    a = _bound(schema)
    dim = int(a["dim"]) % spec.ndim
    found = _sharding(spec, dim)
    if found is None or found[1] < 2 or a["step"] != 1:
        return None
    size, (mesh_dim, k) = spec.shape[dim], found
    start, end, _ = slice(a["start"], a["end"]).indices(size)
    group = size // k
    if end <= start or start % group or end % group:
        return None
    return mesh_dim, dim, start, end, (end - start) // group


def _slice_strategy(upstream: Callable[[OpSchema], Any]) -> Callable[[OpSchema], Any]:
    def strategy(schema: OpSchema) -> Any:
        plan = _slice_plan(schema)
        if plan is None:
            return upstream(schema)
        mesh_dim, dim, _, _, groups = plan
        spec = _single(schema.args_schema[0])
        assert spec is not None
        out = DTensorSpec(spec.mesh, _replaced(spec, mesh_dim, _layout(groups, dim)))
        return _strategy([schema.args_schema[0]], [spec], out)  # type: ignore[list-item]

    return strategy


def _local_slice(specs: list[DTensorSpec], schema: OpSchema) -> OpSchema:
    """Start and end of the local shard (global bounds over the mesh size)."""
    plan = _slice_plan(schema)
    if plan is None:
        return schema
    mesh_dim, dim, start, end, _ = plan
    n = specs[0].mesh.size(mesh_dim)
    args = (schema.args_schema[0], dim, start // n, end // n, 1)
    return OpSchema(schema.op, args, {})  # every argument given positionally


def _cat_plan(schema: OpSchema) -> tuple[list[DTensorSpec], int, int, int] | None:
    """``(input specs, mesh_dim, dim, k)`` for a cat of equal, equally laid out shards."""
    children = getattr(schema.args_schema[0], "children", None)
    specs = [_single(c) for c in children or []]
    if len(specs) < 2 or any(s is None for s in specs):
        return None
    first: DTensorSpec = specs[0]  # type: ignore[assignment]
    dim = int(_bound(schema)["dim"]) % first.ndim
    found = _sharding(first, dim)
    same = all(
        s.placements == first.placements and s.shape == first.shape  # type: ignore[union-attr]
        for s in specs
    )
    if found is None or not same:
        return None
    return specs, found[0], dim, found[1] * len(specs)  # type: ignore[return-value]


def _cat_strategy(upstream: Callable[[OpSchema], Any]) -> Callable[[OpSchema], Any]:
    def strategy(schema: OpSchema) -> Any:
        plan = _cat_plan(schema)
        if plan is None:
            return upstream(schema)
        specs, mesh_dim, dim, k = plan
        out = DTensorSpec(specs[0].mesh, _replaced(specs[0], mesh_dim, _layout(k, dim)))
        return _strategy(schema.args_schema[0].children, specs, out)  # type: ignore[attr-defined]

    return strategy


_ADJUSTERS = "ShardingPropagator.op_to_scalar_shape_adjuster"
for _op in _SPLITS:
    wrap_upstream_strategy(_op, _split_strategy, "interleaved")
    set_entry(
        PROPAGATOR.op_to_scalar_shape_adjuster,
        _ADJUSTERS,
        _op,
        _local_split,
        "local split sizes of interleaved shards",
    )
wrap_upstream_strategy(aten.slice.Tensor, _slice_strategy, "interleaved")
set_entry(
    PROPAGATOR.op_to_scalar_shape_adjuster,
    _ADJUSTERS,
    aten.slice.Tensor,
    _local_slice,
    "local slice bounds of interleaved shards",
)
wrap_upstream_strategy(aten.cat.default, _cat_strategy, "interleaved")
