"""``RaggedShard(dims, local_units)``: a tensor's flattened prefix dims split over one mesh dim
in relative units (uneven, zeros allowed), never cutting a block of the trailing dims.

Layout. ``dims`` is a prefix ``(0,)``, ``(0, 1)``, ...: the tensor is viewed as ``rows =
prod(shape[:len(dims)])`` rows of ``block = prod(shape[len(dims):])`` elements. Rank ``i`` of
the mesh dim holds rows ``[sum(u[:i]) * r, sum(u[:i+1]) * r)`` with ``r = rows / sum(u)``
(which must be an integer): its local tensor is that contiguous 1-D slice of the row-major
storage, ``local_units[i] * r * block`` elements.

With other placements on the other mesh dims, the RaggedShard applies last, whatever its mesh
dim: it splits the tensor as the other mesh dims leave it (the *inner* tensor, e.g. one
``Shard(1)`` column chunk). For ``Shard(d)`` with ``d >= len(dims)`` the order makes no
difference (rows are never cut, so a block is split only along ``d``); ``Shard(d)`` with
``d < len(dims)`` takes its chunk first and the units split that chunk's rows, as upstream's
``_StridedShard`` records "shard on a later mesh dim first". One RaggedShard per placements.

``is_shard()`` is ``False``: upstream's planner and strategies read every ``is_shard()``
placement as a ``Shard`` with one ``dim`` and an N-D local tensor; a RaggedShard's local is
1-D. Redistribution (:mod:`vescale.dtensor.ragged_redistribute`) and the ops registered with
:func:`ragged_rule` handle it; any other op on a RaggedShard input raises
``UnsupportedOpError`` naming the op and the placements.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any

from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from vescale._torch_compat import (
    MemberType,
    compute_local_shape_at,
    register_opaque_type,
)
from vescale.dtensor.layout import chunk_sizes, interleave_factor

__all__ = [
    "RaggedShard",
    "check_ragged",
    "find_ragged",
    "inner_shape",
    "ragged_local_range",
    "replace_ragged",
]


def _int_tuple(value: Any, name: str) -> tuple[int, ...]:
    try:
        out = tuple(value)
    except TypeError:
        raise TypeError(f"RaggedShard: {name} must be a tuple of ints, got {value!r}") from None
    if any(isinstance(v, bool) or not isinstance(v, int) for v in out):
        raise TypeError(f"RaggedShard: {name} must be a tuple of ints, got {value!r}")
    return out


class RaggedShard(Placement):
    """Tensor dims ``dims`` (a prefix ``(0,)``, ``(0, 1)``, ...) flattened and split over a
    mesh dim in proportion to ``local_units`` (one non-negative int per rank of that mesh
    dim); the trailing dims are never cut. Each rank's local tensor is its contiguous 1-D
    slice of the flattened storage (see the module doc). Frozen; equal (and hashed) by
    ``dims`` and ``local_units``."""

    dims: tuple[int, ...]
    local_units: tuple[int, ...]

    def __init__(self, dims: Sequence[int] = (0,), local_units: Sequence[int] = ()) -> None:
        super().__init__()
        d, u = _int_tuple(dims, "dims"), _int_tuple(local_units, "local_units")
        if not d or d != tuple(range(len(d))):
            raise ValueError(
                f"RaggedShard: dims must be a prefix of the tensor dims, (0,), (0, 1), ..., got {d}"
            )
        if not u or any(x < 0 for x in u) or sum(u) == 0:
            raise ValueError(
                f"RaggedShard: local_units must be non-negative ints, one per rank of the mesh "
                f"dim, with a positive sum, got {u}"
            )
        object.__setattr__(self, "dims", d)
        object.__setattr__(self, "local_units", u)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"RaggedShard is frozen: cannot set {name!r}")

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RaggedShard)
            and self.dims == other.dims
            and self.local_units == other.local_units
        )

    def __hash__(self) -> int:
        return hash((RaggedShard, self.dims, self.local_units))

    def __reduce__(self) -> tuple[Any, ...]:
        return (RaggedShard, (self.dims, self.local_units))

    def __repr__(self) -> str:
        return f"RaggedShard(dims={self.dims}, local_units={self.local_units})"

    def __str__(self) -> str:
        return f"RS({self.dims}, {self.local_units})"

    def __fx_repr__(self) -> tuple[str, dict[str, Any]]:
        return repr(self), {"RaggedShard": RaggedShard}

    # ---- geometry of one (inner) tensor shape ------------------------------------------

    def rows(self, shape: Sequence[int]) -> int:
        """The number of rows: ``prod(shape[:len(dims)])``."""
        return math.prod(int(s) for s in shape[: len(self.dims)])

    def block_numel(self, shape: Sequence[int]) -> int:
        """Elements per row (a block never cut): ``prod(shape[len(dims):])``."""
        return math.prod(int(s) for s in shape[len(self.dims) :])

    def unit_numel(self, shape: Sequence[int]) -> int:
        """Elements per unit for a tensor of ``shape``; ``ValueError`` if the rows do not
        split into ``sum(local_units)`` equal parts."""
        if len(shape) < len(self.dims):
            raise ValueError(
                f"{self!r}: dims {self.dims} out of range for a {len(shape)}-D tensor "
                f"of shape {tuple(shape)}"
            )
        rows, total = self.rows(shape), sum(self.local_units)
        if rows % total:
            raise ValueError(
                f"{self!r}: the {rows} rows of shape {tuple(shape)} (dims {self.dims} "
                f"flattened) do not split into sum(local_units) = {total} equal units; "
                f"choose local_units whose sum divides {rows}"
            )
        return rows // total * self.block_numel(shape)

    def local_ranges(self, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """Per rank of the mesh dim, ``(element offset, numel)`` of its slice of the
        flattened storage of a tensor of ``shape``."""
        unit = self.unit_numel(shape)
        starts = itertools.accumulate(self.local_units, initial=0)
        return tuple((s * unit, u * unit) for s, u in zip(starts, self.local_units))


register_opaque_type(
    RaggedShard,
    typ="value",
    members={
        "is_shard": MemberType.USE_REAL,
        "is_partial": MemberType.USE_REAL,
        "is_replicate": MemberType.USE_REAL,
        "__eq__": MemberType.USE_REAL,
        "dims": MemberType.USE_REAL,
        "local_units": MemberType.USE_REAL,
    },
)


# ---- geometry on a mesh ------------------------------------------------------------------


def find_ragged(placements: Sequence[Placement]) -> tuple[int, RaggedShard] | None:
    """``(mesh dim, placement)`` of the RaggedShard in ``placements``; ``None`` if none."""
    for m, p in enumerate(placements):
        if isinstance(p, RaggedShard):
            return m, p
    return None


def replace_ragged(placements: Sequence[Placement], by: Placement) -> tuple[Placement, ...]:
    """``placements`` with every RaggedShard replaced by ``by``."""
    return tuple(by if isinstance(p, RaggedShard) else p for p in placements)


def inner_shape(
    shape: Sequence[int],
    mesh: Any,
    placements: Sequence[Placement],
    coordinate: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """The shape of the tensor the RaggedShard splits at mesh ``coordinate`` (this rank's by
    default): ``shape`` as the other mesh dims' placements leave it."""
    coord = coordinate if coordinate is not None else mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"inner_shape: this rank is not part of {mesh}")
    other = replace_ragged(placements, Replicate())
    return compute_local_shape_at(shape, tuple(mesh.shape), tuple(coord), other)


