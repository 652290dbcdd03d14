"""Compile time of the plan path vs the DTensor path on the same GPT, and the plan path's
greedy vs global bytes per step.

    torchrun --standalone --nproc-per-node 4 benchmarks/plan_compile.py [--device cpu|cuda]

Both on a (dp=2, tp=2) mesh, same model (``examples/gpt.py``, ``GPTConfig(vocab=1024)``)
and batch; rank 0 prints seconds for each stage (first call = compile + one run, forward and
backward). Plan path: ``vescale.parallelize`` (capture, propagate, solve with fixed costs so the
choice does not depend on the machine's load; calibration timed apart) then the first step of
its ``vescale``-compiled program. DTensor path: ``gpt.parallelize`` + DDP, then the first step
of ``torch.compile(backend="vescale")``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import gpt
from launch import add_device_argument, init_distributed, synchronize
from plan_gpt import BATCH, PLAN  # the example's plan: one copy

import vescale
from vescale.ddp import DistributedDataParallel
from vescale.plan import AlphaBeta, calibrate

FIXED = AlphaBeta((20e-6, 20e-6), (1e-9, 1e-9), 1e-10)  # as tests/plan/gpt_cases.py


def _step(model: torch.nn.Module, *inputs: torch.Tensor) -> float:
    start = time.perf_counter()
    model(*inputs).backward()
    synchronize(inputs[0].device.type)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    device = init_distributed(parser.parse_args().device)
    rank = dist.get_rank()
    mesh = vescale.init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    cfg = gpt.GPTConfig(vocab=1024)
    ids, tgt = gpt.batch(cfg, 0, device=device)
    out: dict[str, float] = {}

    start = time.perf_counter()
    ab = calibrate(mesh)
    out["calibrate"] = time.perf_counter() - start
    summaries = {}
    for solver in ("greedy", "global"):
        torch._dynamo.reset()
        start = time.perf_counter()
        model = vescale.parallelize(
            gpt.build(cfg, device=device),
            mesh,
            PLAN,
            inputs=[BATCH, BATCH],
            example_inputs=(ids, tgt),
            solver=solver,
            alpha_beta=FIXED,
        )
        out[f"plan {solver}: parallelize"] = time.perf_counter() - start
        out[f"plan {solver}: first step"] = _step(model, ids, tgt)
        out[f"plan {solver}: second step"] = _step(model, ids, tgt)
        summaries[solver] = model.explain().summary()

    torch._dynamo.reset()
    start = time.perf_counter()
    hand = DistributedDataParallel(gpt.parallelize(gpt.build(cfg, device=device), mesh))
    compiled = torch.compile(hand, backend="vescale")
    out["dtensor: parallelize"] = time.perf_counter() - start
    inputs = gpt.shard_batch(mesh, ids, tgt)
    out["dtensor: first step"] = _step(compiled, *inputs)
    out["dtensor: second step"] = _step(compiled, *inputs)

    if rank == 0:
        print("calibrated alpha (us) / beta (ns/B) per mesh dim, gamma (ns/B):")
        print(
            ", ".join(f"{a * 1e6:.1f} / {b * 1e9:.3f}" for a, b in zip(ab.alpha, ab.beta)),
            f"{ab.gamma * 1e9:.4f}",
        )
        print("| stage | s |\n|---|---|")
        for k, v in out.items():
            print(f"| {k} | {v:.2f} |")
        for solver, text in summaries.items():
            print(f"\n{solver}:\n{text}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
