"""Strategies that move an input to upstream's private ``_MaskPartial`` (gather, and
embedding's row-wise path) give single-device values on vescale DTensors (issue 18.1).

vescale's planner owns ``Replicate -> Partial`` (the value on coordinate 0); a
``_MaskPartial`` target instead masks and offsets an index, which only upstream's planner
does, so those steps must stay upstream's. The outputs are then plain ``Partial``: reducible
more than once (upstream's ``_MaskPartial`` output releases its mask on the first reduction).
"""

from __future__ import annotations

import itertools

import torch

import vescale
from tests.dtensor.reference import local_dtensor, mesh_of
from vescale import Replicate, Shard
from vescale.dtensor import explicit_redistribute
from vescale.dtensor.placement_types import is_private_partial

MESHES = [(4,), (2, 2)]


def _layouts(ndim: int, mesh_ndim: int) -> list[tuple]:
    one = [Replicate()] + [Shard(d) for d in range(ndim)]
    return list(itertools.product(one, repeat=mesh_ndim))


def _check_gather() -> int:
    torch.manual_seed(0)
    x, idx = torch.randn(4, 8, 3, dtype=torch.float64), torch.randint(8, (4, 1, 3))
    checked = 0
    for shape in MESHES:
        for xp in _layouts(3, len(shape)):
            for ip in [(Replicate(),) * len(shape), *_layouts(3, len(shape))[1:3]]:
                dx = local_dtensor(x, shape, xp)
                di = local_dtensor(idx, shape, ip)
                with explicit_redistribute(False):
                    out = torch.gather(dx, 1, di)
                assert type(out) is vescale.DTensor
                assert not any(is_private_partial(p) for p in out.placements), out.placements
                for _ in range(2):  # reducible twice
                    torch.testing.assert_close(
                        out.full_tensor(),
                        torch.gather(x, 1, idx),
                        atol=0,
                        rtol=0,
                        msg=str((shape, xp, ip)),
                    )
                checked += 1
    return checked


def test_gather_every_layout(pool4):
    assert pool4.run(_check_gather)[0] == sum(len(_layouts(3, len(s))) * 3 for s in MESHES)


def _check_mask_partial_embedding() -> None:
    """Upstream's row-wise embedding strategy (``_MaskPartial`` output) on a vescale table,
    reached through a plain index on a 1-D mesh, reduced by an explicit redistribute."""
    torch.manual_seed(0)
    table, ids = torch.randn(10, 4, dtype=torch.float64), torch.randint(10, (3, 5))
    mesh = mesh_of((4,))
    dt = vescale.distribute_tensor(table, mesh, [Shard(0)])
    di = vescale.distribute_tensor(ids, mesh, [Replicate()])
    with explicit_redistribute(False):
        out = torch.nn.functional.embedding(di, dt)
    assert not any(is_private_partial(p) for p in out.placements), out.placements
    for _ in range(2):  # reducible twice
        torch.testing.assert_close(out.full_tensor(), table[ids], atol=0, rtol=0)


def test_rowwise_embedding(pool4):
    pool4.run(_check_mask_partial_embedding)
