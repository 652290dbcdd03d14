"""Placements: upstream ``Shard`` and ``Replicate``, a ``Partial`` that accepts ``ReduceOp``.

One vocabulary: ``Shard`` and ``Replicate`` *are* upstream's classes, and every upstream
``Partial`` (e.g. produced by an op strategy) is an instance of ``vescale.Partial``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import Partial as _UpstreamPartial
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from vescale.dtensor._torch_compat import DTensorSpec, MemberType, TensorMeta, register_opaque_type

__all__ = [
    "DTensorSpec",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "TensorMeta",
    "normalize_placements",
]

_REDUCE_OP_NAMES: dict[Any, str] = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.PRODUCT: "product",
}
_REDUCE_OP_STRINGS = frozenset(_REDUCE_OP_NAMES.values())


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


def normalize_placements(
    placements: Sequence[Placement] | None,
    mesh: Any,
    tensor_ndim: int,
    *,
    what: str,
) -> tuple[Placement, ...]:
    """Validate ``placements`` for a tensor of ``tensor_ndim`` dims on ``mesh``.

    ``None`` means Replicate everywhere; a shorter list is padded with Replicate; negative
    shard dims are made positive. Raises ``TypeError``/``ValueError`` naming ``what``
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
                p = Shard(dim)
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
    return tuple(out)


def make_spec(
    mesh: Any,
    placements: Sequence[Placement],
    shape: Sequence[int],
    stride: Sequence[int],
    dtype: torch.dtype,
) -> DTensorSpec:
    """A ``DTensorSpec`` with tensor meta."""
    return DTensorSpec(
        mesh,
        tuple(placements),
        tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype),
    )
