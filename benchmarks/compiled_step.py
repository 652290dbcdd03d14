"""Full training step of a dp x tp GPT: eager vescale vs upstream Inductor vs the vescale
backend with its communication passes off and on (and a bucket-cap sweep).

    torchrun --standalone --nproc-per-node 4 benchmarks/compiled_step.py [--steps 20]

Same DTensor model for every mode: ``examples/gpt.py`` with 4 blocks (14 parameter tensors
each) on a (world/2, 2) mesh, wrapped in ``vescale.ddp.DistributedDataParallel`` so every
gradient is reduced to its parameter's placements; a step is forward, backward and an SGD
step. Step time is the median over ``--steps`` after two warm-up steps (rank 0); compile
time is the first step minus that median. Collectives and bytes per step are counted with
the profiler (every ``_c10d_functional`` collective, wherever it is issued, Inductor's
in-place variants included; bytes of this rank's inputs).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import gpt

import vescale
from vescale.backend import PASSES_OFF
from vescale.ddp import DistributedDataParallel

CFG = gpt.GPTConfig(vocab=128, seq=32, dim=64, heads=4, layers=4)
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


def _is_collective(name: str) -> bool:
    """A ``_c10d_functional`` collective, functional or Inductor's in-place/out variants."""
    return name.startswith("_c10d_functional::") and not name.endswith(_NOT_COLLECTIVES)


def _count(step: Callable[[], None]) -> tuple[int, int]:
    """(collectives, bytes) one call of ``step`` issues on this rank."""
    with torch.profiler.profile(record_shapes=True) as prof:
        step()
    n = nbytes = 0
    for e in prof.events():
        parent, nested = e.cpu_parent, False
        while parent is not None and not nested:
            nested, parent = _is_collective(parent.name), parent.cpu_parent
        if _is_collective(e.name) and not nested:
            n += 1
            shape = e.input_shapes[0] if e.input_shapes else []
            nbytes += 4 * int(torch.Size(shape).numel())  # float32 model
    return n, nbytes


def _run(mesh: vescale.DeviceMesh, backend: str | None, options: dict | None, steps: int):
    torch._dynamo.reset()
    model: torch.nn.Module = DistributedDataParallel(gpt.parallelize(gpt.build(CFG), mesh))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if backend is not None:
        model = torch.compile(model, backend=backend, options=options)
    batches = [gpt.shard_batch(mesh, *gpt.batch(CFG, i)) for i in range(4)]

    def step(i: int = 0) -> None:
        loss = model(*batches[i % len(batches)])
        opt.zero_grad()
        loss.backward()
        opt.step()

    times = []
    for i in range(steps + 3):
        dist.barrier()
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times[3:])
    return median, times[0] - median, *_count(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sweep", type=float, nargs="*", default=[0.25, 1.0, 25.0])
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    mesh = vescale.init_device_mesh(
        "cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp")
    )
    torch.compile(lambda a: a.sin() * 2)(torch.randn(8))  # Inductor start-up, charged to no one
    modes: dict[str, tuple[str | None, dict | None]] = {
        "eager vescale": (None, None),
        "upstream inductor": ("inductor", None),
        "vescale, passes off": ("vescale", PASSES_OFF),
        "vescale, passes on": ("vescale", {}),
    }
    for cap in args.sweep:
        modes[f"  bucket_cap_mb={cap:g}"] = ("vescale", {"bucket_cap_mb": cap})
    rows = {name: _run(mesh, backend, opts, args.steps) for name, (backend, opts) in modes.items()}
    if dist.get_rank() == 0:
        base = rows["eager vescale"][0]
        print(f"GPT {CFG}, (dp={mesh.size(0)}, tp={mesh.size(1)}) gloo CPU ranks, SGD step")
        head = f"{'mode':<22} {'step ms':>8} {'vs eager':>9} {'colls/step':>10} {'KiB/step':>9} {'compile s':>9}"
        print(head)
        for name, (med, compile_s, n, nbytes) in rows.items():
            compile_txt = f"{compile_s:>9.1f}" if name != "eager vescale" else f"{'-':>9}"
            print(
                f"{name:<22} {med * 1e3:>8.2f} {med / base:>8.2f}x {n:>10} "
                f"{nbytes / 1024:>9.1f} {compile_txt}"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
