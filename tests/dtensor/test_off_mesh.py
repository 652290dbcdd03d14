"""Ranks outside an op's mesh (issue 18): vescale's op handlers do not run there. Those ranks
get empty local results with the single-device global shapes and dtypes and communicate
nothing; ranks on the mesh get single-device values. Random ops run there too and advance
the generator exactly as one device does."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import vescale
from tests.harness.collectives import count_collectives
from vescale import Shard

OPS = {
    "argmax": lambda x, t: x.argmax(1),
    "topk": lambda x, t: x.topk(2, dim=1),
    "unique": lambda x, t: torch.unique(t, return_counts=True),  # shapes depend on values
    "cross_entropy": lambda x, t: F.cross_entropy(x, t),
    "mse_loss": lambda x, t: F.mse_loss(x, x.detach() * 2),
    "scatter_": lambda x, t: x.clone().scatter_(1, t[:, None], 1.0),
    "log_softmax": lambda x, t: x.log_softmax(1),
    "inf_norm": lambda x, t: torch.linalg.vector_norm(x, float("inf"), dim=0),
}


@functools.cache
def _submesh() -> vescale.DeviceMesh:
    return vescale.DeviceMesh("cpu", [0, 2])


def _check_ops() -> dict[str, int]:
    """Per op, the collectives this rank issued; asserts shapes (off the mesh) or values."""
    mesh = _submesh()
    outside = mesh.get_coordinate() is None
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randint(7, (5,), generator=g)
    issued = {}
    for name, fn in OPS.items():
        dx = vescale.distribute_tensor(x, mesh, [Shard(1)])
        dt = vescale.distribute_tensor(t, mesh, [Shard(0)])
        with vescale.dtensor.explicit_redistribute(False), count_collectives() as counts:
            out = fn(dx, dt)
        issued[name] = sum(counts.values())
        outs, refs = (out, fn(x, t)) if isinstance(out, tuple) else ((out,), (fn(x, t),))
        for o, r in zip(outs, refs, strict=True):
            if outside:
                assert o.to_local().numel() == 0 or o.ndim == 0, name
                assert o.dtype == r.dtype and (name == "unique" or o.shape == r.shape), name
            else:
                torch.testing.assert_close(o.full_tensor(), r, rtol=1e-12, atol=1e-12)
    return issued


def test_ranks_outside_a_submesh_run_no_handler(pool4):
    issued = pool4.run(_check_ops)
    assert issued[1] == issued[3] == dict.fromkeys(OPS, 0)
    assert all(issued[0][op] > 0 for op in ("argmax", "topk", "cross_entropy")), issued[0]


def _rng_state_after_random_ops() -> bool:
    """Whether this rank's generator, after random ops on a sub-mesh DTensor, is where one
    device's is after the same ops."""
    mesh = _submesh()
    dx = vescale.distribute_tensor(torch.zeros(5, 7), mesh, [Shard(0)])
    torch.manual_seed(11)
    dx.uniform_()
    torch.rand_like(dx)
    F.dropout(dx, 0.5)
    got = torch.get_rng_state()
    torch.manual_seed(11)
    x = torch.zeros(5, 7)
    x.uniform_()
    torch.rand_like(x)
    F.dropout(x, 0.5)
    return torch.equal(got, torch.get_rng_state())


def test_random_ops_advance_the_generator_off_the_mesh(pool4):
    assert pool4.run(_rng_state_after_random_ops) == [True] * 4
