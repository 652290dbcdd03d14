"""``torch.equal`` with the minimum communication.

Different global shapes answer ``False`` from metadata; equal Shard/Replicate layouts compare
local shards and all-reduce the verdict (MIN) over the sharded mesh dims only, so Replicate
tensors need no communication and sub-meshes never talk to ranks outside them. Other
layouts go through the strategy (which redistributes, or raises in explicit mode).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale.dtensor.dispatch import bypass_dispatch, python_dispatch

aten = torch.ops.aten


@bypass_dispatch(aten.equal.default)
def equal(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``torch.equal`` on DTensors (see module docstring)."""
    a, b = args
    if not (isinstance(a, _UpstreamDTensor) and isinstance(b, _UpstreamDTensor)):
        return bool(python_dispatch(op, args, kwargs))
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    same_layout = a.device_mesh == b.device_mesh and a.placements == b.placements
    if not same_layout or any(p.is_partial() for p in a.placements):
        return bool(python_dispatch(op, args, kwargs))
    verdict = torch.equal(a._local_tensor, b._local_tensor)
    mesh = a.device_mesh
    sharded = [i for i, p in enumerate(a.placements) if p.is_shard() and mesh.size(i) > 1]
    if not sharded:
        return verdict
    flag = torch.tensor(int(verdict), device=a._local_tensor.device)
    for mesh_dim in sharded:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=mesh.get_group(mesh_dim))
    return bool(flag.item())
