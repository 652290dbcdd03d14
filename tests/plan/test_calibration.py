"""The one cost model (:mod:`vescale.cost`): its prices of known graphs equal hand-computed
numbers, its buckets are the ``bucket`` pass's, and calibration is reproducible.

Reproducible: on 2 gloo ranks under a background busy loop, calibrating twice (the process
cache cleared in between, as a new run starts) gives identical constants on every rank,
read back from the disk cache; with the cache off (``VESCALE_RECALIBRATE=1``) each call
measures again and the quantized constants still give the same plan for a small model.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from tests.harness.simulated import fake_world
from vescale import Replicate, Shard
from vescale.cost import CommStep, CostModel
from vescale.cost.model import bucket_sizes, quantize
from vescale.fx.timeline import estimate_us
from vescale.passes.bucket import select_buckets
from vescale.plan.cost import bucket_copy_s, strategy_compute_s

c10d = torch.ops._c10d_functional
MODEL = CostModel(
    alpha=(1e-4, 2e-4),
    beta=(1e-9, 3e-9),
    gamma=1e-9,
    flops_rate=1e9,
    op_s=2e-6,
    groups=(((0, 1), 5e-4, 4e-9),),
)


def test_collectives_are_alpha_plus_beta_times_ring_bytes() -> None:
    assert MODEL.comm_s("all_reduce", (1,), 2, 1000) == pytest.approx(2e-4 + 3e-9 * 1000)
    assert MODEL.comm_s("all_gather", (0,), 2, 1000) == pytest.approx(1e-4 + 1e-9 * 1000)
    assert MODEL.comm_s("reduce_scatter", (0,), 4, 1000) == pytest.approx(1e-4 + 1e-9 * 750)
    # a flattened group: its own constants; uncalibrated: its dims' largest
    assert MODEL.comm_s("all_reduce", (1, 0), 4, 1000) == pytest.approx(5e-4 + 4e-9 * 1500)
    bare = CostModel(MODEL.alpha, MODEL.beta)
    assert bare.comm_s("all_gather", (0, 1), 4, 1000) == pytest.approx(2e-4 + 3e-9 * 3000)
    step = CommStep("all_reduce", 1, 2, 1000)
    assert MODEL.time(step) == MODEL.comm_s("all_reduce", (1,), 2, 1000)
    assert MODEL.latency(step) == 2e-4
    # a kind's measured factor scales its wire bytes (gloo: a reduce-scatter ~ an all-reduce)
    gloo = dataclasses.replace(MODEL, kinds=(("reduce_scatter", 2.0),))
    assert gloo.comm_s("reduce_scatter", (0,), 4, 1000) == pytest.approx(1e-4 + 1e-9 * 1500)
    assert gloo.comm_s("all_gather", (0,), 2, 1000) == MODEL.comm_s("all_gather", (0,), 2, 1000)


def test_a_bucket_pays_one_latency_per_piece_the_cap_leaves() -> None:
    steps = [CommStep("all_reduce", 0, 2, b) for b in (1000, 1000, 3000)]
    # cap 2500: [1000 + 1000], [3000]: two latencies, every member's bandwidth
    assert MODEL.bucket_s(steps, 2500) == pytest.approx(2 * 1e-4 + 1e-9 * 5000)
    assert MODEL.bucket_s(steps) == pytest.approx(1e-4 + 1e-9 * 5000)
    # an all-gather counts its output (the larger) against the cap, as the pass does
    gathers = [CommStep("all_gather", 0, 2, 1000)] * 2
    assert MODEL.bucket_s(gathers, 3000) == pytest.approx(2 * 1e-4 + 1e-9 * 2000)


def test_a_bucket_member_pays_its_packing_copies() -> None:
    # read + write at gamma: the input packed; an all-gather's also copied into its output
    # slice and its result (n x the input) copied out of the interleaved buffer
    g = MODEL.gamma
    assert bucket_copy_s(MODEL, CommStep("all_reduce", 0, 4, 1000)) == pytest.approx(2000 * g)
    assert bucket_copy_s(MODEL, CommStep("reduce_scatter", 0, 4, 1000)) == pytest.approx(2000 * g)
    assert bucket_copy_s(MODEL, CommStep("all_gather", 0, 4, 1000)) == pytest.approx(12000 * g)


def _all_reduces(*xs: torch.Tensor) -> list[torch.Tensor]:
    name = dist.group.WORLD.group_name  # type: ignore[union-attr]
    outs = [c10d.wait_tensor(c10d.all_reduce(x, "sum", name)) for x in xs]
    return [o * 2 for o in outs]


@pytest.mark.parametrize("cap", [2000, 3000, 10_000, 100])
def test_bucket_split_matches_the_bucket_pass(cap: int) -> None:
    """The cost model's split of a bucket equals the ``bucket`` pass's on the same members."""
    numels = [300, 200, 500, 100, 250]
    with fake_world(2):
        gm = make_fx(_all_reduces, tracing_mode="fake")(*(torch.randn(n) for n in numels))
        merged = select_buckets(gm, cap / 2**20)
    members = sum(len(b) for b in merged)
    issued = len(merged) + len(numels) - members
    assert len(bucket_sizes([4 * n for n in numels], cap)) == issued


def _graph() -> torch.fx.GraphModule:
    def f(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor) -> Any:
        y = torch.relu(a @ b).view(-1)
        att = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        return y, att

    return make_fx(f)(torch.randn(64, 32), torch.randn(32, 16), torch.randn(2, 4, 8, 16))


def _node(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target))


def test_ops_priced_by_flops_or_bytes_by_hand() -> None:
    gm = _graph()
    mm_bytes = (64 * 32 + 32 * 16 + 64 * 16) * 4  # 14,336: slower by its FLOPs
    mm_flops = 2 * 64 * 16 * 32  # 65,536
    assert mm_flops / 1e9 > mm_bytes * 1e-9
    assert estimate_us(_node(gm, "mm"), MODEL) == pytest.approx(2.0 + 65.536)
    assert estimate_us(_node(gm, "relu"), MODEL) == pytest.approx(2.0 + 2 * 1024 * 4 * 1e-3)
    assert estimate_us(_node(gm, "view"), MODEL) == 0.0
    att = _node(gm, "scaled_dot_product")
    att_flops = 4 * (2 * 4 * 8 * 16) * 8  # QK^T and PV: 4 B H L S E
    held = 3 * 1024 * 4 + sum(
        math.prod(v.shape) * v.element_size()
        for v in att.meta["val"]
        if isinstance(v, torch.Tensor)
    )
    want = 2.0 + max(att_flops * 1e-3, held * 1e-3)
    assert estimate_us(att, MODEL) == pytest.approx(want)


def test_a_strategy_does_its_share_of_the_flops() -> None:
    """A matmul whose output is sharded (or partial) over a mesh dim of 4 does a quarter of
    the products on each rank; replicated, all of them."""
    mm = _node(_graph(), "mm")
    flops = 2 * 64 * 16 * 32
    split = strategy_compute_s(MODEL, mm, (Shard(0),), (4,), 100)
    assert split == pytest.approx(2e-6 + flops / 4 / 1e9)
    whole = strategy_compute_s(MODEL, mm, (Replicate(),), (4,), 100)
    assert whole == pytest.approx(2e-6 + flops / 1e9)


def test_quantize_rounds_to_quarter_octaves() -> None:
    assert quantize(1e-3) == quantize(1.05e-3) == pytest.approx(2 ** (-10.0))
    assert quantize(1e-3) != quantize(1.3e-3)


# --- calibration on 2 gloo ranks, under a background busy loop --------------------------


@pytest.fixture
def busy() -> Iterator[None]:
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 64, bias=False)
        self.proj = nn.Linear(64, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(x))).square().sum()


def _choice(model: CostModel) -> list[str]:
    """Every node's chosen placements for the MLP on the 2-rank mesh, priced by ``model``."""
    from tests.dtensor.reference import mesh_of
    from vescale.plan.capture import capture_joint
    from vescale.plan.program import place

    joint = capture_joint(_MLP(), [torch.randn(8, 16)])
    names = joint.placeholder_names  # fc, proj, x
    fixed = {names[0]: (Shard(0),), names[1]: (Shard(1),), names[2]: (Shard(0),)}
    program = place(joint, mesh_of((2,)), fixed, None, model, buckets=True)
    return [f"{n.name}: {program.table[n].outputs[s]}" for n, s in program.chosen.items()]


