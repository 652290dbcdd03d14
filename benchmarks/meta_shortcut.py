"""When does taking tensor meta from the local result (instead of upstream's sharding
propagation) pay off?

    python benchmarks/meta_shortcut.py [--device cpu|cuda]

``tanh`` on Replicate DTensors, fake process group, 2-rank mesh, one thread. "first call"
is a new shape (a sharding-cache miss: full propagation with fake tensors); "repeated" is
the median of 200 calls on that shape (upstream's C++ cache hit). The shortcut is
``bypass_sharding_prop`` returning Replicate, i.e. vescale's Python dispatch path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from launch import add_device_argument, select_device

import vescale
from vescale import Replicate
from vescale.dtensor import dispatch


def _us(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def _measure(mesh: vescale.DeviceMesh, rows: range) -> tuple[float, float]:
    first, repeated = [], []
    for n in rows:
        x = vescale.distribute_tensor(torch.randn(n, 64), mesh, [Replicate()])  # to mesh's device
        first.append(_us(lambda x=x: torch.tanh(x)))
        repeated.append(statistics.median(_us(lambda x=x: torch.tanh(x)) for _ in range(200)))
    return statistics.median(first), statistics.median(repeated)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    device = select_device(parser.parse_args().device)
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = vescale.init_device_mesh(device, (2,))
    up_first, up_rep = _measure(mesh, range(16, 48))
    dispatch.bypass_sharding_prop(torch.ops.aten.tanh.default)(lambda schema: (Replicate(),))
    sc_first, sc_rep = _measure(mesh, range(48, 80))
    print(f"{'path':<28} {'first call us':>14} {'repeated us':>12}")
    print(f"{'upstream propagation':<28} {up_first:>14.1f} {up_rep:>12.1f}")
    print(f"{'meta from local result':<28} {sc_first:>14.1f} {sc_rep:>12.1f}")
    print(
        f"shortcut: {up_first / sc_first:.1f}x faster on a new shape, "
        f"{sc_rep / up_rep:.1f}x slower on a repeated one"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
