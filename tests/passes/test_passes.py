"""The communication passes: eliminate, bucket, schedule, rank consistency, schedule.json.

Each is checked on real graphs (gloo ranks, or the fake group for structure only) against
the same program with the pass off and against single-device torch."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import vescale
from tests.compiled_gpt import gpt_results
from tests.dtensor.reference import mesh_of
from tests.harness import fake_world
from vescale import Replicate, Shard
from vescale.ddp import DistributedDataParallel
from vescale.fx.collectives import COLLECTIVE_KINDS
from vescale.fx.dump import graph_text

WAIT = torch.ops._c10d_functional.wait_tensor.default


class Stack(nn.Module):
    """Four bias-free 32x32 linears: four (32, 32) float32 gradients of 4096 B each."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(32, 32, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


def _replicated_stack(mesh):
    net = Stack()
    for i, layer in enumerate(net.layers):
        w = vescale.distribute_tensor(layer.weight.detach(), mesh, [Replicate()])
        net.layers[i].weight = nn.Parameter(w)
    return DistributedDataParallel(net)


def _backward_reductions(options):
    with fake_world(4):
        mesh = vescale.init_device_mesh("cpu", (4,))
        x = vescale.distribute_tensor(torch.randn(8, 32), mesh, [Shard(0)])
        result = vescale.fx.trace(_replicated_stack(mesh), x, options=options)
    return result


@pytest.mark.parametrize(
    ("cap_mb", "expected"), [(0, [1, 1, 1, 1]), (2.5 * 4096 / 2**20, [2, 2]), (25, [4])]
)
def test_bucket_count_follows_the_cap(cap_mb, expected):
    result = _backward_reductions({"bucket_cap_mb": cap_mb})
    reductions = [r for r in result.collectives if r["graph"].endswith("backward")]
    assert len(reductions) == len(expected), reductions
    assert [r["bytes"] for r in reductions] == [4096 * n for n in expected]
    assert result.reports["backward"]["buckets"] == [n for n in expected if n > 1]
    buckets = [r["bucket"] for r in reductions]
    assert buckets == ([None] * 4 if cap_mb == 0 else list(range(len(expected))))
    # every node a merge added (packing, collective, wait, unpacking) is named in the dumps
    text = graph_text(result.backward, "backward")
    tagged = [ln for ln in text.splitlines() if "  bucket " in ln]
    assert (len(tagged) > 0) == (cap_mb > 0), text


def test_all_gathers_bucket_into_one_recorded_collective():
    """Two independent all-gathers on one group merge into one; the merged collective is
    Inductor's ``all_gather_into_tensor_out``, recorded like any all-gather (it was not
    recognized: the bucket pass failed and the graph ran eagerly)."""

    def gather_both(x, y):
        a = x.redistribute(placements=[Replicate()])
        b = y.redistribute(placements=[Replicate()])
        return a * 2 + b

    with fake_world(4):
        mesh = vescale.init_device_mesh("cpu", (4,))
        x, y = (vescale.distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)]) for _ in "xy")
        result = vescale.fx.trace(gather_both, x, y, options={"bucket_cap_mb": 25})
    gathers = [r for r in result.collectives if r["kind"] == "all_gather"]
    assert [(r["bytes"], r["bucket"]) for r in gathers] == [(2 * 2 * 6 * 4, 0)], gathers
    assert result.reports["forward"]["buckets"] == [2]


