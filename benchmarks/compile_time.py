"""Compile time of the demo's GPT training step: vescale backend vs upstream Inductor, and
cold vs warm start (a second process reusing the compile caches).

    torchrun --standalone --nproc-per-node 4 benchmarks/compile_time.py [--repeats 3] [--device cpu|cuda]
    python benchmarks/compile_time.py --warm-start [--nproc 4]

Same DTensor model (``examples/gpt.py`` on a (world/2, 2) dp x tp mesh, DDP-wrapped) and inputs
for every backend; a throwaway Inductor compile first pays the one-time Inductor start-up so
it is charged to no one. Each figure is the first call of a freshly reset ``torch.compile``
(forward compile + run, then backward compile + run), rank 0.

* Default: median over ``--repeats`` in one process, Inductor's FX-graph and AOT-autograd
  caches off (compiling, not cache hits).
* ``--warm-start``: for each backend, two ``torchrun`` jobs one after the other with caches on
  and one fresh ``TORCHINDUCTOR_CACHE_DIR``: the first compiles cold, the second finds what
  the first stored. The vescale backend's graphs reach Inductor after its passes, so the FX
  graph cache is keyed on the post-pass graph: a changed option or placement that changes
  the graph compiles anew (``tests/test_compile_cache.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import gpt
from launch import add_device_argument, init_distributed, synchronize

import vescale
from vescale.ddp import DistributedDataParallel

BACKENDS = {
    "vescale (fx codegen)": ("vescale", {"codegen": "fx"}),
    "vescale (inductor)": ("vescale", {"codegen": "inductor"}),
    "upstream inductor": ("inductor", None),
}
WARM_BACKENDS = ("vescale (inductor)", "upstream inductor")


def _first_step(name: str, device: str) -> tuple[float, str]:
    """Seconds of the first compiled step of backend ``name`` on ``device``, and Inductor's
    cache counters."""
    backend, options = BACKENDS[name]
    mesh = vescale.init_device_mesh(
        device, (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp")
    )
    cfg = gpt.GPTConfig()
    model = DistributedDataParallel(gpt.parallelize(gpt.build(cfg, device=device), mesh))
    inputs = gpt.shard_batch(mesh, *gpt.batch(cfg, 0, device=device))
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(model, backend=backend, options=options)
    dist.barrier()
    t0 = time.perf_counter()
    step(*inputs).backward()
    synchronize(device)
    cache = {
        k: v
        for group in ("inductor", "aot_autograd")
        for k, v in counters[group].items()
        if "cache" in k
    }
    return time.perf_counter() - t0, " ".join(f"{k}={v}" for k, v in sorted(cache.items()))


def _compile_times(repeats: int, device: str) -> None:
    torch._inductor.config.fx_graph_cache = False  # measure compiling, not cache hits
    torch._functorch.config.enable_autograd_cache = False
    times: dict[str, list[float]] = {name: [] for name in BACKENDS}
    for _ in range(repeats):
        for name in BACKENDS:
            times[name].append(_first_step(name, device)[0])
    if dist.get_rank() == 0:
        base = statistics.median(times["upstream inductor"])
        print(f"{'backend':<22} {'compile s':>10} {'vs inductor':>12}")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{name:<22} {med:>10.2f} {med / base:>11.2f}x")


def _warm_start(nproc: int, device: str | None) -> None:
    """Cold then warm first step of each of :data:`WARM_BACKENDS` (see module docstring)."""
    rows = []
    for name in WARM_BACKENDS:
        with tempfile.TemporaryDirectory() as cache_dir:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "OMP_NUM_THREADS": "1"}
            runs = []
            for _ in ("cold", "warm"):
                out = subprocess.run(
                    [sys.executable, "-m", "torch.distributed.run", "--standalone",
                     f"--nproc-per-node={nproc}", __file__, "--first-step", name,
                     *(["--device", device] if device else [])],
                    env=env, capture_output=True, text=True, check=True,
                ).stdout  # fmt: skip
                found = re.search(r"first_step_s=(\S+) (.*)", out)
                assert found, out
                runs.append((float(found.group(1)), found.group(2)))
            rows.append((name, runs))
    print(f"{'backend':<20} {'cold s':>8} {'warm s':>8} {'warm/cold':>10}  caches (cold | warm)")
    for name, ((cold, cold_c), (warm, warm_c)) in rows:
        print(f"{name:<20} {cold:>8.2f} {warm:>8.2f} {warm / cold:>10.2f}  {cold_c} | {warm_c}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm-start", action="store_true")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--first-step", choices=list(BACKENDS), help=argparse.SUPPRESS)
    add_device_argument(parser)
    args = parser.parse_args()
    if args.warm_start:
        _warm_start(args.nproc, args.device)
        return
    torch.set_num_threads(1)
    device = init_distributed(args.device, timeout=timedelta(seconds=300))
    torch.compile(lambda a: a.sin() * 2)(torch.randn(8))  # Inductor start-up, charged to no one
    if args.first_step:
        seconds, cache = _first_step(args.first_step, device)
        if dist.get_rank() == 0:
            print(f"first_step_s={seconds:.3f} {cache}")
    else:
        _compile_times(args.repeats, device)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
