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