def _calibrate_twice() -> tuple[list[CostModel], list[list[str]], list[str]]:
    from tests.dtensor.reference import mesh_of
    from vescale.cost import calibration

    models = []
    for _ in range(2):
        calibration._cache.clear()  # as a new run: only the disk cache is left
        models.append(calibration.calibrate(mesh_of((2,))))
    files = sorted(p.name for p in calibration.cache_path("x").parent.glob("calibration-*"))
    return models, [_choice(m) for m in models], files


def test_calibration_is_cached_on_disk_and_equal_on_every_rank(pool2, busy, tmp_path) -> None:
    env = {"VESCALE_CACHE_DIR": str(tmp_path)}
    results = pool2.run(_calibrate_twice, env=env, timeout_s=600)
    (first, second), _, files = results[0]
    assert first == second, (first, second)  # read back, not measured again
    assert all(r[0] == [first, first] for r in results)  # every rank: the same constants
    assert len(files) == 1 and files[0].startswith("calibration-2-gloo-w2-"), files
    assert all(a > 0 for a in first.alpha) and first.flops_rate > 0 and first.gamma > 0
    assert [k for k, f in first.kinds if f > 0] == ["reduce_scatter", "all_gather"]


def test_recalibrated_constants_give_the_same_plan(pool2, busy, tmp_path) -> None:
    env = {"VESCALE_CACHE_DIR": str(tmp_path), "VESCALE_RECALIBRATE": "1"}
    results = pool2.run(_calibrate_twice, env=env, timeout_s=600)
    models, choices, _ = results[0]
    assert all(r[0] == models for r in results)  # agreed across ranks, measurement by measurement
    assert choices[0] == choices[1], (models, choices)
    assert all(r[1] == choices for r in results)


def _measure_one_rank_groups() -> list[CostModel]:
    """Calibration on a (2, 1) mesh (a mesh dim of one rank) and on a (1,) mesh of each
    rank's own group (every group of one rank)."""
    from tests.dtensor.reference import mesh_of
    from vescale.cost import calibration
    from vescale.dtensor.device_mesh import DeviceMesh

    own = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    meshes = [mesh_of((2, 1)), DeviceMesh.from_group(own, "cpu")]
    return [calibration._measure(m) for m in meshes]


def test_groups_of_one_rank_calibrate(pool2) -> None:
    for two_by_one, alone in pool2.run(_measure_one_rank_groups, timeout_s=300):
        # nothing crosses a wire in a group of one rank: the floor constants, never a
        # division by its zero wire bytes
        assert two_by_one.alpha[1] == alone.alpha[0] == quantize(1e-7)
        assert two_by_one.beta[1] == alone.beta[0] == quantize(1e-13)
        assert two_by_one.alpha[0] > 1e-7 and two_by_one.beta[0] > 1e-13  # the real dim
        assert dict(alone.kinds) == {"reduce_scatter": 1.0, "all_gather": 1.0}
