"""``vescale.fx.trace`` on the fake process group at 512 ranks (2-D mesh, 16 x 32)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import vescale
from tests.harness import fake_world
from vescale import Replicate, Shard
from vescale._node_meta import get_placements
from vescale.backend import PASSES_OFF


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
        # explicit mode is on: the backward's all-reduce of the column-parallel input's
        # Partial gradient is the adjoint of the forward layout, allowed without annotation
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
        if n.op == "call_function" and get_placements(n) is not None
    ]
    assert len(placed) >= 10
    assert list(result.timings_ms["forward"]) == [
        "annotate",
        "eliminate",
        "bucket",
        "schedule",
        "fingerprint",
    ]


def test_trace_gpt_block_at_512_ranks():
    """The demo's GPT (one block, SDPA, DDP over dp) on a (16, 32) mesh of 512 fake ranks."""
    import gpt

    from vescale.ddp import DistributedDataParallel

    cfg = gpt.GPTConfig(vocab=64, seq=8, dim=64, heads=32, layers=1)
    with fake_world(512):
        mesh = vescale.init_device_mesh("cpu", (16, 32), mesh_dim_names=("dp", "tp"))
        model = DistributedDataParallel(gpt.parallelize(gpt.build(cfg), mesh))
        inputs = gpt.shard_batch(mesh, *gpt.batch(cfg, 0, batch_size=32))
        t0 = time.perf_counter()
        # passes off: one collective per cause (bucketing is tested in tests/passes)
        result = vescale.fx.trace(model, *inputs, options=PASSES_OFF)
        elapsed = time.perf_counter() - t0
    assert elapsed < 30, elapsed
    tp_ranks, dp_ranks = list(range(32)), list(range(0, 512, 32))
    fw = [
        (r["kind"], r["mesh_dim"], r["bytes"])
        for r in result.collectives
        if "forward" in r["graph"]
    ]
    # rank 0 holds 2 sequences of 8 tokens of width 64 (float32 = 4096 B): the two row-parallel
    # all-reduces of the block; the vocabulary-parallel cross-entropy's max and sum of
    # exponentials, one float32 per token over tp (the logits are never gathered); the mean's
    # global target count (one float32 over dp)
    assert fw == [
        ("all_reduce", 1, 4096),
        ("all_reduce", 1, 4096),
        ("all_reduce", 1, 2 * 8 * 4),
        ("all_reduce", 1, 2 * 8 * 4),
        ("all_reduce", 0, 4),
    ]
    bw = [r for r in result.collectives if "backward" in r["graph"]]
    ddp = [r for r in bw if r["source"].startswith("distributed_data_parallel.py:")]
    n_params = len(list(model.parameters()))
    assert sum(r["mesh_dim"] == 0 for r in ddp) == n_params  # one gradient reduction each
    assert all(r["group_ranks"] == (dp_ranks if r["mesh_dim"] == 0 else tp_ranks) for r in bw)
    attention = [
        n for n in result.forward.graph.nodes if "flash_attention_for_cpu" in str(n.target)
    ]
    assert len(attention) == 1
    # 32 heads over 32 tp ranks, 2 sequences per dp rank: one head of (2, 8, 2) each, no gather
    assert tuple(attention[0].args[0].meta["val"].shape) == (2, 1, 8, 2)
    out = next(u for u in attention[0].users if u.args[1] == 0)  # getitem 0: the output
    assert get_placements(out) == ("S(0)", "S(1)")
