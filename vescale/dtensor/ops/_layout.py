"""Shard sizes on every rank of a mesh (nested ``torch.chunk``), for strategies that must
avoid layouts some kernel cannot take. Decisions use the whole mesh, never the local rank,
so every rank picks the same strategy."""

from __future__ import annotations

from vescale.dtensor._torch_compat import DTensorSpec

__all__ = ["chunk_sizes", "empty_shard_dims"]


def chunk_sizes(n: int, k: int) -> list[int]:
    """Sizes of ``torch.chunk`` of ``n`` into ``k`` (trailing zeros when it runs out)."""
    c = -(-n // k)
    return [min(c, max(0, n - i * c)) for i in range(k)]


def empty_shard_dims(spec: DTensorSpec) -> list[int]:
    """Tensor dims of which some rank holds an empty shard (the dim itself non-empty)."""
    out = []
    mesh_shape = spec.mesh.shape
    for dim, n in enumerate(spec.shape):
        sizes = {n}
        for m, p in enumerate(spec.placements):
            if p.is_shard(dim):
                sizes = {c for s in sizes for c in chunk_sizes(s, mesh_shape[m])}
        if n > 0 and 0 in sizes:
            out.append(dim)
    return out
