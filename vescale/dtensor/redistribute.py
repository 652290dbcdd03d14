"""Redistribution beyond upstream's planner: any placement -> ``Partial``, and
``InterleavedShard`` (``_StridedShard`` in specs) on meshes of more than one dim.

Upstream moves between Shard / Replicate / Partial -> (Shard | Replicate) with uneven
shards, and between those and ``_StridedShard`` on a 1-D mesh. We add every step that
*targets* a Partial: the tensor is first brought to Replicate on that mesh dim (upstream),
then partitioned locally with no communication: ``sum`` keeps the value on coordinate 0 and
zeros elsewhere (exact for integers), ``product`` ones elsewhere, ``avg``/``max``/``min``
keep the value on every coordinate. A ``_StridedShard`` on a multi-dim mesh goes one mesh
dim at a time (upstream's multi-dim planner mis-orders those): from the first mesh dim that
changes, every later one is brought to Replicate innermost first, then laid out as the target
outermost first, each step a one-mesh-dim redistribution of the tensor as that mesh dim sees it.

A reduction over several mesh dims at once (``(Partial, Partial) -> (Replicate, Replicate)``,
``(Partial, Partial) -> (Shard(d), Shard(d))``) is one collective over the flattened group of
those dims: :func:`vescale.dtensor.flat_groups.flattened_mesh` creates upstream's flattened
mesh (``DeviceMesh._flatten``) on first use and upstream's planner merges the per-dim steps
into one collective on it. One reduction in one order gives every rank the same bits (two
sequential ones need not).

In eager, each redistribution that communicates is a profiler range named as upstream's
ranges are, ``vescale::redistribute S(0)->R`` (one placement per mesh dim, comma-separated).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from vescale._torch_compat import (
    DTensorSpec,
    StridedShard,
    TensorMeta,
    are_we_tracing,
    compute_local_shape_and_global_offset,
    maybe_run_for_local_tensor,
    upstream_redistribute_local_tensor,
)
from vescale.dtensor.flat_groups import flattened_mesh
from vescale.dtensor.layout import chunk_sizes, contiguous_strides
from vescale.dtensor.placement_types import Partial, Placement, Replicate
from vescale.dtensor.ragged import find_ragged
from vescale.dtensor.ragged_redistribute import redistribute_ragged

__all__ = [
    "meta_shard",
    "moves_nothing",
    "redistribute_local_tensor",
    "replicate_to_partial",
    "strided_communicates",
]


def _flatten_reductions(src: DTensorSpec, mid: Sequence[Placement]) -> None:
    """Flattened meshes for the mesh dims that ``src -> mid`` reduces to the same placement
    (``Partial("sum" | "avg")`` sources, which upstream merges)."""
    by_target: dict[Placement, list[int]] = {}
    for mesh_dim, (s, m) in enumerate(zip(src.placements, mid)):
        if isinstance(s, Partial) and not m.is_partial() and s.reduce_op in ("sum", "avg"):
            by_target.setdefault(m, []).append(mesh_dim)
    for dims in by_target.values():
        flattened_mesh(src.mesh, dims)


@maybe_run_for_local_tensor  # rank-dependent: run per simulated rank under LocalTensorMode
def replicate_to_partial(
    local: torch.Tensor, reduce_op: str, coordinate: int | torch.SymInt
) -> torch.Tensor:
    """Local partition of a replicated value so that ``reduce_op`` over ranks restores it.
    The same ops on every rank (a ``where`` on the coordinate): ``zeros_like`` off coordinate
    0 would drop ``local``'s producer from a compiled graph there, collectives included."""
    if reduce_op in ("avg", "max", "min"):
        return local
    if reduce_op not in ("sum", "product"):
        raise ValueError(f"Replicate -> Partial({reduce_op}) is not supported")
    keep = torch.full((), coordinate == 0, dtype=torch.bool, device=local.device)
    return torch.where(keep, local, 0 if reduce_op == "sum" else 1)


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
    if src.placements == dst.placements or moves_nothing(src, dst):
        return local
    if are_we_tracing() or torch.compiler.is_compiling():
        return _redistribute(local, src, dst, async_op)
    with torch.profiler.record_function(range_name(src.placements, dst.placements)):
        return _redistribute(local, src, dst, async_op)


