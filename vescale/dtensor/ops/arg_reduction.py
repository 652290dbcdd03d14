"""``argmax`` / ``argmin`` / ``topk`` over a sharded dim: local candidates, then a small gather.

Upstream reduces each local shard and, on uneven shards, a rank whose shard is empty raises
(``max(): Expected reduction dim 0 to have non-zero size``) while the others wait in the
next collective. Here each rank takes its local arg-extremum (an empty shard contributes
``-inf``/``+inf``), shifts it by its shard's global offset, and the per-rank candidates
(values and indices: the size of the *output*, not of the input) are all-gathered along
each mesh dim sharding the reduced dim, innermost first; the first best candidate wins,
which is torch's first-occurrence rule because ranks hold shards in global order. The
output is replicated over those mesh dims and keeps the input's other placements.
``topk`` works the same way with ``k`` candidates per rank (an uneven shard shorter than
``k`` pads with ``-inf``/``+inf``): ``k`` values and indices per rank are gathered instead of
the whole dim. Reductions over an unsharded dim, over all dims, or of ``Partial`` inputs go
through the strategy (no communication for the former; redistribution or the explicit-mode error for
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

__all__ = ["arg_extremum", "sharded_topk"]

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


def _gather_best(
    val: torch.Tensor,
    idx: torch.Tensor,
    dim: int,
    k: int,
    largest: bool,
    mesh: Any,
    mesh_dims: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    for mesh_dim in reversed(mesh_dims):  # innermost first: candidates stay in global order
        vals = funcol.all_gather_tensor(val.contiguous(), dim, (mesh, mesh_dim))
        idxs = funcol.all_gather_tensor(idx.contiguous(), dim, (mesh, mesh_dim))
        val, best = wait_local(vals).topk(k, dim, largest=largest, sorted=True)
        idx = wait_local(idxs).gather(dim, best)
    return val, idx


@bypass_dispatch(aten.topk.default)
def sharded_topk(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``topk`` on DTensors: local along an unsharded dim (any Shard/Replicate layout, uneven
    included), candidates + gather along a sharded one (see module docstring); sorted."""
    names = ["self", "k", "dim", "largest", "sorted"]
    bound = dict(zip(names, args)) | kwargs
    x, k = bound["self"], int(bound["k"])
    dim, largest = bound.get("dim", -1), bound.get("largest", True)
    if not isinstance(x, _UpstreamDTensor) or x.ndim == 0:
        return python_dispatch(op, args, kwargs)
    dim = dim % x.ndim
    mesh, placements = x.device_mesh, tuple(x.placements)
    sharding = [i for i, p in enumerate(placements) if p.is_shard(dim) and mesh.size(i) > 1]
    if any(p.is_partial() for p in placements):
        return python_dispatch(op, args, kwargs)
    local = wait_local(x._local_tensor)
    _, offsets = compute_local_shape_and_global_offset(x.shape, mesh, placements)
    if k > x.shape[dim]:
        raise RuntimeError(
            f"aten.topk.default: k={k} is larger than dim {dim} of size {x.shape[dim]} "
            f"(global shape {tuple(x.shape)}, placements {placements} on {mesh})"
        )
    n = local.shape[dim]
    val, idx = local.topk(min(k, n), dim, largest=largest, sorted=True)
    idx = idx + offsets[dim]
    if n < k:  # a short uneven shard: pad with candidates that never win
        pad_shape = list(local.shape)
        pad_shape[dim] = k - n
        fill = float("-inf") if largest else float("inf")
        val = torch.cat([val, torch.full(pad_shape, fill, dtype=val.dtype)], dim)
        idx = torch.cat([idx, torch.zeros(pad_shape, dtype=torch.long)], dim)
    if sharding:
        val, idx = _gather_best(val, idx, dim, k, largest, mesh, sharding)
    out_placements = _output_placements(placements, dim, True, sharding)
    shape = list(x.shape)
    shape[dim] = k
    stride = torch.empty(shape, device="meta").stride()
    size = torch.Size(shape)
    return (
        from_local(val, mesh, out_placements, run_check=False, shape=size, stride=stride),
        from_local(idx, mesh, out_placements, run_check=False, shape=size, stride=stride),
    )