def ragged_local_range(
    shape: Sequence[int],
    mesh: Any,
    placements: Sequence[Placement],
    coordinate: Sequence[int] | None = None,
) -> tuple[int, int]:
    """``(element offset, numel)`` of the local slice at mesh ``coordinate`` (this rank's by
    default) in the flattened inner tensor (:func:`inner_shape`)."""
    coord = coordinate if coordinate is not None else mesh.get_coordinate()
    found = find_ragged(placements)
    if found is None or coord is None:
        raise ValueError(f"ragged_local_range: no RaggedShard in {tuple(placements)} on {mesh}")
    m, p = found
    return p.local_ranges(inner_shape(shape, mesh, placements, coord))[coord[m]]


@functools.lru_cache(maxsize=1024)
def _inner_shapes(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]
) -> frozenset[tuple[int, ...]]:
    """Every inner shape over the mesh (per tensor dim, the sizes its nested shards take)."""
    sizes: list[set[int]] = [{int(s)} for s in shape]
    for n, p in zip(mesh_shape, placements):
        if isinstance(p, Shard):
            sizes[p.dim] = {c for s in sizes[p.dim] for c in chunk_sizes(s, n)}
    return frozenset(itertools.product(*sizes))


def check_ragged(
    shape: Sequence[int], mesh: Any, placements: Sequence[Placement], *, what: str
) -> None:
    """Raise ``ValueError`` naming ``what``, the placements, the shape and the mesh where a
    RaggedShard in ``placements`` does not fit: more than one, ``len(local_units)`` not the
    mesh dim's size, dims beyond the tensor's, an interleaved shard beside it, or rows that
    do not split into ``sum(local_units)`` units on some rank."""
    found = find_ragged(placements)
    if found is None:
        return
    m, p = found
    where = f"(placements {tuple(placements)!r}, global shape {tuple(shape)}, mesh {mesh})"
    if sum(isinstance(q, RaggedShard) for q in placements) > 1:
        raise ValueError(f"{what}: at most one RaggedShard per placements {where}")
    if len(p.local_units) != mesh.size(m):
        raise ValueError(
            f"{what}: {p!r} on mesh dim {m} has {len(p.local_units)} local_units for the "
            f"{mesh.size(m)} ranks of that mesh dim {where}"
        )
    if any(interleave_factor(q) is not None for q in placements):
        raise ValueError(f"{what}: RaggedShard does not compose with an interleaved shard {where}")
    if len(p.dims) > len(shape):
        raise ValueError(f"{what}: {p!r} dims exceed the {len(shape)}-D tensor's {where}")
    other = replace_ragged(placements, Replicate())
    for inner in sorted(_inner_shapes(tuple(shape), tuple(mesh.shape), other)):
        rows, total = p.rows(inner), sum(p.local_units)
        if rows % total:
            raise ValueError(
                f"{what}: {p!r} on mesh dim {m} cannot split the {rows} rows of shape "
                f"{inner} (tensor dims {p.dims} flattened, the tensor as the other mesh dims "
                f"leave it) into sum(local_units) = {total} equal units {where}; choose "
                f"local_units whose sum divides the rows"
            )
