"""Shard sizes on every rank of a mesh (nested ``torch.chunk``), for strategies that must
avoid layouts some kernel cannot take. Decisions use the whole mesh, never the local rank,
so every rank picks the same strategy."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint

from vescale._torch_compat import DTensorSpec, StridedShard
from vescale.dtensor.placement_types import InterleavedShard

__all__ = [
    "chunk_sizes",
    "contiguous_shards",
    "empty_shard_dims",
    "local_range",
    "sharding_mesh_dims",
    "wrap_local",
]


def chunk_sizes(n: int, k: int) -> list[int]:
    """Sizes of ``torch.chunk`` of ``n`` into ``k`` (trailing zeros when it runs out)."""
    c = -(-n // k)
    return [min(c, max(0, n - i * c)) for i in range(k)]


def empty_shard_dims(spec: DTensorSpec) -> list[int]:
    """Tensor dims of which some rank holds an empty shard (the dim itself non-empty)."""
    out = []
    mesh_shape = spec.mesh.shape
    for dim, size in enumerate(spec.shape):
        if not any(p.is_shard(dim) for p in spec.placements):
            continue  # reading no size: a dynamic (symbolic) dim stays unspecialized
        n = optimization_hint(size)  # a sharded dynamic dim: its example size, no guard
        sizes = {n}
        for m, p in enumerate(spec.placements):
            if p.is_shard(dim):
                sizes = {c for s in sizes for c in chunk_sizes(s, mesh_shape[m])}
        if n > 0 and 0 in sizes:
            out.append(dim)
    return out


def contiguous_shards(t: Any) -> bool:
    """Every sharded placement of DTensor ``t`` holds one contiguous chunk per rank (not an
    ``InterleavedShard`` / ``_StridedShard``), so a shard's global offset locates it."""
    return not any(isinstance(p, (StridedShard, InterleavedShard)) for p in t.placements)


def local_range(shape: Any, mesh: Any, placements: Any, dim: int) -> tuple[int, int]:
    """(global start, length) along ``dim`` of this rank's contiguous shard of a tensor of
    global ``shape`` laid out as ``placements`` on ``mesh``.

    Plain integers from the mesh coordinate (upstream's offset helper goes through a
    coordinate tensor, which Dynamo cannot trace without a graph break)."""
    coord = mesh.get_coordinate()
    start, size = 0, int(shape[dim])
    for mesh_dim, p in enumerate(placements):
        if p.is_shard(dim):
            sizes = chunk_sizes(size, mesh.size(mesh_dim))
            start += sum(sizes[: coord[mesh_dim]])
            size = sizes[coord[mesh_dim]]
    return start, size


def wrap_local(local: Any, mesh: Any, placements: Any, shape: Any) -> Any:
    """A handler's local result as a DTensor of global ``shape`` (contiguous strides), with
    no communication (no shape gathering, no run check)."""
    from vescale.dtensor.api import from_local

    stride = torch.empty(tuple(shape), device="meta").stride()
    return from_local(
        local, mesh, list(placements), run_check=False, shape=torch.Size(shape), stride=stride
    )


def sharding_mesh_dims(mesh: Any, placements: Any, dim: int) -> list[int]:
    """Mesh dims (of more than one rank) that shard tensor dim ``dim``."""
    return [i for i, p in enumerate(placements) if p.is_shard(dim) and mesh.size(i) > 1]
