"""Does the plan path's cost model rank programs as the clock does? Predicted vs measured
step time of one GPT under several programs forced by plans.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/planner_accuracy.py \\
        [--model tiny|medium] [--steps 7] [--only NAME ...] [--device cpu|cuda]

The GPT of ``examples/gpt.py`` (tiny: vocab 128, seq 32, dim 64, heads 4, 4 layers; medium:
vocab 1024, seq 128, dim 256, heads 8, 4 layers), global batch 8, on a (dp=2, tp=2) mesh;
a step is forward, backward and an SGD step. Each program is ``vescale.parallelize`` of the
plain model with one plan (:data:`PROGRAMS`) and the costs of ``vescale.plan.calibrate``
(cached per machine and mesh), compiled by the vescale backend (``codegen="fx"``: the graphs
run op by op, as the cost model prices them, and compile in seconds). A plan fixes the
parameters and the batch; the solver ("global", or "greedy": op by op as eager dispatch,
which follows the parameters' layout as a hand-written program would) places the rest.

Predicted, in the one cost model (:mod:`vescale.cost`): ``planner`` is the solver's estimate
of the joint graph (``explain().solution``, less the data-parallel penalty if it took one)
plus the SGD step (one op per parameter over its local bytes); ``timeline`` the
``schedule.json`` timeline of the compiled graphs (after the bucket pass: the collectives the
step really issues) plus the same SGD estimate; a program whose capture failed runs eagerly
(no timeline, shown as such, left out of the "compiled programs only" correlations). Measured: every program is built and warmed
up, then ``--steps`` rounds time one step of each in turn (rank 0's medians: a shared
machine's load drifts, so all medians come from the same stretch). Printed: the table,
Spearman's rank correlation of each prediction with the measurements, and the solver's
choice (``solver``: an empty plan, the batch free over both mesh dims) against the fastest
measured program.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import gpt
from launch import add_device_argument, init_distributed, synchronize

import vescale
from vescale import Replicate, Shard
from vescale.backend import capture_graphs
from vescale.cost import CostModel
from vescale.fx.timeline import timeline
from vescale.plan import Batch, calibrate
from vescale.plan.cost import local_bytes

MODELS = {
    "tiny": gpt.GPTConfig(vocab=128, seq=32, dim=64, heads=4, layers=4),
    "medium": gpt.GPTConfig(vocab=1024, seq=128, dim=256, heads=8, layers=4),
}
R, S0, S1 = Replicate(), Shard(0), Shard(1)
REP = {"*": (R, R)}
TP = {  # Megatron over tp (gpt.PLAN: q/k/v, fc column-parallel, projections row-parallel)
    "blocks.*.attn.[qkv].*": (R, S0),
    "blocks.*.mlp.fc.*": (R, S0),
    "blocks.*.*.proj.weight": (R, S1),
    "head.weight": (R, S0),
}
FSDP_TP = {  # 2-D: the tp shards above, each also sharded over dp
    "blocks.*.attn.[qkv].*": (S0, S0),
    "blocks.*.mlp.fc.*": (S0, S0),
    "blocks.*.*.proj.weight": (S0, S1),
    "head.weight": (S0, S0),
    "*": (S0, R),
}
SOLVER_PLAN = {  # examples/plan_gpt.py: a few weights named, the compiler places the rest
    "blocks.*.attn.[qkv].weight": (R, S0),
    "blocks.*.mlp.fc.weight": (R, S0),
    "blocks.*.*.proj.weight": (R, S1),
    "head.weight": (R, S0),
}
DP, DP4, SEQ = (S0, R), (S0, S0), (S0, S1)


@dataclass(frozen=True)
class Program:
    plan: dict[str, Any]
    batch: Any  # the placements of both inputs, or a Batch
    solver: str


PROGRAMS = {
    "DDP-4": Program(REP, DP4, "greedy"),
    "FSDP-4": Program({"*": (S0, S0)}, DP4, "greedy"),
    "DP-2, tp replicated": Program(REP, DP, "greedy"),
    "replicated parameters and batch": Program(REP, (R, R), "greedy"),  # greedy splits the batch
    "Megatron": Program({**TP, "*": (R, R)}, DP, "greedy"),
    "Megatron+SP": Program({**TP, "*": (R, R)}, SEQ, "greedy"),
    "2-D FSDPxTP": Program(FSDP_TP, DP, "greedy"),
    "Megatron weights, global": Program({**TP, "*": (R, R)}, DP, "global"),
    "solver, weights named": Program(SOLVER_PLAN, DP, "global"),
    "solver": Program({}, Batch("dp", "tp"), "global"),  # empty plan, the batch free
}


@dataclass
class Row:
    planner_us: float
    timeline_us: float
    optimizer_us: float
    collectives: int
    step: Callable[[int], Any]
    times: list[float] = field(default_factory=list)


def _optimizer_us(model: torch.nn.Module, cost: CostModel, mesh_shape: tuple[int, ...]) -> float:
    """SGD: one update op per parameter over its local bytes (parameter, gradient, result)."""
    total = 0.0
    for p in model.parameters():
        placements = tuple(getattr(p, "placements", ()))
        held = local_bytes(placements, tuple(p.shape), p.element_size(), mesh_shape)
        total += cost.compute_s(0.0, 3 * held)
    return total * 1e6


def _timeline_us(graphs: list[Any]) -> tuple[float, int]:
    """Estimated time of the compiled graphs run one after another, and their collectives."""
    total, collectives = 0.0, 0
    for g in graphs:
        events = timeline(g.gm, g.name)
        total += max((e["ts"] + e["dur"] for e in events), default=0.0)
        collectives += sum(e["tid"] == "communication" for e in events)
    return total, collectives


def _build(cfg: gpt.GPTConfig, mesh: Any, program: Program, cost: CostModel) -> Row:
    model = vescale.parallelize(
        gpt.build(cfg, device=mesh.device_type),
        mesh,
        program.plan,
        inputs=[program.batch, program.batch],
        example_inputs=gpt.batch(cfg, 0, device=mesh.device_type),
        solver=program.solver,
        alpha_beta=cost,
        options={"codegen": "fx"},
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [gpt.batch(cfg, i, device=mesh.device_type) for i in range(4)]

    def step(i: int) -> Any:
        loss = model(*batches[i % len(batches)])
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    with capture_graphs() as graphs:
        step(0)
    step(1)
    step(2)
    planner = model.explain().step_us
    assert planner is not None
    tl_us, collectives = _timeline_us(graphs) if graphs else (math.nan, -1)  # -1: eager
    opt_us = _optimizer_us(model.module, cost, tuple(mesh.shape))
    return Row(planner + opt_us, tl_us + opt_us, opt_us, collectives, step)


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--only", nargs="*", default=None, help="program names to run")
    add_device_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = init_distributed(args.device, timeout=timedelta(seconds=900))
    mesh = vescale.init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    rank0 = dist.get_rank() == 0
    cfg = MODELS[args.model]
    start = time.perf_counter()
    cost = calibrate(mesh)
    if rank0:
        print(f"{args.model} GPT {cfg}, load average {os.getloadavg()[0]:.1f}")
        print(
            f"calibrated in {time.perf_counter() - start:.1f} s: alpha (us) "
            f"{[round(a * 1e6, 1) for a in cost.alpha]}, beta (ns/B) "
            f"{[round(b * 1e9, 3) for b in cost.beta]}, groups "
            f"{[(d, round(a * 1e6, 1), round(b * 1e9, 3)) for d, a, b in cost.groups]}, "
            f"kinds {[(k, round(f, 2)) for k, f in cost.kinds]}, "
            f"gamma {cost.gamma * 1e9:.4f} ns/B, matmul {cost.flops_rate / 1e9:.2f} GFLOP/s, "
            f"op {cost.op_s * 1e6:.1f} us",
            flush=True,
        )
    rows: dict[str, Row] = {}
    for name, program in PROGRAMS.items():
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        try:  # a program the plan path cannot run fails alike on every rank: left out
            rows[name] = _build(cfg, mesh, program, cost)
        except Exception as err:
            if rank0:
                line = (str(err).strip().splitlines() or [""])[-1][:200]
                print(f"FAILED {name}: {type(err).__name__}: {line}", flush=True)
            dist.barrier()
            continue
        if rank0:
            print(f"built {name} in {time.perf_counter() - t0:.0f} s", flush=True)
    for i in range(args.steps):
        for row in rows.values():
            dist.barrier()
            t0 = time.perf_counter()
            row.step(3 + i)
            synchronize(device)
            row.times.append(time.perf_counter() - t0)
    if rank0:
        _report(rows)
    dist.barrier()
    dist.destroy_process_group()


def _report(rows: dict[str, Row]) -> None:
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(
        "| program | planner ms | timeline ms | measured ms (median) | collectives/step |\n"
        "|---|---|---|---|---|"
    )
    measured = {n: statistics.median(r.times) * 1e3 for n, r in rows.items()}
    for name, row in rows.items():
        print(
            f"| {name} | {row.planner_us / 1e3:.1f} | {row.timeline_us / 1e3:.1f} | "
            f"{measured[name]:.1f} | "
            f"{row.collectives if row.collectives >= 0 else 'eager (capture failed)'} |"
        )
    names = list(rows)
    meas = [measured[n] for n in names]
    compiled = [n for n in names if rows[n].collectives >= 0]
    for label, pred in (
        ("planner", [rows[n].planner_us for n in names]),
        ("planner, compiled programs only", [rows[n].planner_us for n in compiled]),
        ("timeline, compiled programs only", [rows[n].timeline_us for n in compiled]),
    ):
        sub = meas if len(pred) == len(names) else [measured[n] for n in compiled]
        print(f"Spearman({label}, measured) = {_spearman(pred, sub):.3f}")
    if "solver" in measured:
        best = min(meas)
        fastest = names[meas.index(best)]
        print(
            f"solver's choice {measured['solver']:.1f} ms = {measured['solver'] / best:.2f}x "
            f"the fastest measured ({fastest}, {best:.1f} ms)"
        )


if __name__ == "__main__":
    main()
