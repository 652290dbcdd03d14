"""The planner's bucket model against the ``bucket`` pass, on a 2-D program of a one-block
GPT (FSDP over dp x Megatron over tp, forced by its plan, ``examples/gpt.py``) on a (dp=2,
tp=2) gloo mesh: gradients reduced in two steps (a reduce-scatter over dp, then a reduction
over tp) join a bucket per step, as the compiled step merges them. The collectives the
planner counts once buckets merge are those of the compiled step's graph (up to one pair of
activation gathers the pass also merges), and the program
trains like one device (losses and parameters within 1e-5)."""

from __future__ import annotations

import torch

import vescale
from tests.plan.gpt_cases import gpt_mesh, train
from vescale import Replicate, Shard
from vescale.plan import AlphaBeta

R, S0, S1 = Replicate(), Shard(0), Shard(1)
FSDP_TP = {  # Megatron's tp shards, each also sharded over dp; everything else over dp
    "blocks.*.attn.[qkv].*": (S0, S0),
    "blocks.*.mlp.fc.*": (S0, S0),
    "blocks.*.*.proj.weight": (S0, S1),
    "head.weight": (S0, S0),
    "*": (S0, R),
}
COSTS = AlphaBeta((20e-6, 20e-6), (1e-9, 1e-9), 1e-10, flops_rate=10e9)


def _check_2d() -> dict:
    import gpt

    from vescale.backend import capture_graphs
    from vescale.fx.collectives import collective_table

    torch._dynamo.reset()
    cfg = gpt.GPTConfig(vocab=64, seq=16, dim=32, heads=4, layers=1)
    batches = [gpt.batch(cfg, i) for i in range(2)]
    ref_losses, ref_params = train(gpt.build(cfg), batches)
    model = vescale.parallelize(
        gpt.build(cfg),
        gpt_mesh(),
        FSDP_TP,
        inputs=[{"dp": S0}] * 2,
        example_inputs=batches[0],
        alpha_beta=COSTS,
        solver="greedy",  # the plan's program, as a hand-written one follows its weights
        options={"codegen": "fx"},
        progress=False,
    )
    with capture_graphs() as graphs:  # the placed step, compiled at its first call
        losses, params = train(model, batches)
    assert all(abs(a - b) < 1e-5 for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    for k, v in params.items():
        torch.testing.assert_close(v, ref_params[k], atol=1e-5, rtol=0, msg=k)
    report = model.explain()
    return {
        "compiled": len([r for g in graphs for r in collective_table(g.gm, g.name)]),
        "planned": report.merged_count,
        "unmerged": report.collective_count,
        "buckets": set(report.buckets),
    }


def test_planned_buckets_are_the_compiled_steps(pool4):
    for out in pool4.run(_check_2d, timeout_s=600):
        # the pass also merges two activation all-gathers the program issues back to back,
        # which the planner prices apart (one collective; a gradient step priced apart: 12)
        assert out["planned"] - 1 <= out["compiled"] <= out["planned"] < out["unmerged"], out
        # two-step gradient reductions: each step in its own bucket
        steps = {("gradients", "reduce_scatter", 0), ("gradients", "all_reduce", 1)}
        assert steps <= out["buckets"], out["buckets"]
