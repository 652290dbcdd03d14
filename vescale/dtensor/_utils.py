"""veScale-legacy layout helpers (``vescale.dtensor._utils``), over upstream's.

``compute_local_shape_and_global_offset`` is upstream's; the others keep legacy's signatures:
a rank outside the mesh gets ``()`` from :func:`compute_local_shape` and ``None`` from
:func:`gather_local_tensor_shape`. :func:`equal`/:func:`allclose` compare two DTensors'
metadata (shape, stride, dtype, mesh, placements) and this rank's local values, as legacy did:
the answer is per rank, with no communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._torch_compat import compute_global_tensor_info as _even_global_info
from vescale._torch_compat import compute_local_shape_and_global_offset
from vescale.dtensor.layout import dense_strides
from vescale.dtensor.placement_types import Placement, Shard

__all__ = [
    "allclose",
    "compute_global_tensor_info",
    "compute_local_shape",
    "compute_local_shape_and_global_offset",
    "equal",
    "gather_local_tensor_shape",
]


def compute_local_shape(
    global_shape: Sequence[int], mesh: Any, placements: Sequence[Placement]
) -> tuple[int, ...]:
    """This rank's shard shape of a ``global_shape`` tensor laid out as ``placements``
    (``torch.chunk`` split); ``()`` on a rank outside ``mesh``."""
    if mesh.get_coordinate() is None:
        return ()
    shape, _ = compute_local_shape_and_global_offset(
        tuple(global_shape), mesh, placements, skip_offset=True
    )
    return tuple(shape)


def gather_local_tensor_shape(
    local: torch.Tensor | torch.Size,
    mesh: Any,
    placements: Sequence[Placement],
    shard_only: bool = False,
) -> dict[int, list[list[int]]] | None:
    """Per mesh dim, the local shapes of every rank along it (one all-gather per mesh dim;
    only the ``Shard`` mesh dims with ``shard_only``); ``None`` on a rank outside ``mesh``."""
    if mesh.get_coordinate() is None:
        return None
    shape = local if isinstance(local, torch.Size) else local.shape
    mine = torch.tensor([list(shape)], dtype=torch.int64, device=mesh.device_type)
    out = {}
    for mesh_dim, p in enumerate(placements):
        if shard_only and not isinstance(p, Shard):
            continue
        gathered = funcol.all_gather_single(mine, 0, mesh.get_group(mesh_dim))
        out[mesh_dim] = funcol.wait_tensor(gathered).tolist()
    return out


def compute_global_tensor_info(
    tensor: torch.Tensor,
    mesh: Any,
    placements: Sequence[Placement],
    meshdim_localtensor_shape: dict[int, list[list[int]]] | None = None,
) -> tuple[list[int], list[int]]:
    """Global ``(shape, stride)`` of the DTensor whose local shard is ``tensor``.

    Without ``meshdim_localtensor_shape`` shards are even (upstream's rule). With the local
    shapes of :func:`gather_local_tensor_shape`, a tensor dim sharded by one mesh dim is the
    sum of that mesh dim's local sizes, and the stride is the dense one in ``tensor``'s dim order.
    """
    if meshdim_localtensor_shape is None:
        shape, stride = _even_global_info(tensor, mesh, placements)
        return list(shape), list(stride)
    shape = list(tensor.shape)
    seen: set[int] = set()
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, Shard):
            continue
        dim = p.dim % tensor.ndim
        if dim in seen:  # a dim sharded twice: the first mesh dim's sum already counted it
            shape[dim] *= mesh.size(mesh_dim)
        else:
            shape[dim] = sum(s[dim] for s in meshdim_localtensor_shape[mesh_dim])
        seen.add(dim)
    return shape, list(dense_strides(shape, tensor))


def _same_layout(a: Any, b: Any, exact_device: bool) -> bool:
    if not (isinstance(a, _UpstreamDTensor) and isinstance(b, _UpstreamDTensor)):
        return False
    if (a.shape, a.stride(), a.dtype, a.layout, a.requires_grad) != (
        b.shape,
        b.stride(),
        b.dtype,
        b.layout,
        b.requires_grad,
    ):
        return False
    ma, mb = a.device_mesh, b.device_mesh
    same_mesh = ma == mb if exact_device else torch.equal(ma.mesh, mb.mesh)
    if not same_mesh or tuple(a.placements) != tuple(b.placements):
        return False
    la, lb = a._local_tensor, b._local_tensor
    return (la.shape, la.stride(), la.dtype, la.storage_offset()) == (
        lb.shape,
        lb.stride(),
        lb.dtype,
        lb.storage_offset(),
    ) and (not exact_device or la.device.type == lb.device.type)


def equal(dt1: Any, dt2: Any, exact_device: bool = True) -> bool:
    """Whether two DTensors have the same layout and this rank's local values are equal."""
    if not _same_layout(dt1, dt2, exact_device):
        return False
    if dt1.is_meta and dt2.is_meta:
        return True
    return torch.equal(dt1._local_tensor.cpu(), dt2._local_tensor.cpu())


def allclose(
    dt1: Any,
    dt2: Any,
    rtol: float = 1e-05,
    atol: float = 1e-08,
    equal_nan: bool = False,
    exact_device: bool = True,
) -> bool:
    """As :func:`equal`, with ``torch.allclose`` on the local values."""
    if not _same_layout(dt1, dt2, exact_device):
        return False
    if dt1.is_meta and dt2.is_meta:
        return True
    return torch.allclose(
        dt1._local_tensor.cpu(),
        dt2._local_tensor.cpu(),
        rtol=rtol,
        atol=atol,
        equal_nan=equal_nan,
    )