@functools.lru_cache(maxsize=1024)
def range_name(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> str:
    """The profiler range of ``src -> dst``: ``vescale::redistribute S(0),R->R,R``."""
    return f"vescale::redistribute {','.join(map(str, src))}->{','.join(map(str, dst))}"


def _redistribute(
    local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec, async_op: bool
) -> torch.Tensor:
    if find_ragged(src.placements) is not None or find_ragged(dst.placements) is not None:
        return redistribute_ragged(
            local, src, dst, async_op=async_op, plain=redistribute_local_tensor
        )
    if src.mesh.device_type == "meta":
        return meta_shard(local, src.shape, dst)
    if _has_strided(src, dst) and src.mesh.ndim > 1:
        return _by_mesh_dim(local, src, dst, async_op)
    return _direct(local, src, dst, async_op)


def moves_nothing(src: DTensorSpec, dst: DTensorSpec) -> bool:
    """Whether ``src -> dst`` leaves every local shard as it is: each placement that changes
    is on a mesh dim of one rank (where every layout is the whole tensor; not a
    ``RaggedShard``, whose local tensor is a flat slice)."""
    return _moves_nothing(src.placements, dst.placements, tuple(src.mesh.shape))


@functools.lru_cache(maxsize=1024)
def _moves_nothing(
    src: tuple[Placement, ...], dst: tuple[Placement, ...], mesh_shape: tuple[int, ...]
) -> bool:
    if find_ragged(src) is not None or find_ragged(dst) is not None:
        return False
    return all(s == d or n == 1 for s, d, n in zip(src, dst, mesh_shape))


def meta_shard(local: torch.Tensor, shape: torch.Size, dst: DTensorSpec) -> torch.Tensor:
    """On a meta mesh (shape-only planning): this rank's shard of a global ``shape`` laid
    out as ``dst``, an empty tensor like ``local``; nothing is communicated."""
    local_shape, _ = compute_local_shape_and_global_offset(
        shape, dst.mesh, dst.placements, skip_offset=True
    )
    return local.new_empty(local_shape)


def _direct(
    local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec, async_op: bool
) -> torch.Tensor:
    """Upstream's planner to Replicate on the mesh dims that target a Partial, then the local
    partition (a lone strided shard leaving its layout: gathered by :func:`strided_gather`
    first)."""
    sharded = [m for m, p in enumerate(src.placements) if not p.is_replicate()]
    if len(sharded) == 1:
        lone = src.placements[sharded[0]]
        if isinstance(lone, StridedShard) and lone != dst.placements[sharded[0]]:
            local = strided_gather(local, lone, src.mesh, sharded[0], src.shape)
            src = DTensorSpec(src.mesh, (Replicate(),) * src.mesh.ndim, tensor_meta=src.tensor_meta)
            if src.placements == dst.placements:
                return local
    mid: tuple[Placement, ...] = tuple(
        Replicate() if d.is_partial() and s != d else d
        for s, d in zip(src.placements, dst.placements)
    )
    if mid != src.placements:
        _flatten_reductions(src, mid)
        mid_spec = DTensorSpec(src.mesh, mid, tensor_meta=src.tensor_meta)
        local = upstream_redistribute_local_tensor(
            local, src, mid_spec, async_op=async_op, is_explicit=True
        )
    for mesh_dim, (m, d) in enumerate(zip(mid, dst.placements)):
        if m != d:
            assert isinstance(d, Partial)
            local = replicate_to_partial(local, d.reduce_op, src.mesh._sym_get_coordinate(mesh_dim))
    return local


def strided_gather(
    local: torch.Tensor, p: StridedShard, mesh: DeviceMesh, mesh_dim: int, shape: Sequence[int]
) -> torch.Tensor:
    """``_StridedShard(d, split_factor=k) -> Replicate`` on mesh dim ``mesh_dim`` (``n``
    ranks) of a tensor of ``shape``: dim ``d`` is ``torch.chunk``-ed into ``k`` chunks and each
    of them into ``n`` pieces, coordinate ``r`` holding piece ``r`` of every chunk. One
    all-gather of the pieces (padded to the longest), then the pieces in global order. Every
    size is a Python int, so it traces on fake tensors (upstream reads the offsets out of a
    tensor, which fails there)."""
    n, k, d = mesh.size(mesh_dim), int(p.split_factor), p.dim
    pieces = [chunk_sizes(c, n) for c in chunk_sizes(shape[d], k)]  # [chunk][coordinate]
    width = max(sum(piece[r] for piece in pieces) for r in range(n))
    pad = [0, 0] * (local.ndim - 1 - d) + [0, width - local.size(d)]
    padded = torch.nn.functional.pad(local, pad)
    gathered = funcol.all_gather_single(padded.contiguous(), d, (mesh, mesh_dim))
    parts = []
    for c, piece in enumerate(pieces):
        for r in range(n):
            start = r * width + sum(q[r] for q in pieces[:c])
            parts.append(gathered.narrow(d, start, piece[r]))
    return torch.cat(parts, dim=d)


def _has_strided(src: DTensorSpec, dst: DTensorSpec) -> bool:
    return any(isinstance(p, StridedShard) for p in (*src.placements, *dst.placements))


def _mesh_dim_steps(
    src: Sequence[Placement], dst: Sequence[Placement]
) -> list[tuple[int, Placement]]:
    """The (mesh dim, placement) steps of ``src -> dst`` one mesh dim at a time (module
    docstring); on a 1-D mesh the one step."""
    if len(src) == 1:
        return [(0, dst[0])]
    first = next(m for m, (s, d) in enumerate(zip(src, dst)) if s != d)
    steps: list[tuple[int, Placement]] = [
        (m, Replicate()) for m in reversed(range(first, len(src)))
    ]
    return steps + [(m, dst[m]) for m in range(first, len(src))]


def strided_communicates(src: DTensorSpec, dst: DTensorSpec) -> bool:
    """Whether ``src -> dst``, an interleaved (strided) shard involved, moves data between
    ranks: some step changes a placement other than ``Replicate`` on a mesh dim of more than
    one rank (upstream's ``redistribute_cost`` prices ``_StridedShard`` steps at 0).
    ``False`` when no strided shard is involved."""
    return _strided_communicates(src.placements, dst.placements, tuple(src.mesh.shape))


@functools.lru_cache(maxsize=1024)
def _strided_communicates(
    src: tuple[Placement, ...], dst: tuple[Placement, ...], mesh_shape: tuple[int, ...]
) -> bool:
    if src == dst or not any(isinstance(p, StridedShard) for p in (*src, *dst)):
        return False
    cur = list(src)
    for m, target in _mesh_dim_steps(src, dst):
        if cur[m] != target and not cur[m].is_replicate() and mesh_shape[m] > 1:
            return True
        cur[m] = target
    return False


def _by_mesh_dim(
    local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec, async_op: bool
) -> torch.Tensor:
    """``src -> dst`` one mesh dim at a time (see the module docstring)."""
    cur = list(src.placements)
    for m, target in _mesh_dim_steps(src.placements, dst.placements):
        if cur[m] != target:
            local = _one_mesh_dim(local, src, cur, m, target, async_op)
            cur[m] = target
    return local


def _one_mesh_dim(
    local: torch.Tensor,
    spec: DTensorSpec,
    cur: list[Placement],
    mesh_dim: int,
    target: Placement,
    async_op: bool,
) -> torch.Tensor:
    """Mesh dim ``mesh_dim`` of ``local`` from ``cur[mesh_dim]`` to ``target``, the tensor
    taken as the shard the earlier mesh dims ``cur[:mesh_dim]`` leave on this rank."""
    mesh, ndim = spec.mesh, spec.mesh.ndim
    replicated: list[Placement] = [Replicate()] * ndim
    outer = (*cur[:mesh_dim], *replicated[mesh_dim:])
    shape, _ = compute_local_shape_and_global_offset(spec.shape, mesh, outer, skip_offset=True)
    dtype = spec.tensor_meta.dtype  # type: ignore[union-attr]
    meta = TensorMeta(torch.Size(shape), contiguous_strides(shape), dtype)
    only = replicated.copy()
    only[mesh_dim] = cur[mesh_dim]
    a = DTensorSpec(mesh, tuple(only), tensor_meta=meta)
    only[mesh_dim] = target
    b = DTensorSpec(mesh, tuple(only), tensor_meta=meta)
    return _direct(local, a, b, async_op)
