"""Redistribution to and from ``RaggedShard`` (:mod:`vescale.dtensor.ragged`), any mesh.

Only the RaggedShard's mesh dim ``m`` changing, the others equal (1-D meshes always):

* RaggedShard -> RaggedShard (other units or dims), RaggedShard <-> ``Shard(0)``: one
  all-to-all over mesh dim ``m`` (``all_to_all_single`` with uneven splits): each rank sends
  the overlaps of its flat range with every rank's target range, in rank order;
* ``Partial("sum")`` -> RaggedShard: one reduce-scatter of the target slices padded to the
  longest;
* RaggedShard -> anything else: one all-gather over ``m`` of the slices padded to the
  longest (the inner tensor, see ``ragged.inner_shape``), then the target's local step;
* Replicate -> RaggedShard: the local slice, no communication.

Everything else goes RaggedShard -> Replicate (the all-gather), then vescale's
redistribution (passed in by :mod:`vescale.dtensor.redistribute`, which calls this module)
between the placements with the RaggedShards as Replicate, then the local
slice of the target's RaggedShard. ``Shard(0)`` takes the all-to-all only when no mesh dim
after ``m`` shards tensor dim 0 (the two layouts then split the same inner tensor).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed._functional_collectives as funcol

from vescale._torch_compat import DTensorSpec
from vescale.dtensor.inflight import wait_local
from vescale.dtensor.layout import chunk_sizes
from vescale.dtensor.placement_types import Partial, Placement, Replicate, Shard, is_private_partial
from vescale.dtensor.ragged import (
    RaggedShard,
    find_ragged,
    inner_shape,
    ragged_local_range,
    replace_ragged,
)

__all__ = ["redistribute_ragged"]

Ranges = Sequence[tuple[int, int]]
Plain = Callable[..., torch.Tensor]


def _spec(spec: DTensorSpec, placements: Sequence[Placement]) -> DTensorSpec:
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)


def _inner(spec: DTensorSpec, mesh_dim: int) -> tuple[int, ...]:
    """This rank's local shape with mesh dim ``mesh_dim`` (and any RaggedShard) Replicate."""
    pl = list(replace_ragged(spec.placements, Replicate()))
    pl[mesh_dim] = Replicate()
    return inner_shape(spec.shape, spec.mesh, pl)


def _ranges(p: Placement, inner: Sequence[int], n: int) -> Ranges | None:
    """Per rank of the mesh dim, ``(offset, numel)`` of ``p``'s flat piece of ``inner``;
    ``None`` when a piece is not one flat range."""
    if isinstance(p, RaggedShard):
        return p.local_ranges(inner)
    if isinstance(p, Shard) and p.dim == 0 and len(inner) > 0:
        row = math.prod(inner[1:])
        sizes = chunk_sizes(inner[0], n)
        starts = [sum(sizes[:i]) for i in range(n)]
        return tuple((s * row, c * row) for s, c in zip(starts, sizes))
    return None


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[0] + a[1], b[0] + b[1]) - max(a[0], b[0]))


def _exchange(
    local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec, mesh_dim: int
) -> torch.Tensor | None:
    """The all-to-all step when only ``mesh_dim`` changes and both pieces are flat ranges
    of the same inner tensor; ``None`` otherwise."""
    s, d = src.placements[mesh_dim], dst.placements[mesh_dim]
    later_dim0 = any(q.is_shard(0) for q in dst.placements[mesh_dim + 1 :])
    if later_dim0 and (isinstance(d, Shard) or isinstance(s, Shard)):
        return None
    mesh, n = src.mesh, src.mesh.size(mesh_dim)
    inner = _inner(src, mesh_dim)
    a, b = _ranges(s, inner, n), _ranges(d, inner, n)
    if a is None or b is None:
        return None
    me = mesh.get_local_rank(mesh_dim)
    send = [_overlap(a[me], b[j]) for j in range(n)]
    recv = [_overlap(a[j], b[me]) for j in range(n)]
    flat = wait_local(local).contiguous().view(-1)
    out = funcol.all_to_all_single(flat, recv, send, (mesh, mesh_dim))
    if isinstance(d, RaggedShard):
        return out
    return out.view(-1, *inner[1:])