def test_schedule_waits_after_collective_and_before_first_use():
    result = _backward_reductions({"bucket_cap_mb": 0})  # one reduction per gradient
    for gm in (result.forward, result.backward):
        nodes = list(gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        for node in nodes:
            if node.target is WAIT:
                first_use = min(pos[u] for u in node.users)
                assert pos[node.args[0]] < pos[node] < first_use
                between = nodes[pos[node] + 1 : first_use]
                assert all(n.target is WAIT for n in between)  # waited as late as possible
    overlap = result.reports["backward"]["overlap"]
    assert overlap and max(overlap.values()) > 0, overlap  # compute runs while it is in flight


def _most_in_flight(gm):
    inflight = most = 0
    for node in gm.graph.nodes:
        if node.target in COLLECTIVE_KINDS:
            inflight += 1
            most = max(most, inflight)
        elif node.target is WAIT:
            inflight -= 1
    return most


def test_schedule_respects_the_memory_cap():
    # uncapped, the four gradient reductions are in flight together; with a cap below one
    # gradient every collective is waited before the next is issued
    assert _most_in_flight(_backward_reductions({"bucket_cap_mb": 0}).backward) == 4
    capped = _backward_reductions({"bucket_cap_mb": 0, "overlap_cap_mb": 1e-6})
    assert _most_in_flight(capped.backward) == 1


def test_gpt_numerics_unchanged_by_passes(pool4):
    on, off = gpt_results(pool4, "fx"), gpt_results(pool4, "fx-passes-off")
    for with_passes, without in zip(on, off):
        ref_losses, ref_params = with_passes.runs["1-device"]
        for losses, params in (with_passes.runs["vescale"], without.runs["vescale"]):
            assert all(abs(a - b) < 1e-5 for a, b in zip(losses, ref_losses)), losses
            for k, v in params.items():
                torch.testing.assert_close(v, ref_params[k], atol=1e-5, rtol=1e-4)
        on_losses, off_losses = with_passes.runs["vescale"][0], without.runs["vescale"][0]
        assert on_losses == pytest.approx(off_losses, abs=1e-6)


def _sequence(records):
    return [
        (r["graph"], r["kind"], r["dtype"], r["mesh_dim"], r["bytes"], r["bucket"]) for r in records
    ]


def test_gpt_passes_issue_fewer_collectives_same_bytes(pool4):
    with_passes, without = gpt_results(pool4, "fx"), gpt_results(pool4, "fx-passes-off")
    for on, off in zip(with_passes, without):
        n_on, n_off = len(on.records), len(off.records)
        assert n_on < n_off / 2, (n_on, n_off)
        # bucketing packs, it does not add or drop data
        assert sum(r["bytes"] for r in on.records) == sum(r["bytes"] for r in off.records)
        assert on.lanes == {"compute", "communication"} and on.fingerprinted
    # the same collective sequence on every rank (rank_check, on by default, compared the
    # fingerprints already before the first run)
    assert all(_sequence(r.records) == _sequence(with_passes[0].records) for r in with_passes)


def _eliminate(options):
    mesh = mesh_of((4,))
    x = vescale.distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)])

    def f(x):
        y = x.redistribute(placements=[Replicate()])  # gathered ...
        return (y.redistribute(placements=[Shard(0)]) * 2).relu()  # ... and sliced back

    torch._dynamo.reset()
    result = vescale.fx.trace(f, x, backward=False, options=options)
    out = torch.compile(f, backend="vescale", options={"codegen": "fx", **options})(x)
    torch.testing.assert_close(out.full_tensor(), (x.full_tensor() * 2).relu())
    return len(result.collectives)


def test_eliminate_removes_gather_sliced_back(pool4):
    assert pool4.run(_eliminate, {}) == [0] * 4
    assert pool4.run(_eliminate, {"eliminate": False}) == [1] * 4


def _gather_then_other_dims_chunk():
    """``(R, S(0)) -> (S(0), R)`` on a 2x2 mesh: an all-gather over tp, then the chunk of the
    dp coordinate. That chunk is the gather's own input only where dp == tp (ranks 0 and 3):
    an elimination decided per rank would compile fewer collectives there than on ranks 1, 2."""
    mesh = mesh_of((2, 2))
    x = vescale.distribute_tensor(torch.randn(8, 6), mesh, [Replicate(), Shard(0)])

    def f(x):
        return x.redistribute(placements=[Shard(0), Replicate()]) * 2

    torch._dynamo.reset()
    out = torch.compile(f, backend="vescale", options={"codegen": "fx"})(x)
    torch.testing.assert_close(out.full_tensor(), x.full_tensor() * 2)
    assert out.placements == (Shard(0), Replicate())
    return len(vescale.fx.trace(f, x, backward=False).collectives)


def test_elimination_is_decided_alike_on_every_rank(pool4):
    # the gather stays on every rank: on ranks 1 and 2 the chunk is not their own
    assert pool4.run(_gather_then_other_dims_chunk) == [1] * 4


def _divergent():
    mesh = mesh_of((4,))
    x = vescale.distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)])

    def f(x):
        if dist.get_rank() == 1:  # a rank-dependent program
            x = x.redistribute(placements=[Replicate()]).redistribute(placements=[Shard(0)])
        return x * 2

    torch._dynamo.reset()
    t0 = time.perf_counter()
    with pytest.raises(Exception) as err:
        torch.compile(f, backend="vescale", options={"codegen": "fx", "eliminate": False})(x)
    message = str(err.value)
    assert "the ranks are about to run different graphs" in message, message
    assert re.search(
        r"rank 0: graph\d+\.forward \(compile 0/0\), 0 collectives, #0: \(no more collectives\)",
        message,
    )
    first = (
        r"rank 1: graph\d+\.forward \(compile 0/0\), 1 collectives, #0: all_gather float32\[8, 6\] "
        r"over mesh dim 0"
    )
    assert re.search(first + r" of 4 @ test_passes\.py:\d+", message), message
    return time.perf_counter() - t0


def test_rank_divergent_program_fails_fast(pool4):
    assert max(pool4.run(_divergent)) < 30
