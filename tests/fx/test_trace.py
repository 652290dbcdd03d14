"""``vescale.fx.trace`` on the fake process group at 512 ranks (2-D mesh, 16 x 32)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import vescale
from tests.harness import fake_world
from vescale import Replicate, Shard


def _block(x, p):
    """Pre-norm residual MLP block on a (dp, tp) mesh, Megatron layout, twice."""
    d = x.shape[-1]
    for i in range(2):
        h = F.gelu(F.layer_norm(x, (d,)) @ p[f"w1_{i}"].T)  # column parallel
        y = h @ p[f"w2_{i}"].T  # row parallel: Partial over tp
        x = x + y.redistribute(placements=[Shard(0), Replicate()])
    return x


def test_trace_tp_block_at_512_ranks():
    with fake_world(512):
        mesh = vescale.init_device_mesh("cpu", (16, 32), mesh_dim_names=("dp", "tp"))
        d = 64
        params = {}
        for i in range(2):
            params[f"w1_{i}"] = vescale.distribute_tensor(
                torch.randn(4 * d, d) * 0.02, mesh, [Replicate(), Shard(0)]
            ).requires_grad_(True)
            params[f"w2_{i}"] = vescale.distribute_tensor(
                torch.randn(d, 4 * d) * 0.02, mesh, [Replicate(), Shard(1)]
            ).requires_grad_(True)
        x = vescale.distribute_tensor(torch.randn(32, 16, d), mesh, [Shard(0), Replicate()])
        t0 = time.perf_counter()
        # the backward of a column-parallel input needs an all-reduce of its Partial gradient:
        # implicit, so allowed explicitly here
        with vescale.dtensor.explicit_redistribute(False):
            result = vescale.fx.trace(_block, x, params)
        elapsed = time.perf_counter() - t0
    assert elapsed < 30, elapsed
    assert result.backward is not None
    fw = [r for r in result.collectives if r["graph"].endswith("forward")]
    assert [r["kind"] for r in fw] == ["all_reduce", "all_reduce"]  # the two row-parallel outputs
    assert all(r["group_ranks"] == list(range(32)) and r["mesh_dim"] == 1 for r in fw)
    assert all(r["source"].startswith("test_trace.py:") for r in result.collectives)
    assert fw[0]["bytes"] == 2 * 16 * d * 4  # this rank's (2, 16, 64) float32 partial sum
    bw = [r for r in result.collectives if r["graph"].endswith("backward")]
    # block 1's layer-norm input gradient (Partial over tp) is all-reduced; block 0's is not
    # needed because x does not require grad
    assert [r["kind"] for r in bw] == ["all_reduce"]
    placed = [
        n
        for n in result.forward.graph.nodes
        if n.op == "call_function" and "vescale_placements" in (n.meta.get("custom") or {})
    ]
    assert len(placed) >= 10
    assert set(result.timings_ms["forward"]) == {"annotate"}
