"""``redistribute(..., forward_dtype=, backward_dtype=)`` against upstream DTensor's: the same
values, the same gradient and dtypes, each collective run in the dtype asked for."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor as upstream
from torch.distributed.device_mesh import init_device_mesh as upstream_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

import vescale
from tests.dtensor.reference import mesh_of
from tests.harness.collectives import count_collectives

F16, F32, F64 = torch.float16, torch.float32, torch.float64
CASES = [  # (source, target, forward_dtype, backward_dtype)
    (Shard(0), Replicate(), F64, None),  # all-gather forward in float64
    (Shard(0), Replicate(), F16, F64),
    (Replicate(), Shard(1), None, F16),  # all-gather of the gradient in float16
    (Replicate(), Shard(0), F64, F16),
    (Partial(), Replicate(), F64, None),  # all-reduce forward in float64
    (Shard(1), Shard(0), F16, F64),  # all-to-all both ways
]


def _run(dist_fn, mesh, src, dst, fwd, bwd):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    full = torch.randn(4, 6)
    weight = torch.randn(4, 6)
    x = dist_fn(full, mesh, [Replicate() if src.is_partial() else src])
    if src.is_partial():  # each rank's share: Partial sums to full
        x = type(x).from_local(x.to_local() / 2, mesh, [Partial()])
    x = x.detach().requires_grad_()
    with count_collectives() as forward:
        y = x.redistribute(mesh, [dst], forward_dtype=fwd, backward_dtype=bwd)
        out = y.full_tensor()
    with count_collectives() as backward:
        (out.double() * weight.double()).sum().backward()
    assert x.grad is not None
    grad = x.grad.full_tensor()
    return out, y.dtype, grad, x.grad.dtype, dict(forward.bytes), dict(backward.bytes)


def _compare(case: int) -> None:
    src, dst, fwd, bwd = CASES[case]
    ours = _run(vescale.distribute_tensor, mesh_of((2,)), src, dst, fwd, bwd)
    theirs = _run(upstream.distribute_tensor, upstream_mesh("cpu", (2,)), src, dst, fwd, bwd)
    out, dtype, grad, grad_dtype, fwd_bytes, bwd_bytes = ours
    assert dtype == (fwd or F32) and grad_dtype == F32
    assert (dtype, grad_dtype) == (theirs[1], theirs[3])
    assert torch.equal(out, theirs[0]) and torch.equal(grad, theirs[2])
    # the redistribution's own collectives (full_tensor's gather adds the same on both sides)
    assert (fwd_bytes, bwd_bytes) == (theirs[4], theirs[5])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_dtypes_match_upstream(pool2, case):
    pool2.run(_compare, case)


def _positional_async() -> None:
    mesh = mesh_of((2,))
    d = vescale.distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    assert torch.equal(d.redistribute(mesh, [Replicate()], False).to_local(), torch.ones(4, 2))
    assert d.redistribute(placements=[Replicate()], async_op=False).dtype == F32


def test_async_op_positional_and_keyword(pool2):
    pool2.run(_positional_async)
