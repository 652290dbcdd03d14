"""Issue 15.5: an op whose input needs an implicit ``Replicate -> Shard`` slice (local, no
communication) takes the cheap path: explicit mode's check and vescale's planner choice cost
nothing more than upstream's (``benchmarks/dispatch_overhead.py`` measures the time)."""

from __future__ import annotations

import torch

import vescale
from tests.harness import local_world
from tests.harness.collectives import count_collectives
from vescale import Replicate, Shard
from vescale.dtensor import explicit, implicit_redistribute


def test_mixed_placement_add_slices_locally_without_explicit_check(monkeypatch):
    consulted = []
    real = explicit.explicit_redistribute_enabled
    monkeypatch.setattr(
        explicit, "explicit_redistribute_enabled", lambda: consulted.append(1) or real()
    )
    a = torch.randn(8, 6, dtype=torch.float64)
    b = torch.randn(8, 6, dtype=torch.float64)
    with local_world(2):
        mesh = vescale.init_device_mesh("cpu", (2,))
        x = vescale.distribute_tensor(a, mesh, [Shard(0)])
        y = vescale.distribute_tensor(b, mesh, [Replicate()])
        implicit_redistribute._vescale_plans.cache_clear()
        with vescale.dtensor.explicit_redistribute(True), count_collectives() as counts:
            out = x + y
            out2 = x * y
        full, full2 = out.full_tensor(), out2.full_tensor()
    assert tuple(out.placements) == (Shard(0),) and tuple(out2.placements) == (Shard(0),)
    assert torch.equal(full, a + b) and torch.equal(full2, a * b)
    assert dict(counts) == {}
    assert consulted == []  # a local slice never needs explicit mode's verdict
    info = implicit_redistribute._vescale_plans.cache_info()
    assert info.misses == 1 and info.hits >= 1, info  # the planner choice is asked once
