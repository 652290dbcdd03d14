"""A model where choosing each op's placements greedily (cheapest given its inputs, as eager
dispatch does) is not optimal over the whole graph, and the global choice is.

Construction (2 ranks, float32, buffers only, so the graph is forward-only): ``X [8, 4]``
``Shard(0)``, ``W [4, 4]`` ``Shard(1)``, ``V [4, 64]`` ``Shard(0)``; the model returns
``((X @ W) @ V).sum()`` replicated.

* Greedy, at ``X @ W``: gathering ``W`` (its shard: 4x2 floats, 32 B) is cheaper than gathering
  ``X`` (4x4, 64 B), so ``Y = X @ W`` comes out ``Shard(0)``. At ``Y @ V`` with ``V`` row-sharded,
  the cheapest is to move ``Y`` to ``Shard(1)`` (all-gather of its 4x4 shard, 64 B, then a
  local slice; gathering ``V`` would move its 2x64 shard, 512 B), giving a ``Partial``
  product; its sum is all-reduced (4 B). Three collectives, 32 + 64 + 4 = 100 B.
* Global: gather ``X`` (64 B) instead, so ``Y`` is ``Shard(1)`` (column-parallel), ``Y @ V`` is
  row-parallel with no communication, and only the sum is all-reduced (4 B). Two
  collectives, 68 B: the first op pays more so the second pays nothing.
"""

from __future__ import annotations

import torch
from torch import nn

import vescale
from tests.dtensor.reference import mesh_of
from tests.harness.collectives import count_collectives
from vescale import Replicate, Shard
from vescale.plan import AlphaBeta


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("X", torch.randn(8, 4, generator=g))
        self.register_buffer("W", torch.randn(4, 4, generator=g))
        self.register_buffer("V", torch.randn(4, 64, generator=g))

    def forward(self) -> torch.Tensor:
        return ((self.X @ self.W) @ self.V).sum()


PLAN = {"X": (Shard(0),), "W": (Shard(1),), "V": (Shard(0),)}
COSTS = AlphaBeta((20e-6,), (1e-9,), 1e-10)


def _run(solver: str) -> tuple[float, dict[str, int], dict[str, int], dict[str, str]]:
    model = vescale.parallelize(
        Chain(),
        mesh_of((2,)),
        PLAN,
        inputs=[],
        example_inputs=[],
        solver=solver,
        alpha_beta=COSTS,
        compile=False,
    )
    with count_collectives() as counts:
        out = model()
    assert tuple(out.placements) == (Replicate(),)
    chosen = {
        n.name: str(model.program.placements((n, None)))
        for n in model.program.table
        if n.op == "call_function"
    }
    return out.to_local().item(), dict(counts), dict(counts.bytes), chosen


def _check_global_beats_greedy() -> None:
    ref = Chain()().item()
    greedy_value, greedy_counts, greedy_bytes, greedy_chosen = _run("greedy")
    global_value, global_counts, global_bytes, global_chosen = _run("global")
    assert abs(greedy_value - ref) < 1e-4 and abs(global_value - ref) < 1e-4
    assert greedy_counts == {"all_gather": 2, "all_reduce": 1}, greedy_counts
    assert greedy_bytes == {"all_gather": 32 + 64, "all_reduce": 4}, greedy_bytes
    assert global_counts == {"all_gather": 1, "all_reduce": 1}, global_counts
    assert global_bytes == {"all_gather": 64, "all_reduce": 4}, global_bytes
    assert greedy_chosen["mm"] == "(Shard(dim=0),)" and global_chosen["mm"] == "(Shard(dim=1),)"


def test_global_choice_issues_fewer_bytes_than_greedy(pool2):
    pool2.run(_check_global_beats_greedy, timeout_s=300)
