"""Compile time of the demo's GPT training step: vescale backend vs upstream Inductor.

    torchrun --standalone --nproc-per-node 4 benchmarks/compile_time.py

Same DTensor model (``examples/gpt.py`` on a (world/2, 2) dp x tp mesh, DDP-wrapped) and inputs
for every backend; a throwaway Inductor compile first pays the
one-time Inductor start-up so it is charged to no one. Each figure is the first call of a
freshly reset ``torch.compile`` (forward compile + run, then backward compile + run), rank 0,
median over ``--repeats``, with Inductor's FX-graph and AOT-autograd caches off.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import gpt

import vescale
from vescale.ddp import DistributedDataParallel

BACKENDS = {
    "vescale (fx codegen)": ("vescale", {"codegen": "fx"}),
    "vescale (inductor)": ("vescale", {"codegen": "inductor"}),
    "upstream inductor": ("inductor", None),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch._inductor.config.fx_graph_cache = False  # measure compiling, not cache hits
    torch._functorch.config.enable_autograd_cache = False
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    mesh = vescale.init_device_mesh(
        "cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp")
    )
    cfg = gpt.GPTConfig()
    model = DistributedDataParallel(gpt.parallelize(gpt.build(cfg), mesh))
    inputs = gpt.shard_batch(mesh, *gpt.batch(cfg, 0))
    torch.compile(lambda a: a.sin() * 2)(torch.randn(8))  # Inductor start-up, charged to no one
    times: dict[str, list[float]] = {name: [] for name in BACKENDS}
    for _ in range(args.repeats):
        for name, (backend, options) in BACKENDS.items():
            torch._dynamo.reset()
            step = torch.compile(model, backend=backend, options=options)
            dist.barrier()
            t0 = time.perf_counter()
            step(*inputs).backward()
            times[name].append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        base = statistics.median(times["upstream inductor"])
        print(f"{'backend':<22} {'compile s':>10} {'vs inductor':>12}")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{name:<22} {med:>10.2f} {med / base:>11.2f}x")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
