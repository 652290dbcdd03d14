"""``vescale.fsdp.fully_shard`` (one flat buffer per block, RaggedShard parameters) against
upstream ``torch.distributed.fsdp.fully_shard`` (FSDP2, ``Shard(0)`` parameters), eager.

    torchrun --standalone --nproc-per-node 4 benchmarks/flat_fsdp.py [--steps 10] [--dim 128] [--device cpu|cuda]

The plain GPT of ``examples/gpt.py`` (``--dim``, 4 layers; batch 4 sequences per rank), each
block and the root sharded over the world (gloo, CPU), SGD. Each mode is built and warmed up;
then ``--steps`` rounds time one step of each mode in turn (medians on rank 0). Three more
steps of each run under the profiler, which sums the CPU time of the copies outside the
collectives per step (the median), by the ops that make them:

* FSDP2: all-gather copy-in (``fsdp::all_gather_copy_in``), copy-out
  (``fsdp::split_with_sizes_copy``), reduce-scatter copy-in (``fsdp::chunk_cat``);
* vescale.fsdp: none around the all-gather (it fills the buffer the parameters view); the
  reduce-scatter copy-in is one ``cat`` of the gradients into the flat gradient buffer
  (``vescale.fsdp::reduce_scatter_copy_in``).

Both modes run gloo's collectives, which (measured) copy inside themselves too: gloo's
all-gather receives into a temporary and copies each rank's part out; its reduce-scatter
clones the input and all-reduces it. Those copies are in the collective's time for both.
The two modes' first-step losses must agree within 1e-5 (the same model and batch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh as upstream_init_device_mesh
from torch.distributed.fsdp import fully_shard as upstream_fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import gpt
from launch import BACKENDS, add_device_argument, init_distributed

import vescale
from vescale.fsdp import fully_shard

COPIES = {
    "fsdp::all_gather_copy_in": "all-gather copy-in",
    "fsdp::split_with_sizes_copy": "all-gather copy-out",
    "fsdp::chunk_cat": "reduce-scatter copy-in",
    "vescale.fsdp::reduce_scatter_copy_in": "reduce-scatter copy-in",
}
LAYERS, BATCH = 4, 4


def _build(
    cfg: gpt.GPTConfig, shard: Callable[[torch.nn.Module], None], device: str
) -> Callable[[int], float]:
    model = gpt.build(cfg, device=device)
    for block in model.blocks:
        shard(block)
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rank = dist.get_rank()

    def step(i: int) -> float:
        ids, targets = gpt.batch(cfg, i, BATCH * dist.get_world_size(), device)
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        loss = model(ids[mine], targets[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach().item()

    return step


def _copy_ms(step: Callable[[int], float], steps: int = 3) -> dict[str, float]:
    """CPU milliseconds per copy kind and step (the rank's main thread), the median of
    ``steps`` profiled steps."""
    per_step: dict[str, list[float]] = {kind: [] for kind in sorted(set(COPIES.values()))}
    for i in range(steps):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step(i)
        got = dict.fromkeys(per_step, 0.0)
        for e in prof.profiler.kineto_results.events():
            if e.name() in COPIES:
                got[COPIES[e.name()]] += (e.end_ns() - e.start_ns()) / 1e6
        for kind, ms in got.items():
            per_step[kind].append(ms)
    return {kind: statistics.median(ms) for kind, ms in per_step.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dim", type=int, default=128)
    add_device_argument(parser)
    args = parser.parse_args()
    device = init_distributed(args.device, timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = gpt.GPTConfig(vocab=512, seq=64, dim=args.dim, heads=4, layers=LAYERS)
    up_mesh = upstream_init_device_mesh(device, (world,))
    mesh = vescale.init_device_mesh(device, (world,))
    modes = {
        "upstream FSDP2": _build(cfg, lambda m: upstream_fully_shard(m, mesh=up_mesh), device),
        "vescale.fsdp": _build(cfg, lambda m: fully_shard(m, mesh=mesh), device),
    }
    first = {name: step(0) for name, step in modes.items()}  # warm-up; same batch, same model
    losses = list(first.values())
    if abs(losses[0] - losses[1]) > 1e-5:
        raise SystemExit(f"first-step losses differ: {first}")
    times: dict[str, list[float]] = {name: [] for name in modes}
    for i in range(1, args.steps + 1):
        for name, step in modes.items():
            dist.barrier()
            start = time.perf_counter()
            step(i)
            times[name].append(time.perf_counter() - start)
    copies = {name: _copy_ms(step) for name, step in modes.items()}
    if rank != 0:
        dist.destroy_process_group()
        return
    kinds = list(next(iter(copies.values())))
    base = "upstream FSDP2"
    print(f"GPT dim={cfg.dim} layers={LAYERS} vocab={cfg.vocab} seq={cfg.seq}, batch {BATCH}/rank,")
    print(f"{world} {BACKENDS[device]} ranks, SGD; medians of {args.steps} steps (rank 0)\n")
    print(
        f"{'mode':<16}{'step ms':>10}" + "".join(f"{k:>24}" for k in kinds) + f"{'copies ms':>11}"
    )
    for name in modes:
        step_ms = statistics.median(times[name]) * 1e3
        total = sum(copies[name].values())
        cells = "".join(f"{copies[name][k]:>24.2f}" for k in kinds)
        print(f"{name:<16}{step_ms:>10.1f}{cells}{total:>11.2f}")
    ratio = statistics.median(times["vescale.fsdp"]) / statistics.median(times[base])
    up_copy, my_copy = sum(copies[base].values()), sum(copies["vescale.fsdp"].values())
    print(f"\nvescale.fsdp / upstream: step {ratio:.2f}x, copies {my_copy / up_copy:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
