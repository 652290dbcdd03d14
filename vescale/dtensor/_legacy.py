"""veScale legacy's collectives on DTensors, as thin layers over ``redistribute``.

``vescale_all_gather`` / ``vescale_all_reduce`` / ``vescale_reduce_scatter``: a
``redistribute`` to Replicate (gather, reduce) or Shard (reduce-scatter) on the given mesh
dims. (Legacy's constructor and ``DTensor.tolist()`` are the class's own, in
:mod:`vescale.dtensor.dtensor`.) ``Shard._unpad_tensor``: legacy's helper on upstream's
``Shard`` (installed by ``vescale._patches``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vescale.dtensor.dtensor import DTensor
from vescale.dtensor.placement_types import Replicate, Shard

__all__ = [
    "legacy_unpad_tensor",
    "vescale_all_gather",
    "vescale_all_reduce",
    "vescale_reduce_scatter",
]


def _mesh_dims(dims: int | Sequence[int] | None, ndim: int, default: list[int]) -> list[int]:
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        return default
    items = [dims] if isinstance(dims, int) else list(dims)
    return [d % ndim for d in items]


def vescale_all_gather(
    d_tensor: DTensor, mesh_dims: int | Sequence[int] | None = None, async_op: bool = True
) -> DTensor:
    """``d_tensor`` replicated on ``mesh_dims`` (default: every Shard mesh dim)."""
    pl = list(d_tensor.placements)
    sharded = [i for i, p in enumerate(pl) if p.is_shard()]
    for d in _mesh_dims(mesh_dims, len(pl), sharded):
        if d not in sharded:
            raise ValueError(
                f"vescale_all_gather: mesh dim {d} is not sharded in {tuple(pl)} "
                f"on {d_tensor.device_mesh}"
            )
        pl[d] = Replicate()
    return d_tensor.redistribute(placements=pl, async_op=async_op)


def vescale_all_reduce(
    d_tensor: DTensor, mesh_dims: int | Sequence[int] | None = None, async_op: bool = True
) -> DTensor:
    """``d_tensor`` reduced to Replicate on ``mesh_dims`` (default: every Partial mesh dim)."""
    pl = list(d_tensor.placements)
    partial = [i for i, p in enumerate(pl) if p.is_partial()]
    for d in _mesh_dims(mesh_dims, len(pl), partial):
        if d not in partial:
            raise ValueError(
                f"vescale_all_reduce: mesh dim {d} is not Partial in {tuple(pl)} "
                f"on {d_tensor.device_mesh}"
            )
        pl[d] = Replicate()
    return d_tensor.redistribute(placements=pl, async_op=async_op)


def vescale_reduce_scatter(
    d_tensor: DTensor,
    reduce_mesh_dims: int | Sequence[int] | None = None,
    scatter_dims: int | Sequence[int] | None = None,
    mesh_dims: int | Sequence[int] | None = None,
    async_op: bool = True,
) -> DTensor:
    """``d_tensor`` with every Partial mesh dim reduced, and ``Shard(scatter_dims[i])`` on
    ``mesh_dims[i]``."""
    if scatter_dims is None or mesh_dims is None:
        raise ValueError("vescale_reduce_scatter: scatter_dims and mesh_dims are required")
    pl = list(d_tensor.placements)
    sdims = [scatter_dims] if isinstance(scatter_dims, int) else list(scatter_dims)
    mdims = _mesh_dims(mesh_dims, len(pl), [])
    if len(sdims) != len(mdims):
        raise ValueError(
            f"vescale_reduce_scatter: {len(sdims)} scatter_dims {sdims} for {len(mdims)} "
            f"mesh_dims {mdims}"
        )
    partial = [i for i, p in enumerate(pl) if p.is_partial()]
    for d in _mesh_dims(reduce_mesh_dims, len(pl), partial):
        if d not in partial:
            raise ValueError(
                f"vescale_reduce_scatter: mesh dim {d} is not Partial in {tuple(pl)} "
                f"on {d_tensor.device_mesh}"
            )
    for d in partial:
        pl[d] = Replicate()
    for sd, md in zip(sdims, mdims):
        pl[md] = Shard(sd % d_tensor.ndim)
    return d_tensor.redistribute(placements=pl, async_op=async_op)


def legacy_unpad_tensor(self: Shard, tensor: torch.Tensor, pad_size: int) -> torch.Tensor:
    """veScale legacy's ``Shard._unpad_tensor``: ``tensor`` without the last ``pad_size``
    entries along the shard dim (a view), undoing ``Shard._split_tensor``'s padding."""
    return tensor.narrow(self.dim, 0, tensor.size(self.dim) - pad_size)