def _reduce_scatter(
    local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec, mesh_dim: int
) -> torch.Tensor | None:
    """``Partial("sum") -> RaggedShard`` on ``mesh_dim``: one reduce-scatter of the target
    slices padded to the longest; ``None`` for any other step."""
    s, d = src.placements[mesh_dim], dst.placements[mesh_dim]
    if not (isinstance(s, Partial) and not is_private_partial(s) and s.reduce_op == "sum"):
        return None
    if not isinstance(d, RaggedShard):
        return None
    ranges = d.local_ranges(_inner(src, mesh_dim))
    longest = max(n for _, n in ranges)
    flat = wait_local(local).contiguous().view(-1)
    if len({n for _, n in ranges}) > 1:
        pad = flat.new_zeros(longest)
        flat = torch.cat([t for o, n in ranges for t in (flat[o : o + n], pad[n:])])
    out = funcol.reduce_scatter_tensor(flat, "sum", 0, (src.mesh, mesh_dim))
    return out[: ranges[src.mesh.get_local_rank(mesh_dim)][1]]


def _gather(local: torch.Tensor, spec: DTensorSpec, mesh_dim: int) -> torch.Tensor:
    """The inner tensor from every rank's slice: one all-gather over ``mesh_dim``, of the
    slices padded to the longest."""
    p = spec.placements[mesh_dim]
    assert isinstance(p, RaggedShard)
    inner = _inner(spec, mesh_dim)
    lengths = [n for _, n in p.local_ranges(inner)]
    longest = max(lengths)
    flat = wait_local(local).contiguous().view(-1)
    if flat.numel() < longest:
        flat = torch.cat([flat, flat.new_zeros(longest - flat.numel())])
    out = funcol.all_gather_single(flat, 0, (spec.mesh, mesh_dim))
    if len(set(lengths)) > 1:
        rows = out.view(len(lengths), longest)
        out = torch.cat([rows[i, :n] for i, n in enumerate(lengths)])
    return out.view(inner)


def _slice(local: torch.Tensor, dst: DTensorSpec) -> torch.Tensor:
    """This rank's RaggedShard slice of ``local``, the inner tensor of ``dst``."""
    offset, numel = ragged_local_range(dst.shape, dst.mesh, dst.placements)
    return wait_local(local).reshape(-1).narrow(0, offset, numel)


def redistribute_ragged(
    local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec, *, async_op: bool, plain: Plain
) -> torch.Tensor:
    """The local tensor of ``local`` (laid out as ``src``) laid out as ``dst``, one of them
    with a RaggedShard (see the module doc for the collectives); ``plain(local, src, dst,
    async_op=...)`` redistributes between layouts without one."""
    if src.mesh.device_type == "meta":
        if find_ragged(dst.placements) is not None:
            return local.new_empty(ragged_local_range(dst.shape, dst.mesh, dst.placements)[1])
        whole = local.new_empty(inner_shape(src.shape, src.mesh, src.placements))
        return plain(whole, _spec(src, replace_ragged(src.placements, Replicate())), dst)
    changed = [m for m, (a, b) in enumerate(zip(src.placements, dst.placements)) if a != b]
    if len(changed) == 1:
        out = _exchange(local, src, dst, changed[0])
        if out is None:
            out = _reduce_scatter(local, src, dst, changed[0])
        if out is not None:
            return out if async_op else wait_local(out)
    found = find_ragged(src.placements)
    if found is not None:
        local = _gather(local, src, found[0])
        src = _spec(src, replace_ragged(src.placements, Replicate()))
    mid = _spec(src, replace_ragged(dst.placements, Replicate()))
    local = plain(local, src, mid, async_op=async_op)
    if find_ragged(dst.placements) is not None:
        local = _slice(local, dst)
    return local if async_op else wait_local(local)
