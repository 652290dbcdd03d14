"""CPU scaled_dot_product_attention on DTensors: batch/head sharding and Partial v need no
communication, forward and backward, and match single-device attention (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

import vescale
from tests.dtensor.reference import mesh_of
from vescale import Partial, Replicate, Shard

B, H, T, E = 4, 4, 6, 8

# (mesh shape, q/k placements, v placements, output placements)
CASES = [
    ((4,), (Shard(0),), (Shard(0),), (Shard(0),)),
    ((4,), (Shard(1),), (Shard(1),), (Shard(1),)),
    ((4,), (Replicate(),), (Replicate(),), (Replicate(),)),
    ((4,), (Replicate(),), (Partial(),), (Partial(),)),
    ((2, 2), (Shard(0), Shard(1)), (Shard(0), Shard(1)), (Shard(0), Shard(1))),
    ((2, 2), (Shard(1), Shard(0)), (Shard(1), Shard(0)), (Shard(1), Shard(0))),
    ((2, 2), (Shard(0), Replicate()), (Shard(0), Partial()), (Shard(0), Partial())),
]
MASKS = ["none", "causal", "broadcast", "per-head"]


def _mask(kind):
    g = torch.Generator().manual_seed(7)
    if kind == "broadcast":  # (T, T): replicated whatever the q/k/v layout
        return torch.rand(T, T, generator=g) > 0.3
    if kind == "per-head":  # (B, H, T, T): sharded like q/k/v
        return torch.randn(B, H, T, T, generator=g, dtype=torch.float64)
    return None


def _check_sdpa(mesh_shape, qk_pl, v_pl, out_pl, mask_kind):
    mesh = mesh_of(mesh_shape)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, E, generator=g, dtype=torch.float64) for _ in range(3))
    grad = torch.randn(B, H, T, E, generator=g, dtype=torch.float64)
    mask = _mask(mask_kind)
    causal = mask_kind == "causal"
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask, is_causal=causal)
    ref.backward(grad)

    dq, dk = (vescale.distribute_tensor(t, mesh, qk_pl).requires_grad_(True) for t in (q, k))
    dv = vescale.distribute_tensor(v, mesh, v_pl).requires_grad_(True)
    dmask = None
    if mask is not None:
        mask_pl = [p if mask.ndim == 4 and isinstance(p, Shard) else Replicate() for p in qk_pl]
        dmask = vescale.distribute_tensor(mask, mesh, mask_pl)
    dgrad = vescale.distribute_tensor(
        grad, mesh, [Replicate() if p.is_partial() else p for p in out_pl]
    )
    with CommDebugMode() as comm:
        out = F.scaled_dot_product_attention(dq, dk, dv, attn_mask=dmask, is_causal=causal)
        assert tuple(out.placements) == out_pl, out.placements
        if not any(p.is_partial() for p in v_pl):
            out.backward(dgrad)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    torch.testing.assert_close(out.full_tensor(), ref.detach(), rtol=1e-10, atol=1e-10)
    if not any(p.is_partial() for p in v_pl):
        for d, r in zip((dq, dk, dv), ref_in):
            assert tuple(d.grad.placements) == tuple(d.placements)
            torch.testing.assert_close(d.grad.full_tensor(), r.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mask_kind", MASKS)
def test_sdpa_without_communication(pool4, mask_kind):
    for case in CASES:
        if mask_kind == "per-head" and any(p.is_partial() for p in case[2]):
            continue  # Partial v needs q/k replicated; the per-head mask case covers sharding
        pool4.run(_check_sdpa, *case, mask_kind)


def _check_sdpa_explicit_error():
    mesh = mesh_of((4,))
    q = vescale.distribute_tensor(torch.randn(B, H, T, E), mesh, [Shard(2)])  # sequence-sharded
    with pytest.raises(RuntimeError, match="_scaled_dot_product_flash_attention_for_cpu"):
        F.scaled_dot_product_attention(q, q, q)


def test_sdpa_sequence_sharded_needs_explicit_redistribute(pool4):
    pool4.run(_check_sdpa_explicit_error)
