"""Redistribution beyond upstream's planner: any placement -> ``Partial``.

Upstream moves between Shard / Replicate / Partial -> (Shard | Replicate) with uneven
shards. We add every step that *targets* a Partial: the tensor is first brought to
Replicate on that mesh dim (upstream), then partitioned locally with no communication:
``sum`` keeps the value on coordinate 0 and zeros elsewhere (exact for integers),
``product`` ones elsewhere, ``avg``/``max``/``min`` keep the value on every coordinate.
"""

from __future__ import annotations

import torch

from vescale.dtensor._torch_compat import (
    AsyncCollectiveTensor,
    DTensorSpec,
    maybe_run_for_local_tensor,
    upstream_redistribute_local_tensor,
)
from vescale.dtensor.placement_types import Partial, Placement, Replicate

__all__ = ["redistribute_local_tensor", "replicate_to_partial", "wait_local"]


def wait_local(t: torch.Tensor) -> torch.Tensor:
    """``t`` waited if it is an in-flight async collective result, else ``t``."""
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


@maybe_run_for_local_tensor  # rank-dependent: run per simulated rank under LocalTensorMode
def replicate_to_partial(
    local: torch.Tensor, reduce_op: str, coordinate: int | torch.SymInt
) -> torch.Tensor:
    """Local partition of a replicated value so that ``reduce_op`` over ranks restores it."""
    if reduce_op in ("avg", "max", "min") or coordinate == 0:
        return local
    if reduce_op == "sum":
        return torch.zeros_like(local)
    if reduce_op == "product":
        return torch.ones_like(local)
    raise ValueError(f"Replicate -> Partial({reduce_op}) is not supported")


def redistribute_local_tensor(
    local: torch.Tensor,
    src: DTensorSpec,
    dst: DTensorSpec,
    *,
    async_op: bool = False,
) -> torch.Tensor:
    """The local shard of ``local`` (laid out as ``src``) laid out as ``dst``."""
    if src.mesh != dst.mesh:
        raise ValueError(f"redistribute: cannot move between meshes {src.mesh} and {dst.mesh}")
    if src.placements == dst.placements:
        return local
    mid: tuple[Placement, ...] = tuple(
        Replicate() if d.is_partial() and s != d else d
        for s, d in zip(src.placements, dst.placements)
    )
    if mid != src.placements:
        mid_spec = DTensorSpec(src.mesh, mid, tensor_meta=src.tensor_meta)
        local = upstream_redistribute_local_tensor(
            local, src, mid_spec, async_op=async_op, is_explicit=True
        )
    for mesh_dim, (m, d) in enumerate(zip(mid, dst.placements)):
        if m != d:
            assert isinstance(d, Partial)
            local = replicate_to_partial(local, d.reduce_op, src.mesh._sym_get_coordinate(mesh_dim))
    return local
