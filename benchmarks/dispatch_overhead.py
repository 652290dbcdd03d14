"""Eager per-op dispatch cost: plain torch vs upstream DTensor vs vescale DTensor.

    python benchmarks/dispatch_overhead.py [--batches 300 --calls 20] [--interleaved]
        [--device cpu|cuda]

Each variant runs in its own process, on the single-process ``fake`` process group with a
2-rank mesh, one thread, 64x64 float32 tensors on ``--device`` (the host's cost per call): ``upstream`` is upstream DTensor without
vescale imported, ``up+import`` the same upstream program in a process that imported vescale
(it must cost what it cost before), ``vescale`` vescale DTensors, ``vescale+hook`` with a
hook registered on an op the benchmark never calls. Placement ``mixed`` is ``Shard(0)`` op
``Replicate`` (the Replicate input is sliced locally by dispatch). A figure is the median
over ``batches`` of the mean time of ``calls`` back-to-back calls, in microseconds.

``--interleaved`` (for a shared, noisy machine): upstream DTensors (``up+import``) and vescale
DTensors in one process, their batches alternating, so both see the same load; a figure is
the minimum over ``batches``, and ``vescale/up`` compares those minima.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

OPS = ["add", "mul", "relu", "mm", "addmm", "view", "sum", "layer_norm", "softmax"]
PLACEMENTS = ["Replicate", "Shard(0)", "mixed"]
MIXED_OPS = ["add", "mul"]
VARIANTS = ["torch", "upstream", "up+import", "vescale", "vescale+hook"]
_DEVICE_HELP = "as examples/launch.py's --device (default: cuda when a GPU is present)"


def _op_fns(torch: Any, F: Any, x: Any, y: Any, c: Any, w: Any, *, sharded: bool) -> dict[str, Any]:
    if sharded is None:  # mixed: x Shard(0), y Replicate
        return {"add": lambda: x + y, "mul": lambda: x * y}
    return {
        "add": lambda: x + x,
        "mul": lambda: x * x,
        "relu": lambda: torch.relu(x),
        "mm": lambda: torch.mm(x, y),
        "addmm": lambda: torch.addmm(c, x, y),
        "view": lambda: x.view(-1, 32, 2) if sharded else x.view(4096),
        "sum": lambda: x.sum(),
        "layer_norm": lambda: F.layer_norm(x, (64,), w),
        "softmax": lambda: torch.softmax(x, -1),
    }


def _worker(variant: str, batches: int, calls: int, device: str) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if variant.startswith("vescale"):
        from vescale import Replicate, Shard, distribute_tensor, init_device_mesh
    else:
        if variant == "up+import":
            import vescale  # noqa: F401
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    if variant == "vescale+hook":  # a hook on an op the benchmark never calls
        from vescale.dtensor.dispatch import pre_dispatch_patch

        pre_dispatch_patch(torch.ops.aten.cos.default)(lambda op, args, kwargs: (args, kwargs))

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh(device, (2,))
    torch.manual_seed(0)
    a, b, bias = (torch.randn(*s).to(device) for s in ((64, 64), (64, 64), (64,)))
    ln_w = torch.ones(64, device=device)
    results: dict[str, float] = {}
    for pname in PLACEMENTS:
        if variant == "torch":
            x, y, c, w = a, b, bias, ln_w
        else:
            place = [Replicate()] if pname == "Replicate" else [Shard(0)]
            x = distribute_tensor(a, mesh, place)
            y = distribute_tensor(b, mesh, [Replicate()])
            c = distribute_tensor(bias, mesh, [Replicate()])
            w = distribute_tensor(ln_w, mesh, [Replicate()])
        sharded = None if pname == "mixed" else pname != "Replicate"
        fns = _op_fns(torch, F, x, y if variant != "torch" else b, c, w, sharded=sharded)  # type: ignore[arg-type]
        for op in MIXED_OPS if pname == "mixed" else OPS:
            fn = fns[op]
            for _ in range(200):
                fn()
            means = []
            for _ in range(batches):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                means.append((time.perf_counter() - t0) / calls * 1e6)
            results[f"{op}/{pname}"] = statistics.median(means)
    dist.destroy_process_group()
    return results


def _interleaved(batches: int, calls: int, device: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.tensor as upstream
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh as upstream_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import vescale
    from vescale import Replicate, Shard

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    make = {
        "upstream": (upstream_mesh(device, (2,)), upstream.distribute_tensor),
        "vescale": (vescale.init_device_mesh(device, (2,)), vescale.distribute_tensor),
    }
    torch.manual_seed(0)
    a, b, bias = (torch.randn(*s).to(device) for s in ((64, 64), (64, 64), (64,)))
    ln_w = torch.ones(64, device=device)
    print(f"{'op':<11} {'placement':<10} {'upstream':>9} {'vescale':>8} {'vescale/up':>10}")
    ratios = []
    for pname in PLACEMENTS:
        fns = {}
        for variant, (mesh, distribute) in make.items():
            place = [Replicate()] if pname == "Replicate" else [Shard(0)]
            x, y, c, w = (
                distribute(t, mesh, p)
                for t, p in (
                    (a, place),
                    (b, [Replicate()]),
                    (bias, [Replicate()]),
                    (ln_w, [Replicate()]),
                )
            )
            sharded = None if pname == "mixed" else pname != "Replicate"
            fns[variant] = _op_fns(torch, F, x, y, c, w, sharded=sharded)  # type: ignore[arg-type]
        for op in MIXED_OPS if pname == "mixed" else OPS:
            best = {}
            for variant in fns:
                for _ in range(200):
                    fns[variant][op]()
                best[variant] = float("inf")
            for i in range(batches):
                for variant in sorted(fns, reverse=bool(i % 2)):
                    fn = fns[variant][op]
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    best[variant] = min(best[variant], (time.perf_counter() - t0) / calls * 1e6)
            u, v = best["upstream"], best["vescale"]
            ratios.append(v / u)
            print(f"{op:<11} {pname:<10} {u:>9.2f} {v:>8.2f} {v / u:>10.2f}")
    print(f"median over {len(ratios)} op/placement pairs: vescale/upstream = "
          f"{statistics.median(ratios):.2f}x (min over batches, us per call)")  # fmt: skip
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--interleaved", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help=_DEVICE_HELP)
    args = parser.parse_args()
    if args.worker:  # the parent chose the device; a worker imports no more than its variant
        print(json.dumps(_worker(args.worker, args.batches, args.calls, args.device)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from launch import select_device

    device = select_device(args.device)
    if args.interleaved:
        _interleaved(args.batches, args.calls, device)
        return
    runs = {}
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--worker", variant, "--device", device]
        cmd += ["--batches", str(args.batches), "--calls", str(args.calls)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        runs[variant] = json.loads(out.strip().splitlines()[-1])
    head = f"{'op':<11} {'placement':<10} {'torch':>7} {'upstream':>9} {'up+import':>9}"
    head += f" {'vescale':>8} {'v+hook':>7} {'up+imp/up':>9} {'vescale/up':>10} {'hook/up':>8}"
    print(head)
    ratios: dict[str, list[float]] = {"up+import": [], "vescale": [], "vescale+hook": []}
    for key in runs["upstream"]:
        op, pname = key.split("/")
        t, u, ui, v, h = (runs[k][key] for k in VARIANTS)
        for name, value in (("up+import", ui), ("vescale", v), ("vescale+hook", h)):
            ratios[name].append(value / u)
        print(
            f"{op:<11} {pname:<10} {t:>7.2f} {u:>9.2f} {ui:>9.2f} {v:>8.2f} {h:>7.2f}"
            f" {ui / u:>9.2f} {v / u:>10.2f} {h / u:>8.2f}"
        )
    medians = ", ".join(f"{k}/upstream = {statistics.median(r):.2f}x" for k, r in ratios.items())
    print(f"median over {len(ratios['vescale'])} op/placement pairs: {medians} (us per call)")


if __name__ == "__main__":
    main()
