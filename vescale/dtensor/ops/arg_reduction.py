"""``argmax`` / ``argmin`` over a sharded dim: local candidates, then a small gather.

Upstream reduces each local shard and, on uneven shards, a rank whose shard is empty raises
(``max(): Expected reduction dim 0 to have non-zero size``) while the others wait in the
next collective. Here each rank takes its local arg-extremum (an empty shard contributes
``-inf``/``+inf``), shifts it by its shard's global offset, and the per-rank candidates
(values and indices: the size of the *output*, not of the input) are all-gathered along
each mesh dim sharding the reduced dim, innermost first; the first best candidate wins,
which is torch's first-occurrence rule because ranks hold shards in global order. The
output is replicated over those mesh dims and keeps the input's other placements.
Reductions over an unsharded dim, over all dims, or of ``Partial`` inputs go through the
strategy (no communication for the former; redistribution or the explicit-mode error for
``Partial``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale.dtensor._torch_compat import compute_local_shape_and_global_offset
from vescale.dtensor.api import from_local, wait_local
from vescale.dtensor.dispatch import bypass_dispatch, python_dispatch
from vescale.dtensor.placement_types import Placement, Replicate, Shard

__all__ = ["arg_extremum"]

aten = torch.ops.aten
_LARGEST = {aten.argmax.default: True, aten.argmin.default: False}


def _output_placements(
    placements: tuple[Placement, ...], dim: int, keepdim: bool, reduced_mesh_dims: list[int]
) -> list[Placement]:
    out: list[Placement] = []
    for i, p in enumerate(placements):
        if i in reduced_mesh_dims or not isinstance(p, Shard):
            out.append(Replicate())
        else:
            out.append(Shard(p.dim - 1 if p.dim > dim and not keepdim else p.dim))
    return out


@bypass_dispatch(list(_LARGEST))
def arg_extremum(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``argmax``/``argmin`` on DTensors (see module docstring)."""
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if not isinstance(x, _UpstreamDTensor) or dim is None or x.ndim == 0:
        return python_dispatch(op, args, kwargs)
    dim = dim % x.ndim
    mesh, placements = x.device_mesh, tuple(x.placements)
    sharding = [i for i, p in enumerate(placements) if p.is_shard(dim) and mesh.size(i) > 1]
    if not sharding or any(p.is_partial() for p in placements):
        return python_dispatch(op, args, kwargs)
    local = wait_local(x._local_tensor)
    _, offsets = compute_local_shape_and_global_offset(x.shape, mesh, placements)
    largest = _LARGEST[op]
    if local.shape[dim] > 0:
        idx = local.argmax(dim, keepdim=True) if largest else local.argmin(dim, keepdim=True)
        val = local.gather(dim, idx)
        idx = idx + offsets[dim]
    else:
        shape = list(local.shape)
        shape[dim] = 1
        fill = float("-inf") if largest else float("inf")
        val = torch.full(shape, fill, dtype=local.dtype, device=local.device)
        idx = torch.zeros(shape, dtype=torch.long, device=local.device)
    for mesh_dim in reversed(sharding):  # innermost first: candidates stay in global order
        vals = funcol.all_gather_tensor(val.contiguous(), dim, (mesh, mesh_dim))
        idxs = funcol.all_gather_tensor(idx.contiguous(), dim, (mesh, mesh_dim))
        best = vals.argmax(dim, keepdim=True) if largest else vals.argmin(dim, keepdim=True)
        val, idx = vals.gather(dim, best), idxs.gather(dim, best)
    if not keepdim:
        idx = idx.squeeze(dim)
    out_placements = _output_placements(placements, dim, bool(keepdim), sharding)
    shape = list(x.shape)
    if keepdim:
        shape[dim] = 1
    else:
        del shape[dim]
    stride = torch.empty(shape, device="meta").stride()
    return from_local(
        idx, mesh, out_placements, run_check=False, shape=torch.Size(shape), stride=stride
    )
