"""Shard geometry: which part of a global tensor each rank of a mesh holds.

The one home for layout arithmetic, used by the conversions, random ops, op handlers and
redistribution. Placements are read through ``Placement``'s interface; an interleaved
shard is ``InterleavedShard(dim, k)`` or its spec form ``_StridedShard(dim, split_factor=k)``
(:func:`interleave_factor`). Mesh dims apply in order, each splitting what the earlier ones
left as ``torch.chunk`` does (uneven sizes and empty trailing shards included). Decisions
that must agree on every rank (:func:`empty_shard_dims`) use the whole mesh, never the
local coordinate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor.placement_types import Placement, Shard
from torch.fx.experimental.symbolic_shapes import optimization_hint

from vescale._torch_compat import DTensorSpec, StridedShard

__all__ = [
    "Digit",
    "chunk_sizes",
    "contiguous_shards",
    "contiguous_strides",
    "dense_strides",
    "empty_shard_dims",
    "interleave_divides",
    "interleave_factor",
    "interleaved_sizes",
    "local_indices",
    "local_range",
    "shard_digits",
    "sharding_mesh_dims",
    "shards",
]

Digit = tuple[int, int | None, int]  # (size, fixing mesh dim or None: free, place value)


def chunk_sizes(total: int, n: int) -> list[int]:
    """Sizes of ``torch.chunk`` of ``total`` elements into ``n``, padded with zeros to ``n``
    entries (``torch.chunk`` returns fewer chunks when it runs out)."""
    step = -(-total // n) if total else 0
    return [max(0, min(step, total - k * step)) for k in range(n)]


def interleave_factor(p: Placement) -> int | None:
    """``k`` of ``InterleavedShard(dim, k)`` or ``_StridedShard(dim, split_factor=k)``;
    ``None`` for any other placement."""
    if isinstance(p, StridedShard):
        return int(p.split_factor)
    k = getattr(p, "interleaved_size", None)  # InterleavedShard (placement_types builds on us)
    return int(k) if k is not None else None


def contiguous_shards(placements: Sequence[Placement]) -> bool:
    """Every sharded placement holds one contiguous chunk per rank (none is interleaved), so
    a shard's global offset locates it."""
    return all(interleave_factor(p) is None for p in placements)


def shards(p: Placement, dim: int) -> bool:
    """Whether ``p`` shards tensor dim ``dim``, contiguously or interleaved (upstream's
    ``_StridedShard.is_shard`` says no)."""
    return p.is_shard(dim) or (isinstance(p, StridedShard) and p.dim == dim)


def sharding_mesh_dims(mesh: Any, placements: Sequence[Placement], dim: int) -> list[int]:
    """Mesh dims (of more than one rank) that shard tensor dim ``dim``, interleaved or not."""
    return [i for i, p in enumerate(placements) if shards(p, dim) and mesh.size(i) > 1]


def _coordinate(mesh: Any, coordinate: Sequence[int] | None, what: str) -> list[int]:
    coord = coordinate if coordinate is not None else mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"{what}: this rank is not part of {mesh}")
    return list(coord)


def local_range(
    shape: Sequence[int],
    mesh: Any,
    placements: Sequence[Placement],
    dim: int,
    coordinate: Sequence[int] | None = None,
) -> tuple[int, int]:
    """(global start, length) along ``dim`` of the contiguous shard at ``coordinate`` (this
    rank's by default) of a tensor of global ``shape`` laid out as ``placements``.

    Plain integers from the mesh coordinate (upstream's offset helper goes through a
    coordinate tensor, which Dynamo cannot trace without a graph break)."""
    coord = _coordinate(mesh, coordinate, "local_range")
    start, size = 0, int(shape[dim])
    for mesh_dim, p in enumerate(placements):
        if p.is_shard(dim):
            sizes = chunk_sizes(size, mesh.size(mesh_dim))
            start += sum(sizes[: coord[mesh_dim]])
            size = sizes[coord[mesh_dim]]
    return start, size


