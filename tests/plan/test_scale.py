"""Propagation and global choice for a GPT block on a 512-rank (dp=64, tp=8) mesh: no
process group, no data (a meta mesh; strategies depend on the mesh shape only); the time is
reported and bounded."""

from __future__ import annotations

import time

import torch

import vescale
from tests.plan.gpt_cases import ALPHA_BETA
from vescale import Shard
from vescale.plan.capture import capture_joint
from vescale.plan.explain import explain
from vescale.plan.program import place
from vescale.plan.validate import normalize_plan, validate_inputs


def test_512_rank_gpt_block_propagation_and_choice_under_30s():
    import gpt

    mesh = vescale.DeviceMesh("meta", torch.arange(512).view(64, 8), mesh_dim_names=("dp", "tp"))
    cfg = gpt.GPTConfig(vocab=1024, seq=16, dim=64, heads=8, layers=1)
    model = gpt.build(cfg)
    example = gpt.batch(cfg, 0, batch_size=64)
    plan = {
        "blocks.*.attn.[qkv].weight": {"tp": Shard(0)},
        "blocks.*.mlp.fc.weight": {"tp": Shard(0)},
        "blocks.*.*.proj.weight": {"tp": Shard(1)},
        "head.weight": {"tp": Shard(0)},
    }
    start = time.perf_counter()
    joint = capture_joint(model, example)
    captured = time.perf_counter()
    names = [n for n, _ in model.named_parameters()]
    by_name = normalize_plan(plan, dict(model.named_parameters()), mesh)
    fixed = {ph: by_name[n] for n, ph in zip(names, joint.placeholder_names) if n in by_name}
    batch = validate_inputs([{"dp": Shard(0)}] * 2, example, mesh)
    fixed.update(zip(joint.placeholder_names[len(names) :], batch))
    program = place(joint, mesh, fixed, None, ALPHA_BETA)
    total = program.timings_s["propagate"] + program.timings_s["solve"]
    print(
        f"\n512 ranks, GPT block joint graph: {len(joint.gm.graph.nodes)} nodes, capture "
        f"{captured - start:.2f} s, propagate {program.timings_s['propagate']:.2f} s, "
        f"solve {program.timings_s['solve']:.2f} s\n{explain(program).summary()}"
    )
    assert total < 30, program.timings_s
    chosen = program.param_placements()
    for name, placements in by_name.items():  # the plan is hard
        assert chosen[name] == placements, name


def test_plan_scale_benchmark_quick_rows():
    """``benchmarks/plan_scale.py --quick --no-solve`` (the Llama-3-8B shape, 1 and 2 layers on
    a meta (8, 8) mesh, one 8192-token sequence per rank) runs and prints both rows."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = root / "benchmarks" / "plan_scale.py"
    out = subprocess.run(
        [sys.executable, str(script), "--quick", "--no-solve"],
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        check=False,
        timeout=500,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines()[2:]]
    assert [(r[0].strip(), r[1].strip(), r[2].strip()) for r in rows] == [
        ("8b", "8x8", "1"),
        ("8b", "8x8", "2"),
    ], out.stdout
    for r in rows:
        capture, propagate, _, rss = (float(c) for c in r[3:7])
        assert capture > 0 and propagate > 0 and 0 < rss < 8, r
        assert r[7].strip() == "not solved", r
