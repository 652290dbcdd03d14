"""Independent single-device references for DTensor layouts (plain torch.chunk, no upstream)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist

import vescale
from vescale import DTensor, Partial, Placement, Replicate, Shard


@functools.cache
def mesh_of(shape: tuple[int, ...]) -> vescale.DeviceMesh:
    """One cached CPU mesh per shape, so process groups are created once per worker."""
    return vescale.init_device_mesh("cpu", shape)


def coord_of(mesh_shape: Sequence[int], rank: int | None = None) -> tuple[int, ...]:
    rank = dist.get_rank() if rank is None else rank
    out = []
    for size in reversed(mesh_shape):
        out.append(rank % size)
        rank //= size
    return tuple(reversed(out))


def expected_local(
    full: torch.Tensor,
    mesh_shape: Sequence[int],
    coord: Sequence[int],
    placements: Sequence[Placement],
) -> torch.Tensor:
    """Rank ``coord``'s local tensor: nested ``torch.chunk`` for Shard (mesh dims in order,
    empty past the last chunk), the value on coordinate 0 and identity elements elsewhere
    for Partial, the value itself for Replicate."""
    t = full
    for mesh_dim, p in enumerate(placements):
        c = coord[mesh_dim]
        if isinstance(p, Shard):
            chunks = torch.chunk(t, mesh_shape[mesh_dim], dim=p.dim)
            t = chunks[c] if c < len(chunks) else t.narrow(p.dim, 0, 0)
        elif isinstance(p, Partial) and c != 0:
            if p.reduce_op == "sum":
                t = torch.zeros_like(t)
            elif p.reduce_op == "product":
                t = torch.ones_like(t)
    return t


def local_dtensor(
    full: torch.Tensor, mesh_shape: tuple[int, ...], placements: Sequence[Placement]
) -> DTensor:
    """The DTensor ``distribute_tensor(full, mesh_of(mesh_shape), placements)`` returns,
    built without communication: this rank's :func:`expected_local` shard (a copy), the
    global shape and stride given."""
    local = expected_local(full, mesh_shape, coord_of(mesh_shape), placements).clone()
    mesh = mesh_of(mesh_shape)
    return vescale.from_local(
        local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )


def compared(out: DTensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(got, want)`` to compare for ``out == full``: this rank's shard and its
    :func:`expected_local` (no communication) for Shard/Replicate layouts, else
    ``out.full_tensor()`` and ``full``. Every rank must call it (the fallback communicates);
    raises if the global shapes differ."""
    if out.shape != full.shape:
        raise AssertionError(f"global shape {tuple(out.shape)}, expected {tuple(full.shape)}")
    if any(type(p) not in (Shard, Replicate) for p in out.placements):
        return out.full_tensor(), full
    mesh = out.device_mesh
    want = expected_local(full, tuple(mesh.shape), mesh.get_coordinate(), out.placements)
    return out.to_local(async_output=False), want


def equals_full(out: DTensor, full: torch.Tensor) -> bool:
    """Whether ``out`` is exactly ``full`` (compared as :func:`compared` says)."""
    return out.shape == full.shape and torch.equal(*compared(out, full))


def partial_source(
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    shape: Sequence[int],
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A global tensor and this rank's local shard, with genuinely different partial pieces.

    Each combination of coordinates on the Partial mesh dims gets its own random piece and
    the global value is their reduction (sum or max), so reductions are really exercised.
    Every rank draws the same pieces (same seed), so the global value is known everywhere.
    """
    partial_dims = [i for i, p in enumerate(placements) if isinstance(p, Partial)]
    keys = list(itertools.product(*(range(mesh_shape[i]) for i in partial_dims)))
    pieces = {k: torch.randn(*shape, dtype=dtype) for k in keys}
    ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
    stacked = torch.stack(list(pieces.values()))
    full = stacked.amax(0) if ops == {"max"} else stacked.sum(0)
    coord = coord_of(mesh_shape)
    piece = pieces[tuple(coord[i] for i in partial_dims)]
    shard_only = [p if isinstance(p, Shard) else Replicate() for p in placements]
    return full, expected_local(piece, mesh_shape, coord, shard_only)


def layout_pairs(
    choices: Sequence[Placement], ndim: int, *, full: bool
) -> list[tuple[tuple[Placement, ...], tuple[Placement, ...]]]:
    """(src, dst) layout pairs over ``choices`` on an ``ndim``-D mesh: the full product, or,
    on a 2-D mesh with ``full=False``, a strength-3 covering array of the four factors
    (src[0], src[1], dst[0], dst[1]): every combination of choices of any three of them
    occurs exactly once (n**3 pairs; dst[1] is choice (a + b + c) mod n). So each mesh
    dim's transition meets every placement of the other mesh dim, as source and as
    destination."""
    if full or ndim != 2:
        layouts = list(itertools.product(choices, repeat=ndim))
        return list(itertools.product(layouts, layouts))
    n = len(choices)
    return [
        ((choices[a], choices[b]), (choices[c], choices[(a + b + c) % n]))
        for a, b, c in itertools.product(range(n), repeat=3)
    ]
