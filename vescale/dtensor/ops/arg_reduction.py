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
``Partial``), as do interleaved (``InterleavedShard``) layouts, whose shards are not contiguous.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale.dtensor.dtensor import wrap_local
from vescale.dtensor.hooks import bypass_dispatch
from vescale.dtensor.inflight import wait_local
from vescale.dtensor.layout import contiguous_shards, local_range, sharding_mesh_dims
from vescale.dtensor.op_args import bind
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


def _candidates(
    local: torch.Tensor, offset: int, dim: int, k: int, largest: bool, first: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``k`` best (values, global indices) along ``dim``; a short or empty shard
    is padded with candidates that never win. ``first``: argmax/argmin (first occurrence)."""
    n = local.shape[dim]
    if first and n:
        idx = local.argmax(dim, keepdim=True) if largest else local.argmin(dim, keepdim=True)
        val = local.gather(dim, idx)
    else:
        val, idx = local.topk(min(k, n), dim, largest=largest, sorted=True)
    idx = idx + offset
    if idx.shape[dim] < k:
        pad = list(local.shape)
        pad[dim] = k - idx.shape[dim]
        fill = float("-inf") if largest else float("inf")
        val = torch.cat([val, torch.full(pad, fill, dtype=val.dtype, device=val.device)], dim)
        idx = torch.cat([idx, torch.zeros(pad, dtype=torch.long, device=idx.device)], dim)
    return val, idx


def _gather_best(
    val: torch.Tensor,
    idx: torch.Tensor,
    dim: int,
    k: int,
    largest: bool,
    first: bool,
    mesh: Any,
    mesh_dims: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best over all ranks of ``mesh_dims`` (innermost first: candidates stay in
    global order, so the first best is torch's first occurrence)."""
    for mesh_dim in reversed(mesh_dims):
        vals = wait_local(funcol.all_gather_single(val.contiguous(), dim, (mesh, mesh_dim)))
        idxs = wait_local(funcol.all_gather_single(idx.contiguous(), dim, (mesh, mesh_dim)))
        if first:
            best = vals.argmax(dim, keepdim=True) if largest else vals.argmin(dim, keepdim=True)
        else:
            best = vals.topk(k, dim, largest=largest, sorted=True)[1]
        val, idx = vals.gather(dim, best), idxs.gather(dim, best)
    return val, idx


def _reduce(
    x: _UpstreamDTensor, dim: int, k: int, largest: bool, first: bool
) -> tuple[torch.Tensor, torch.Tensor, list[Placement], list[int]]:
    """(values, indices, output placements, sharding mesh dims) with ``dim`` kept (size k)."""
    mesh, placements = x.device_mesh, tuple(x.placements)
    sharding = sharding_mesh_dims(mesh, placements, dim)
    start, _ = local_range(x.shape, mesh, placements, dim)
    val, idx = _candidates(wait_local(x._local_tensor), start, dim, k, largest, first)
    if sharding:
        val, idx = _gather_best(val, idx, dim, k, largest, first, mesh, sharding)
    return val, idx, _output_placements(placements, dim, True, sharding), sharding


def _gatherable(x: Any) -> bool:
    """A non-scalar DTensor of contiguous shards, none Partial, on a mesh with process groups:
    candidates can be gathered (a meta mesh has none; upstream's propagation, planned by
    vescale without communication there, gives the same shapes)."""
    return (
        isinstance(x, _UpstreamDTensor)
        and x.device_mesh.device_type != "meta"
        and x.ndim > 0
        and not any(p.is_partial() for p in x.placements)
        and contiguous_shards(x.placements)
    )


def _over_sharded_dim(op: torch._ops.OpOverload, args: Any, kwargs: Any) -> bool:
    """argmax/argmin of a gatherable input over one of its sharded dims."""
    a = bind(op, args, kwargs)
    x, dim = a["self"], a["dim"]
    return (
        _gatherable(x)
        and dim is not None
        and bool(sharding_mesh_dims(x.device_mesh, x.placements, dim % x.ndim))
    )


@bypass_dispatch(list(_LARGEST), when=_over_sharded_dim)
def arg_extremum(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``argmax``/``argmin`` over a sharded dim (see module docstring)."""
    a = bind(op, args, kwargs)
    x, keepdim = a["self"], bool(a["keepdim"])
    dim = a["dim"] % x.ndim
    _, idx, placements, sharding = _reduce(x, dim, 1, _LARGEST[op], first=True)
    shape = list(x.shape)
    shape[dim] = 1
    if not keepdim:
        idx = idx.squeeze(dim)
        del shape[dim]
        placements = _output_placements(tuple(x.placements), dim, False, sharding)
    return wrap_local(idx, x.device_mesh, placements, shape)


@bypass_dispatch(aten.topk.default, when=lambda op, a, kw: _gatherable(bind(op, a, kw)["self"]))
def sharded_topk(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``topk`` on DTensors: local along an unsharded dim (any Shard/Replicate layout, uneven
    included), candidates + gather along a sharded one (see module docstring); sorted."""
    bound = bind(op, args, kwargs)
    x, k = bound["self"], int(bound["k"])
    dim = bound["dim"] % x.ndim
    if k > x.shape[dim]:
        raise RuntimeError(
            f"aten.topk.default: k={k} is larger than dim {dim} of size {x.shape[dim]} "
            f"(global shape {tuple(x.shape)}, placements {tuple(x.placements)} on {x.device_mesh})"
        )
    val, idx, placements, _ = _reduce(x, dim, k, bound["largest"], first=False)
    shape = list(x.shape)
    shape[dim] = k
    return wrap_local(val, x.device_mesh, placements, shape), wrap_local(
        idx, x.device_mesh, placements, shape
    )