def local_indices(
    shape: Sequence[int],
    mesh: Any,
    placements: Sequence[Placement],
    coordinate: Sequence[int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Per tensor dim, the sorted global indices the shard at ``coordinate`` (this rank's by
    default) holds (row-major order).

    ``Shard(d)`` keeps ``torch.chunk`` chunk ``c`` of the indices left on dim ``d``; an
    interleaved shard with factor ``k`` views them as ``(k, N // k)`` and keeps chunk ``c``
    of the second factor. ``Replicate``/``Partial`` keep everything.
    """
    coord = _coordinate(mesh, coordinate, "local_indices")
    idx = [torch.arange(s) for s in shape]
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, Shard | StridedShard):
            continue
        n, c, cur = mesh.size(mesh_dim), coord[mesh_dim], idx[p.dim]
        k = interleave_factor(p)
        groups = cur.view(k, -1) if k is not None else cur.view(1, -1)
        sizes = chunk_sizes(groups.shape[1], n)
        start = sum(sizes[:c])
        idx[p.dim] = groups[:, start : start + sizes[c]].flatten()
    return tuple(idx)


def _split_free(digits: list[Digit], amount: int) -> bool:
    """Split a free digit of ``digits`` so that the outermost free digits hold exactly
    ``amount`` values; ``False`` where ``amount`` does not fall on such a boundary."""
    for i, (size, label, _) in enumerate(digits):
        if label is not None:
            continue
        if amount == 1:
            return True
        if amount % size == 0:
            amount //= size
        elif size % amount == 0:
            digits[i : i + 1] = [(amount, None, 0), (size // amount, None, 0)]
            return True
        else:
            return False
    return amount == 1


def _fix(digits: list[Digit], skip: int, amount: int, mesh_dim: int) -> bool:
    """Mark the free digits worth ``amount`` that follow the outermost ones worth ``skip``
    as fixed by ``mesh_dim`` (outermost the highest place value)."""
    total = math.prod(d[0] for d in digits if d[1] is None)
    if total % skip:
        raise ValueError(f"an interleave of {skip} does not divide {total} elements")
    if not (_split_free(digits, skip) and _split_free(digits, skip * amount)):
        return False
    free = [i for i, d in enumerate(digits) if d[1] is None]
    held, place = 1, amount
    for i in free:
        size = digits[i][0]
        if skip <= held < skip * amount:
            place //= size
            digits[i] = (size, mesh_dim, place)
        held *= size
    return True


def shard_digits(
    size: int, mesh_sizes: Sequence[int], placements: Sequence[Placement], dim: int
) -> list[Digit] | None:
    """Tensor dim ``dim`` (``size`` elements) as mixed-radix digits, outermost first, each
    ``(size, mesh dim, place)``: the shard at a coordinate ``c`` holds the indices whose digit
    fixed by mesh dim ``m`` equals ``c[m] // place % size`` (free digits: every value), in
    order. What :func:`local_indices` builds, for every coordinate at once; ``None`` where a
    shard is not a product of whole digits (uneven or cut across an interleave), which that
    function must then decide; a ``ValueError`` where an interleave does not divide what it
    splits (where that function cannot view it). Size-1 digits are dropped."""
    digits: list[Digit] = [(size, None, 0)]
    for m, (n, p) in enumerate(zip(mesh_sizes, placements)):
        if not isinstance(p, Shard | StridedShard) or p.dim != dim:
            continue
        if not _fix(digits, interleave_factor(p) or 1, n, m):
            return None
    return [d for d in digits if d[0] != 1]


def empty_shard_dims(spec: DTensorSpec) -> list[int]:
    """Tensor dims of which some rank holds an empty shard (the dim itself non-empty)."""
    out = []
    mesh_shape = spec.mesh.shape
    for dim, size in enumerate(spec.shape):
        if not any(p.is_shard(dim) for p in spec.placements):
            continue  # reading no size: a dynamic (symbolic) dim stays unspecialized
        n = optimization_hint(size)  # a sharded dynamic dim: its example size, no guard
        sizes = {n}
        for m, p in enumerate(spec.placements):
            if p.is_shard(dim):
                sizes = {c for s in sizes for c in chunk_sizes(s, mesh_shape[m])}
        if n > 0 and 0 in sizes:
            out.append(dim)
    return out


def interleaved_sizes(
    shape: Sequence[int], mesh_sizes: Sequence[int], placements: Sequence[Placement]
) -> list[int | None]:
    """Per mesh dim, the size of the sharded tensor dim as that mesh dim sees it (after the
    earlier mesh dims' even shards); None where unknown (not a shard, or an uneven one before)."""
    sizes: list[int | None] = [int(s) for s in shape]
    out: list[int | None] = []
    for n, p in zip(mesh_sizes, placements):
        if not isinstance(p, Shard | StridedShard):
            out.append(None)
            continue
        size = sizes[p.dim]
        out.append(size)
        sizes[p.dim] = size // n if size is not None and size % n == 0 else None
    return out


def interleave_divides(size: int | None, k: int, n: int) -> bool:
    """Whether an interleaved shard with factor ``k`` over ``n`` ranks splits ``size`` evenly."""
    return size is not None and size % k == 0 and (size // k) % n == 0


def contiguous_strides(shape: Sequence[Any]) -> tuple[Any, ...]:
    """Strides of a contiguous (row-major) tensor of ``shape``, as ``torch.empty`` gives
    (an empty dim counts as 1; symbolic sizes stay symbolic)."""
    strides: list[Any] = []
    acc: Any = 1
    for s in reversed(shape):
        strides.append(acc)
        acc = acc * torch.sym_max(s, 1)
    return tuple(reversed(strides))


def dense_strides(shape: Sequence[int], like: torch.Tensor) -> tuple[int, ...]:
    """Strides of a dense tensor of ``shape`` whose dims are ordered in memory as ``like``'s
    (largest stride outermost, ties in dim order)."""
    strides = like.stride()
    order = sorted(range(like.ndim), key=lambda d: -strides[d])
    packed = contiguous_strides([shape[d] for d in order])
    out = [0] * like.ndim
    for d, s in zip(order, packed):
        out[d] = s
    return tuple(out)
