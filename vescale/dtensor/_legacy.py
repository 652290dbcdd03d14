"""veScale legacy's DTensor entry points, as thin layers over vescale's.

* :func:`construct`: ``DTensor(local, device_mesh, placements, *, shape, dtype, requires_grad,
  stride)`` wraps ``local`` as this rank's shard (no communication, no check), as legacy's
  constructor did, warning when ``requires_grad`` differs from ``local``'s; upstream's
  ``DTensor(local, spec, *, requires_grad)`` is unchanged.
* :func:`tolist`: legacy's ``DTensor.tolist()``, this rank's local values as a (nested) list.
* ``vescale_all_gather`` / ``vescale_all_reduce`` / ``vescale_reduce_scatter``: a
  ``redistribute`` to Replicate (gather, reduce) or Shard (reduce-scatter) on the given mesh dims.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._torch_compat import DTensorSpec
from vescale.dtensor.dtensor import DTensor, as_vescale_spec
from vescale.dtensor.placement_types import Replicate, Shard, make_spec, normalize_placements

__all__ = [
    "construct",
    "tolist",
    "vescale_all_gather",
    "vescale_all_reduce",
    "vescale_reduce_scatter",
]


def construct(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``cls(...)`` with upstream's arguments, or legacy's ``(local, device_mesh, placements,
    *, shape, dtype, requires_grad, stride)``."""
    if (len(args) > 1 and isinstance(args[1], DTensorSpec)) or "spec" in kwargs:
        return _UpstreamDTensor.__new__(cls, *args, **kwargs)  # type: ignore[call-overload]
    return _construct_legacy(cls, *args, **kwargs)


def _construct_legacy(
    cls: type,
    local_tensor: torch.Tensor,
    device_mesh: Any,
    placements: Sequence[Any],
    *,
    shape: Sequence[int],
    dtype: torch.dtype,
    requires_grad: bool,
    stride: Sequence[int],
) -> Any:
    if requires_grad and not local_tensor.requires_grad:  # upstream warns the other way round
        warnings.warn(
            "To construct DTensor from torch.Tensor, it's recommended to use "
            "local_tensor.detach() and make requires_grad consistent.",
            stacklevel=3,
        )
    pl = normalize_placements(placements, device_mesh, len(shape), what="DTensor", shape=shape)
    spec = as_vescale_spec(make_spec(device_mesh, pl, shape, stride, dtype))
    return _UpstreamDTensor.__new__(cls, local_tensor, spec, requires_grad=requires_grad)  # type: ignore[call-overload]


def tolist(self: DTensor) -> Any:
    """This rank's local values as a (nested) list (legacy's ``DTensor.tolist``)."""
    return self._local_tensor.tolist()


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
