"""Strategies of the CUDA attention kernels (flash, memory-efficient), forward and backward,
checked on a meta mesh: no GPU, no process group. Batch (``Shard(0)``) and head
(``Shard(1)``) sharding, alone and combined on a 2-D mesh, need no redistribution (explicit
mode on: any would raise), and every output and gradient has the sharded local shape."""

from __future__ import annotations

import pytest
import torch

import vescale
from vescale import Replicate, Shard

aten = torch.ops.aten
B, H, L, E = 4, 8, 16, 64


def _flash(q, k, v):
    return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[:2]  # out, logsumexp


def _efficient(q, k, v):
    return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[:2]


LAYOUTS = [
    ((4,), [Replicate()]),
    ((4,), [Shard(0)]),
    ((4,), [Shard(1)]),
    ((2, 2), [Shard(0), Shard(1)]),
    ((2, 2), [Shard(1), Shard(0)]),
    ((2, 2), [Shard(1), Shard(1)]),
]


def _local(shape, mesh_shape, placements):
    out = list(shape)
    for size, p in zip(mesh_shape, placements):
        if p.is_shard():
            out[p.dim] //= size
    return torch.Size(out)


@pytest.mark.parametrize("kernel", [_flash, _efficient], ids=["flash", "efficient"])
@pytest.mark.parametrize("mesh_shape,placements", LAYOUTS, ids=str)
def test_cuda_attention_strategy_on_meta_mesh(kernel, mesh_shape, placements):
    mesh = vescale.DeviceMesh("meta", torch.arange(4).reshape(mesh_shape))
    qkv = [
        vescale.distribute_tensor(
            torch.empty(B, H, L, E, device="meta", dtype=torch.bfloat16), mesh, placements
        ).requires_grad_(True)
        for _ in range(3)
    ]
    with vescale.dtensor.explicit_redistribute(True):
        out, lse = kernel(*qkv)
        grad = vescale.distribute_tensor(
            torch.empty(B, H, L, E, device="meta", dtype=torch.bfloat16), mesh, placements
        )
        out.backward(grad)
    assert out.placements == tuple(placements) and lse.placements == tuple(placements)
    assert out._local_tensor.shape == _local((B, H, L, E), mesh_shape, placements)
    assert lse._local_tensor.shape[:2] == _local((B, H), mesh_shape, placements)
    for t in qkv:
        assert t.grad.placements == tuple(placements)
        assert t.grad._local_tensor.shape == _local((B, H, L, E), mesh_shape, placements)
