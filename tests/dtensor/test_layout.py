"""``vescale.dtensor.layout`` against torch: ``torch.chunk`` nested over mesh dims, upstream's
``compute_local_shape_and_global_offset`` on every rank, and ``torch.empty``'s strides; even,
uneven and empty shards. Single process (meta meshes, a fake process group)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor.placement_types import Placement

import vescale
from tests.harness import fake_world
from vescale import InterleavedShard, Partial, Replicate, Shard
from vescale._torch_compat import (
    DTensorSpec,
    StridedShard,
    TensorMeta,
    compute_local_shape_and_global_offset,
)
from vescale.dtensor.layout import (
    chunk_sizes,
    contiguous_shards,
    contiguous_strides,
    dense_strides,
    empty_shard_dims,
    interleave_factor,
    local_indices,
    local_range,
)
from vescale.dtensor.placement_types import check_interleaved

SHAPES = [(6, 4), (7, 5), (1, 3), (0, 3), (2, 9)]  # even, uneven, a shard empty, a dim empty
PLACEMENTS_1D: list[tuple[Placement, ...]] = [(Shard(0),), (Shard(1),), (Replicate(),)]
PLACEMENTS_2D: list[tuple[Placement, ...]] = [
    (Shard(0), Shard(1)),
    (Shard(0), Shard(0)),  # one dim split twice: chunks of chunks
    (Shard(1), Shard(1)),
    (Replicate(), Shard(0)),
    (Partial(), Shard(1)),
]
MESHES = {(3,): PLACEMENTS_1D, (2, 2): PLACEMENTS_2D, (2, 3): PLACEMENTS_2D}


def _reference_shard(full: torch.Tensor, mesh_shape, placements, coord) -> torch.Tensor:
    """This coordinate's shard by ``torch.chunk``, mesh dim by mesh dim (chunk ``c`` empty
    where ``torch.chunk`` returns fewer than ``n`` chunks)."""
    t = full
    for n, p, c in zip(mesh_shape, placements, coord):
        if not isinstance(p, Shard | StridedShard):  # a _StridedShard is no Shard in torch 2.13
            continue
        k = interleave_factor(p)
        if k is None:
            chunks = t.chunk(n, p.dim)
            t = chunks[c] if c < len(chunks) else t.narrow(p.dim, 0, 0)
        else:
            grouped = t.unflatten(p.dim, (k, -1))
            chunks = grouped.chunk(n, p.dim + 1)
            part = chunks[c] if c < len(chunks) else grouped.narrow(p.dim + 1, 0, 0)
            t = part.flatten(p.dim, p.dim + 1)
    return t


def _cases():
    for mesh_shape, placements in MESHES.items():
        for shape, pl in itertools.product(SHAPES, placements):
            for coord in itertools.product(*(range(n) for n in mesh_shape)):
                yield mesh_shape, shape, pl, coord


def test_chunk_sizes_are_torch_chunk():
    for total, n in itertools.product(range(14), range(1, 6)):
        chunks = [c.numel() for c in torch.arange(total).chunk(n)]
        assert chunk_sizes(total, n) == chunks + [0] * (n - len(chunks)), (total, n)


def test_local_indices_and_ranges_are_nested_torch_chunk():
    for mesh_shape, shape, pl, coord in _cases():
        mesh = vescale.init_device_mesh("meta", mesh_shape)
        full = torch.arange(torch.Size(shape).numel()).reshape(shape)
        want = _reference_shard(full, mesh_shape, pl, coord)
        idx = local_indices(shape, mesh, pl, coord)
        got = full[torch.meshgrid(*idx, indexing="ij")]
        assert torch.equal(got, want), (mesh_shape, shape, pl, coord)
        for dim in range(len(shape)):
            start, length = local_range(shape, mesh, pl, dim, coord)
            assert length == want.shape[dim], (mesh_shape, shape, pl, coord, dim)
            if length:
                assert start == int(idx[dim][0]), (mesh_shape, shape, pl, coord, dim)


@pytest.mark.parametrize("mesh_shape", [(3,), (2, 3)])
def test_local_range_matches_upstream_offsets_on_every_rank(mesh_shape):
    world = 1
    for n in mesh_shape:
        world *= n
    for rank in range(world):
        with fake_world(world, rank=rank):
            mesh = vescale.init_device_mesh("cpu", mesh_shape)
            coord = mesh.get_coordinate()
            for shape, pl in itertools.product(SHAPES, MESHES[mesh_shape]):
                local, offset = compute_local_shape_and_global_offset(shape, mesh, pl)
                for dim in range(len(shape)):
                    start, length = local_range(shape, mesh, pl, dim)
                    assert length == local[dim], (mesh_shape, rank, shape, pl, dim)
                    if length:
                        assert start == offset[dim], (mesh_shape, rank, shape, pl, dim)
                assert local_range(shape, mesh, pl, 0) == local_range(shape, mesh, pl, 0, coord)


@pytest.mark.parametrize("k", [2, 3])
def test_interleaved_indices_are_chunks_of_each_group(k):
    shape = (k * 4, 3)
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    mesh = vescale.init_device_mesh("meta", (2, 2))
    for pl in [(InterleavedShard(0, k), Shard(1)), (StridedShard(0, split_factor=k), Shard(0))]:
        assert not contiguous_shards(pl) and interleave_factor(pl[0]) == k
        for coord in itertools.product(range(2), range(2)):
            want = _reference_shard(full, (2, 2), pl, coord)
            idx = local_indices(shape, mesh, pl, coord)
            assert torch.equal(full[torch.meshgrid(*idx, indexing="ij")], want), (pl, coord)
    assert contiguous_shards((Shard(0), Replicate()))
    with pytest.raises(ValueError, match=r"InterleavedShard.*size 6.*interleaved_size 4"):
        check_interleaved((6, 3), mesh, (InterleavedShard(0, 4), Replicate()), what="op")


def test_empty_shard_dims_agree_with_every_coordinate():
    for mesh_shape, placements in MESHES.items():
        mesh = vescale.init_device_mesh("meta", mesh_shape)
        for shape, pl in itertools.product(SHAPES, placements):
            empty = set()
            for coord in itertools.product(*(range(n) for n in mesh_shape)):
                for dim in range(len(shape)):
                    if shape[dim] and local_range(shape, mesh, pl, dim, coord)[1] == 0:
                        empty.add(dim)
            meta = TensorMeta(torch.Size(shape), contiguous_strides(shape), torch.float32)
            spec = DTensorSpec(mesh, pl, tensor_meta=meta)
            assert empty_shard_dims(spec) == sorted(empty), (mesh_shape, shape, pl)
    mesh = vescale.init_device_mesh("meta", (2, 3))
    meta = TensorMeta(torch.Size((2, 9)), (9, 1), torch.float32)
    spec = DTensorSpec(mesh, (Shard(0), Shard(0)), tensor_meta=meta)
    assert empty_shard_dims(spec) == [0]  # 2 rows over 6 ranks


def test_strides_are_torch_empty_strides():
    for shape in [(), (5,), (2, 3, 4), (2, 0, 3), (0,), (1, 1, 7)]:
        assert contiguous_strides(shape) == torch.empty(shape).stride(), shape
    for shape, perm in [((2, 3, 4), (2, 0, 1)), ((4, 1, 5), (1, 2, 0)), ((3, 2, 2), (0, 2, 1))]:
        like = torch.empty([shape[d] for d in perm]).permute(*torch.argsort(torch.tensor(perm)))
        assert like.shape == shape
        bigger = tuple(s + 1 for s in shape)
        want = torch.empty([bigger[d] for d in perm]).permute(*torch.argsort(torch.tensor(perm)))
        assert dense_strides(bigger, like) == want.stride(), (shape, perm)
