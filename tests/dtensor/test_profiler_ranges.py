"""Profiler ranges named as upstream's: each eager redistribution that communicates is one
``vescale::redistribute <src>-><dst>`` range; a compiled graph holds no range ops."""

from __future__ import annotations

from collections import Counter

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import vescale
from tests.dtensor.reference import mesh_of


def _ranges() -> dict[str, int]:
    mesh = mesh_of((2, 2))
    x = vescale.distribute_tensor(torch.randn(8, 8), mesh, [Shard(0), Shard(1)])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        x.redistribute(mesh, [Replicate(), Shard(1)]).to_local(async_output=False)
        x.redistribute(mesh, [Shard(0), Shard(1)])  # moves nothing: no range
        p = x.redistribute(mesh, [Partial(), Shard(1)])
        p.redistribute(mesh, [Replicate(), Shard(1)]).to_local(async_output=False)
    names = Counter(e.name for e in prof.events() if e.name.startswith("vescale::"))
    return dict(names)


def test_each_redistribution_is_one_range(pool4):
    expected = {
        "vescale::redistribute S(0),S(1)->R,S(1)": 1,
        "vescale::redistribute S(0),S(1)->P(sum),S(1)": 1,
        "vescale::redistribute P(sum),S(1)->R,S(1)": 1,
    }
    assert pool4.run(_ranges) == [expected] * 4
