"""Random ops under ``LocalTensorMode`` (simulated ranks in one process): every simulated rank
holds its shard of the single-device values under the same seed, and every rank's generator
ends where the single-device op leaves it; SDPA dropout with sharded heads (CPU: the math
path) equals one device, so head shards draw different masks and replicas the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vescale
from tests.dtensor.reference import coord_of, expected_local
from tests.dtensor.test_random import _inits
from tests.harness import local_world
from vescale import Replicate, Shard

LAYOUTS = [
    ((4,), [Shard(0)]),
    ((4,), [Shard(1)]),
    ((2, 2), [Replicate(), Shard(1)]),
    ((2, 2), [Shard(0), Shard(1)]),
    ((2, 2), [Shard(1), Shard(1)]),
]


def _per_rank(t: torch.Tensor) -> dict[int, torch.Tensor]:
    return dict(t._local_tensors)


def _next_draws(mode, n: int = 3) -> dict[int, torch.Tensor]:
    """Each simulated rank's next ``torch.rand(n)`` (from that rank's generator state)."""
    zeros = mode.rank_map(lambda r: torch.zeros(n))
    return _per_rank(torch.rand_like(zeros))


@pytest.mark.parametrize("shape", [(8, 12), (5, 7)], ids=["even", "uneven"])
@pytest.mark.parametrize("mesh_shape,placements", LAYOUTS, ids=str)
def test_random_ops_per_simulated_rank_equal_one_device(shape, mesh_shape, placements):
    x = torch.arange(float(torch.Size(shape).numel())).view(shape) + 1.0
    expected = {}
    for name, init in _inits().items():
        torch.manual_seed(7)
        expected[name] = (init(x.clone()), torch.rand(3))
    with local_world(4) as mode:
        mesh = vescale.init_device_mesh("cpu", mesh_shape)
        for name, init in _inits().items():
            want, after = expected[name]
            d = vescale.distribute_tensor(x, mesh, placements)
            torch.manual_seed(7)
            out = init(d)
            assert isinstance(out, vescale.DTensor) and tuple(out.placements) == tuple(placements)
            for rank, local in _per_rank(out.to_local()).items():
                coord = coord_of(mesh_shape, rank)
                want_local = expected_local(want, mesh_shape, coord, placements)
                assert torch.equal(local, want_local), (name, rank)
            for rank, draw in _next_draws(mode).items():
                assert torch.equal(draw, after), (name, rank)


def test_explicit_generator_per_simulated_rank():
    """A generator passed to the op: every rank draws from its state as it was before the op,
    and it ends where the single-device op leaves it (once, not once per simulated rank)."""
    g = torch.Generator().manual_seed(11)
    want = torch.empty(6, 10).uniform_(-1.0, 1.0, generator=g)
    after = g.get_state()
    with local_world(4):
        mesh = vescale.init_device_mesh("cpu", (2, 2))
        d = vescale.distribute_tensor(torch.zeros(6, 10), mesh, [Shard(1), Shard(0)])
        g.manual_seed(11)
        d.uniform_(-1.0, 1.0, generator=g)
        for rank, local in _per_rank(d.to_local()).items():
            coord = coord_of((2, 2), rank)
            assert torch.equal(local, expected_local(want, (2, 2), coord, [Shard(1), Shard(0)]))
    assert torch.equal(g.get_state(), after)


@pytest.mark.parametrize(
    "mesh_shape,placements",
    [((4,), [Shard(1)]), ((2, 2), [Replicate(), Shard(1)]), ((2, 2), [Shard(1), Replicate()])],
    ids=str,
)
def test_sdpa_dropout_sharded_heads_per_simulated_rank(mesh_shape, placements):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, dtype=torch.float64) for _ in range(3))
    torch.manual_seed(3)
    want = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    with local_world(4):
        mesh = vescale.init_device_mesh("cpu", mesh_shape)
        dts = [vescale.distribute_tensor(t, mesh, placements) for t in (q, k, v)]
        torch.manual_seed(3)
        out = F.scaled_dot_product_attention(*dts, dropout_p=0.5)
        locals_ = _per_rank(out.to_local())
    for rank, local in locals_.items():
        coord = coord_of(mesh_shape, rank)
        torch.testing.assert_close(
            local, expected_local(want, mesh_shape, coord, placements), rtol=0, atol=1e-12
        )
    if mesh_shape == (2, 2):  # two replicas of each head shard: the same mask, not the other's
        twin, other = (2, 1) if placements[0] == Replicate() else (1, 2)
        assert torch.equal(locals_[0], locals_[twin]) and not torch.equal(
            locals_[0], locals_[other]
        )
