"""Placements: upstream ``Shard`` and ``Replicate``, a ``Partial`` that accepts ``ReduceOp``,
``InterleavedShard``, and ``RaggedShard`` (defined in :mod:`vescale.dtensor.ragged`).

One vocabulary: ``Shard`` and ``Replicate`` *are* upstream's classes, and every upstream
``Partial`` (e.g. produced by an op strategy) is an instance of ``vescale.Partial``.
``InterleavedShard(dim, k)`` is what users see; a ``DTensorSpec`` carries the same layout as
upstream's ``_StridedShard(dim, split_factor=k)`` (:func:`spec_placements`), so upstream's
strategies and redistribution planner handle it (:func:`user_placements` maps back).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor.placement_types import Partial as _UpstreamPartial
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from vescale._torch_compat import (
    DTensorSpec,
    MemberType,
    StridedShard,
    TensorMeta,
    register_opaque_type,
)
from vescale.dtensor.layout import interleave_divides, interleaved_sizes
from vescale.dtensor.ragged import RaggedShard, check_ragged

__all__ = [
    "DTensorSpec",
    "ExtremumNormPartial",
    "InterleavedShard",
    "Partial",
    "Placement",
    "RaggedShard",
    "Replicate",
    "Shard",
    "TensorMeta",
    "check_interleaved",
    "is_norm_partial",
    "normalize_placements",
    "spec_placements",
    "user_placements",
]

_REDUCE_OP_NAMES: dict[Any, str] = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.PRODUCT: "product",
}
_REDUCE_OP_STRINGS = frozenset(_REDUCE_OP_NAMES.values())


def is_private_partial(p: object) -> bool:
    """A partial placement of upstream's own making (``_MaskPartial``, ``_NormPartial``, ...):
    its reduction is its own (e.g. masking and offsetting an index) and only upstream's
    planner performs it."""
    return isinstance(p, _UpstreamPartial) and type(p) not in (_UpstreamPartial, Partial)


def is_norm_partial(p: object) -> bool:
    """A norm's own pending reduction: upstream's ``_NormPartial`` (p-norms) or
    :class:`ExtremumNormPartial` (±inf norms). Only a norm op makes one, so reducing it
    finishes a norm the caller asked for."""
    return isinstance(p, _NormPartial)


class ExtremumNormPartial(_NormPartial):
    """A ±inf norm's pending max (``inf``) or min (``-inf``) over ranks of the per-rank norms:
    ``Partial("max"/"min")`` that says it came from a norm (upstream's ``_NormPartial``
    covers finite p only). Reduces, partitions and propagates like ``Partial("max"/"min")``."""

    def __init__(self, norm_type: float) -> None:
        _UpstreamPartial.__init__(self, "max" if norm_type > 0 else "min")
        object.__setattr__(self, "norm_type", norm_type)

    def _partition_value(self, tensor: torch.Tensor, mesh: Any, mesh_dim: int) -> torch.Tensor:
        return tensor  # max (min) of copies is the value

    def _pre_reduce_transform(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _post_reduce_transform(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __repr__(self) -> str:
        return f"ExtremumNormPartial({self.norm_type})"

    def __str__(self) -> str:
        return f"_NormP({self.norm_type})"


class _PartialMeta(type(_UpstreamPartial)):  # type: ignore[misc]
    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, _UpstreamPartial)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _UpstreamPartial)


class Partial(_UpstreamPartial, metaclass=_PartialMeta):
    """Pending reduction over a mesh dim: ``Partial("sum")`` or ``Partial(ReduceOp.SUM)``.

    Supported ops: sum, avg, max, min, product. Equal ops compare and hash equal, with
    upstream ``Partial`` too.
    """

    def __init__(self, reduce_op: str | Any = "sum") -> None:
        super().__init__(_reduce_op_name(reduce_op))


def _reduce_op_name(reduce_op: str | Any) -> str:
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        if name not in _REDUCE_OP_STRINGS:
            raise ValueError(
                f"Partial: unsupported reduce_op {reduce_op!r}; expected one of "
                f"{sorted(_REDUCE_OP_STRINGS)} or a torch.distributed.ReduceOp"
            )
        return name
    for op, name in _REDUCE_OP_NAMES.items():
        if reduce_op == op:  # ReduceOp and ReduceOp.RedOpType compare equal
            return name
    raise ValueError(f"Partial: unsupported reduce_op {reduce_op!r}")


register_opaque_type(
    Partial,
    typ="value",
    members={
        "is_shard": MemberType.USE_REAL,
        "is_partial": MemberType.USE_REAL,
        "is_replicate": MemberType.USE_REAL,
        "__eq__": MemberType.USE_REAL,
        "reduce_op": MemberType.USE_REAL,
    },
)


class InterleavedShard(Shard):
    """``Shard`` of tensor dim ``dim`` viewed as ``(interleaved_size, N // interleaved_size)``,
    sharding the second factor: every rank holds its slice of each of the ``interleaved_size``
    groups (``InterleavedShard(0, 3)`` on a merged ``[3*H, D]`` QKV weight gives each rank its
    rows of Q, K and V). Mesh dims apply in order, like ``Shard``. Needs ``N % k == 0`` and
    ``(N // k) % mesh_size == 0``. Never equal to ``Shard(dim)``.
    """

    interleaved_size: int

    def __init__(self, dim: int, interleaved_size: int) -> None:
        if isinstance(interleaved_size, bool) or not isinstance(interleaved_size, int):
            raise TypeError(
                f"InterleavedShard: interleaved_size must be an int, got {interleaved_size!r}"
            )
        if interleaved_size < 1:
            raise ValueError(
                f"InterleavedShard: interleaved_size must be >= 1, got {interleaved_size}"
            )
        super().__init__(dim)
        self.interleaved_size = interleaved_size

    def is_interleaved_shard(self, dim: int | None = None) -> bool:
        """True (for ``dim`` None or this placement's dim)."""
        return dim is None or dim == self.dim

    def to_strided(self) -> StridedShard:
        """The same layout as upstream's ``_StridedShard``."""
        return StridedShard(self.dim, split_factor=self.interleaved_size)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, InterleavedShard)
            and self.dim == other.dim
            and self.interleaved_size == other.interleaved_size
        )

    def __hash__(self) -> int:
        return hash((self.dim, self.interleaved_size))

    def __reduce__(self) -> tuple[Any, ...]:
        return (InterleavedShard, (self.dim, self.interleaved_size))

    def __repr__(self) -> str:
        return f"InterleavedShard(dim={self.dim}, interleaved_size={self.interleaved_size})"

    def __str__(self) -> str:
        return f"IS({self.dim}, {self.interleaved_size})"

    def __fx_repr__(self) -> tuple[str, dict[str, Any]]:
        return repr(self), {"InterleavedShard": InterleavedShard}


register_opaque_type(
    InterleavedShard,
    typ="value",
    members={
        "is_shard": MemberType.USE_REAL,
        "is_partial": MemberType.USE_REAL,
        "is_replicate": MemberType.USE_REAL,
        "is_interleaved_shard": MemberType.USE_REAL,
        "__eq__": MemberType.USE_REAL,
        "dim": MemberType.USE_REAL,
        "interleaved_size": MemberType.USE_REAL,
    },
)


def legacy_is_interleaved_shard(self: Placement, dim: int | None = None) -> bool:
    """veScale legacy's ``Placement.is_interleaved_shard``: False except on ``InterleavedShard``
    (legacy code asks every placement, upstream's included; installed by ``vescale._patches``)."""
    return False


def spec_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """``placements`` as a ``DTensorSpec`` carries them: ``InterleavedShard`` -> ``_StridedShard``."""
    return tuple(p.to_strided() if isinstance(p, InterleavedShard) else p for p in placements)


def user_placements(spec: DTensorSpec) -> tuple[Placement, ...]:
    """``spec.placements`` as users see them: ``_StridedShard`` -> ``InterleavedShard`` where
    the sizes divide (the two layouts are then the same data)."""
    placements = spec.placements
    if not any(type(p) is StridedShard for p in placements):
        return placements
    mesh_sizes = spec.mesh.shape
    sizes = interleaved_sizes(spec.shape, mesh_sizes, placements)
    return tuple(
        InterleavedShard(p.dim, int(p.split_factor))
        if type(p) is StridedShard and interleave_divides(size, int(p.split_factor), n)
        else p
        for p, size, n in zip(placements, sizes, mesh_sizes)
    )


def check_interleaved(
    shape: Sequence[int], mesh: Any, placements: Sequence[Placement], *, what: str
) -> None:
    """Raise ``ValueError`` naming dim, size, interleaved_size and mesh size where an
    ``InterleavedShard`` does not divide the tensor dim it shards."""
    if not any(isinstance(p, InterleavedShard) for p in placements):
        return  # reading no sizes: a dynamic (symbolic) dim stays unspecialized
    mesh_sizes = [mesh.size(i) for i in range(len(placements))]
    sizes = interleaved_sizes(shape, mesh_sizes, placements)
    for i, (p, size, n) in enumerate(zip(placements, sizes, mesh_sizes)):
        if isinstance(p, InterleavedShard) and not interleave_divides(size, p.interleaved_size, n):
            raise ValueError(
                f"{what}: {p!r} on mesh dim {i} needs tensor dim {p.dim} (size {size} there) "
                f"divisible by interleaved_size {p.interleaved_size} and size // "
                f"interleaved_size divisible by the mesh size {n} (placements "
                f"{tuple(placements)!r}, global shape {tuple(shape)}, mesh {mesh})"
            )


def normalize_placements(
    placements: Sequence[Placement] | None,
    mesh: Any,
    tensor_ndim: int,
    *,
    what: str,
    shape: Sequence[int] | None = None,
) -> tuple[Placement, ...]:
    """Validate ``placements`` for a tensor of ``tensor_ndim`` dims on ``mesh``.

    ``None`` means Replicate everywhere; a shorter list is padded with Replicate; negative
    shard dims are made positive. With ``shape``, ``InterleavedShard`` sizes are checked
    (:func:`check_interleaved`). Raises ``TypeError``/``ValueError`` naming ``what``
    (the API or op), the placements and the mesh.
    """
    if placements is None:
        return (Replicate(),) * mesh.ndim
    if isinstance(placements, Placement) or not isinstance(placements, Sequence):
        raise TypeError(f"{what}: placements must be a sequence of Placement, got {placements!r}")
    out: list[Placement] = []
    for i, p in enumerate(placements):
        if not isinstance(p, Placement):
            raise TypeError(
                f"{what}: placements[{i}] = {p!r} is not a Placement "
                f"(expected Shard, Replicate or Partial) in {tuple(placements)!r}"
            )
        if isinstance(p, Shard):
            dim = p.dim + tensor_ndim if p.dim < 0 else p.dim
            if not 0 <= dim < tensor_ndim:
                raise ValueError(
                    f"{what}: {p!r} on mesh dim {i} is out of range for a {tensor_ndim}-D "
                    f"tensor (placements {tuple(placements)!r}, mesh {mesh})"
                )
            if dim != p.dim:
                p = (
                    InterleavedShard(dim, p.interleaved_size)
                    if isinstance(p, InterleavedShard)
                    else Shard(dim)
                )
        out.append(p)
    if len(out) > mesh.ndim:
        raise ValueError(
            f"{what}: {len(out)} placements {tuple(out)!r} for a {mesh.ndim}-D mesh {mesh}"
        )
    out.extend(Replicate() for _ in range(mesh.ndim - len(out)))
    partial_ops = {p.reduce_op for p in out if isinstance(p, _UpstreamPartial)}
    if len(partial_ops) > 1:
        raise ValueError(
            f"{what}: mixed Partial reduce ops {sorted(partial_ops)} in {tuple(out)!r} are "
            f"not supported"
        )
    if shape is not None:
        check_interleaved(shape, mesh, out, what=what)
        check_ragged(shape, mesh, out, what=what)
    return tuple(out)


def make_spec(
    mesh: Any,
    placements: Sequence[Placement],
    shape: Sequence[int],
    stride: Sequence[int],
    dtype: torch.dtype,
) -> DTensorSpec:
    """A ``DTensorSpec`` with tensor meta (placements as specs carry them)."""
    return DTensorSpec(
        mesh,
        spec_placements(placements),
        tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype),
    )
