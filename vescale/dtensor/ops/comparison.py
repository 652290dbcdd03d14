"""``torch.equal`` with the minimum communication.

Different global shapes or dtypes answer ``False`` from metadata. Otherwise both inputs are
laid out as the first one's placements (Partial mesh dims replicated; an input needing
communication for it raises in explicit mode), local shards are compared, and the verdict is
all-reduced (MIN) over the sharded mesh dims only: Replicate tensors need no communication
and sub-meshes never talk to ranks outside them. A rank outside the mesh answers ``True``
(upstream's default) without communicating.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale.dtensor.explicit import redistribute_for
from vescale.dtensor.hooks import bypass_dispatch
from vescale.dtensor.inflight import wait_local
from vescale.dtensor.op_args import bind
from vescale.dtensor.placement_types import Replicate

aten = torch.ops.aten


def _same_mesh(op: torch._ops.OpOverload, args: Any, kwargs: Any) -> bool:
    """Both operands DTensors on one mesh."""
    a, b = bind(op, args, kwargs).values()
    return (
        isinstance(a, _UpstreamDTensor)
        and isinstance(b, _UpstreamDTensor)
        and a.device_mesh == b.device_mesh
    )


# off_mesh: no world all-reduce off the mesh
@bypass_dispatch(aten.equal.default, when=_same_mesh, off_mesh=True)
def equal(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``torch.equal`` of DTensors on one mesh (see module docstring)."""
    a, b = bind(op, args, kwargs).values()
    mesh = a.device_mesh
    if not mesh._is_current_rank_part_of_mesh():
        return True
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    target = [Replicate() if p.is_partial() else p for p in a.placements]
    a, b = redistribute_for(op, a, target), redistribute_for(op, b, target)
    verdict = torch.equal(wait_local(a._local_tensor), wait_local(b._local_tensor))
    sharded = [i for i, p in enumerate(target) if p.is_shard() and mesh.size(i) > 1]
    if not sharded:
        return verdict
    flag = torch.tensor(int(verdict), device=a._local_tensor.device)
    for mesh_dim in sharded:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=mesh.get_group(mesh_dim))
    return bool(flag.item())
