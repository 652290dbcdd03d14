"""CPU scaled_dot_product_attention on DTensors: batch/head sharding and Partial v need no
communication, forward and backward, and match single-device attention (float64); so does
the math path (``SDPBackend.MATH``) with ``is_causal``, DTensor masks and dropout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode
from torch.nn.attention import SDPBackend, sdpa_kernel

import vescale
from tests.dtensor.reference import compared, local_dtensor, mesh_of
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
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, E, generator=g, dtype=torch.float64) for _ in range(3))
    grad = torch.randn(B, H, T, E, generator=g, dtype=torch.float64)
    mask = _mask(mask_kind)
    causal = mask_kind == "causal"
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask, is_causal=causal)
    ref.backward(grad)

    dq, dk = (local_dtensor(t, mesh_shape, qk_pl).requires_grad_(True) for t in (q, k))
    dv = local_dtensor(v, mesh_shape, v_pl).requires_grad_(True)
    dmask = None
    if mask is not None:
        mask_pl = [p if mask.ndim == 4 and isinstance(p, Shard) else Replicate() for p in qk_pl]
        dmask = local_dtensor(mask, mesh_shape, mask_pl)
    dgrad = local_dtensor(grad, mesh_shape, [Replicate() if p.is_partial() else p for p in out_pl])
    with CommDebugMode() as comm:
        out = F.scaled_dot_product_attention(dq, dk, dv, attn_mask=dmask, is_causal=causal)
        assert tuple(out.placements) == out_pl, out.placements
        if not any(p.is_partial() for p in v_pl):
            out.backward(dgrad)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    torch.testing.assert_close(*compared(out, ref.detach()), rtol=1e-10, atol=1e-10)
    if not any(p.is_partial() for p in v_pl):
        for d, r in zip((dq, dk, dv), ref_in):
            assert tuple(d.grad.placements) == tuple(d.placements)
            torch.testing.assert_close(*compared(d.grad, r.grad), rtol=1e-10, atol=1e-10)


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


# The math path (sdpa_kernel(SDPBackend.MATH)): a CompositeImplicitAutograd decomposition
# whose causal mask upstream builds as a plain tensor (issue 16).
MB, MH, ML, ME = 2, 4, 6, 8
MATH_MASKS = ["causal", "bool", "float", "bool-broadcast", "float-broadcast"]


def _math_mask(kind, g):
    if kind.startswith("bool"):
        shape = (ML, ML) if kind.endswith("broadcast") else (MB, MH, ML, ML)
        m = torch.rand(*shape, generator=g) > 0.4
        return m | torch.eye(ML, dtype=torch.bool)  # no fully masked row (NaN on one device)
    if kind.startswith("float"):
        shape = (ML, ML) if kind.endswith("broadcast") else (MB, MH, ML, ML)
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    return None


def _check_sdpa_math(placement, kind, dropout_p):
    """Math SDPA forward and backward on 2 ranks equal one device (float64, same seed for
    dropout), with no collective for batch- and head-sharded or replicated inputs."""
    g = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(MB, MH, ML, ME, generator=g, dtype=torch.float64) for _ in "qkvg")
    mask = _math_mask(kind, g)
    causal = kind == "causal"
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    torch.manual_seed(11)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(
            *ref_in, attn_mask=mask, dropout_p=dropout_p, is_causal=causal
        )
    ref.backward(grad)
    d_in = [local_dtensor(t, (2,), [placement]).requires_grad_(True) for t in (q, k, v)]
    dmask = None
    if mask is not None:
        mask_pl = placement if mask.ndim == 4 else Replicate()
        dmask = local_dtensor(mask, (2,), [mask_pl])
    dgrad = local_dtensor(grad, (2,), [placement])
    torch.manual_seed(11)
    with CommDebugMode() as comm, sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(
            *d_in, attn_mask=dmask, dropout_p=dropout_p, is_causal=causal
        )
        out.backward(dgrad)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    assert tuple(out.placements) == (placement,), out.placements
    torch.testing.assert_close(*compared(out, ref.detach()), rtol=1e-10, atol=1e-10)
    for d, r in zip(d_in, ref_in):
        assert tuple(d.grad.placements) == (placement,)
        torch.testing.assert_close(*compared(d.grad, r.grad), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", MATH_MASKS)
def test_sdpa_math_path_equals_one_device(pool2, kind):
    for placement in (Replicate(), Shard(0), Shard(1)):
        pool2.run(_check_sdpa_math, placement, kind, 0.0)


def test_sdpa_math_path_dropout_equals_one_device(pool2):
    """Dropout on the math path draws each rank's part of the single-device mask (the RNG
    promise of vescale.dtensor.random): same seed, same values."""
    for placement in (Replicate(), Shard(0), Shard(1)):
        pool2.run(_check_sdpa_math, placement, "causal", 0.3)


def _check_sdpa_math_no_grad_and_plain_mask():
    mesh = mesh_of((2,))
    g = torch.Generator().manual_seed(5)
    q = torch.randn(MB, MH, ML, ME, generator=g, dtype=torch.float64)
    dq = vescale.distribute_tensor(q, mesh, [Shard(1)])
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        with torch.no_grad():
            out = F.scaled_dot_product_attention(dq, dq, dq, is_causal=True)
        torch.testing.assert_close(out.full_tensor(), ref, rtol=1e-10, atol=1e-10)
        plain = torch.rand(ML, ML, generator=g) > 0.5
        with pytest.raises(RuntimeError, match=r"attn_mask of shape \(6, 6\) is a torch.Tensor"):
            F.scaled_dot_product_attention(dq, dq, dq, attn_mask=plain)
        try:
            F.scaled_dot_product_attention(dq, dq, dq, attn_mask=plain.double())
        except RuntimeError as e:
            assert "_scaled_dot_product_attention_math" in str(e)
            assert "query (Shard(dim=1),)" in str(e) and "DeviceMesh" in str(e)
        else:
            raise AssertionError("a plain float mask next to DTensors must raise")


def test_sdpa_math_path_no_grad_and_plain_mask_error(pool2):
    pool2.run(_check_sdpa_math_no_grad_and_plain_mask)


def test_sdpa_math_kernel_is_in_the_seam():
    """The autograd-level kernel exists while vescale is installed, is listed by the seam, and
    plain tensors compute exactly what the decomposition computes."""
    from vescale import _patches

    name = "aten::_scaled_dot_product_attention_math"
    has = lambda: torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutogradCPU")  # noqa: E731
    assert has()
    assert any("_scaled_dot_product_attention_math" in row[1] for row in _patches.describe())
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    op = torch.ops.aten._scaled_dot_product_attention_math.default
    want = op.decompose(q, q, q, None, 0.0, True)
    got = op(q, q, q, None, 0.0, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    _patches.uninstall()
    try:
        assert not has()
    finally:
        _patches.install()
    assert has()


def _check_sdpa_math_causal_compiled(placement):
    """``backend="vescale"`` traces the math path's causal mask too: compiled forward and
    backward equal one device."""
    mesh = mesh_of((2,))
    g = torch.Generator().manual_seed(9)
    q, k, v, grad = (torch.randn(MB, MH, ML, ME, generator=g, dtype=torch.float64) for _ in "qkvg")

    def attend(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = attend(*ref_in)
    ref.backward(grad)
    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="vescale", options={"codegen": "fx", "strict": True})
    d_in = [vescale.distribute_tensor(t, mesh, [placement]).requires_grad_(True) for t in (q, k, v)]
    out = compiled(*d_in)
    out.backward(vescale.distribute_tensor(grad, mesh, [placement]))
    assert tuple(out.placements) == (placement,), out.placements
    torch.testing.assert_close(out.full_tensor(), ref.detach(), rtol=1e-10, atol=1e-10)
    for d, r in zip(d_in, ref_in):
        torch.testing.assert_close(d.grad.full_tensor(), r.grad, rtol=1e-10, atol=1e-10)


def test_sdpa_math_path_causal_compiled(pool2):
    # Head sharding (Shard(1)) does not compile on the math path, causal or not: the traced
    # matmul views (B, H) as one dim, which explicit mode refuses as a redistribution.
    pool2.run(_check_sdpa_math_causal_compiled, Shard(0))
