"""Step time of a model laid out by upstream tools, compiled with ``backend="vescale"`` vs
``backend="inductor"`` (issue 13 item 3).

    torchrun --standalone --nproc-per-node 4 benchmarks/interop_step.py [--steps 10] [--width 256] [--device cpu|cuda]

The model is ``--layers`` sequence-parallel MLP blocks (LayerNorm with ``SequenceParallel``,
``ColwiseParallel`` then ``RowwiseParallel``), laid out by upstream ``parallelize_module`` over
"tp" and wrapped by FSDP2 ``fully_shard`` (each block and the root) over "dp" of a 2 x (world/2)
mesh, in a process that imported vescale. A step is forward, backward and an AdamW step; the
step function (not the FSDP2 module, whose hooks Dynamo does not trace) is compiled. Prints per
mode the median step time over ``--steps`` after three warm-up steps (rank 0), the compile time
(first step minus the median), the graphs and graph breaks Dynamo counted, and the largest loss
difference from eager. ``dynamic=False``: each block recompiles ``Block.forward`` and automatic
dynamic shapes then fail in upstream DTensor sharding propagation ("unhashable type:
non-nested SymInt"), with either backend and without vescale imported.
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
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from launch import add_device_argument, init_distributed, synchronize

import vescale  # noqa: F401  (the process imported vescale; registers the backend)


class Block(nn.Module):
    """``x + w2(relu(w1(norm(x))))`` with hidden size ``4 * width``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.w1 = nn.Linear(width, 4 * width)
        self.w2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


PLAN = {
    "norm": SequenceParallel(),
    "w1": ColwiseParallel(input_layouts=Shard(1)),
    "w2": RowwiseParallel(output_layouts=Shard(1)),
}


def build(mesh: DeviceMesh, width: int, layers: int) -> nn.Module:
    """Blocks with the same initial weights on every rank and in every mode."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(width) for _ in range(layers)]).to(mesh.device_type)
    for block in model:
        parallelize_module(block, mesh["tp"], PLAN)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Forward and backward; the loss is the mean square of the (sequence-sharded) output."""
    out = model(x)
    loss = (out * out).mean()
    loss.backward()
    return loss.detach()


def run(
    mode: str, mesh: DeviceMesh, x: torch.Tensor, args: argparse.Namespace
) -> tuple[list[float], list[float], int, int]:
    """Losses and step times (seconds) of ``--steps + 3`` steps, graphs and graph breaks."""
    torch._dynamo.reset()
    counters.clear()
    model = build(mesh, args.width, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = (
        step if mode == "eager" else torch.compile(step, backend=mode, dynamic=False)
    )
    losses, times = [], []
    for _ in range(args.steps + 3):
        dist.barrier()
        start = time.perf_counter()
        loss = fn(model, x)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        synchronize(mesh.device_type)
        times.append(time.perf_counter() - start)
        losses.append(float((loss.full_tensor() if isinstance(loss, DTensor) else loss).item()))
    return losses, times, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--backends", nargs="+", default=["vescale", "inductor"])
    add_device_argument(ap)
    args = ap.parse_args()
    device = init_distributed(args.device)
    torch.set_num_threads(1)
    ws = dist.get_world_size()
    mesh = init_device_mesh(device, (2, ws // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(1)
    x = torch.randn(8, args.seq, args.width).to(device)
    x = x.chunk(2, dim=0)[mesh["dp"].get_local_rank()]
    x = x.chunk(ws // 2, dim=1)[mesh["tp"].get_local_rank()]
    results: dict[str, tuple[list[float], list[float], int, int] | str] = {}
    for mode in ["eager", *args.backends]:
        try:
            results[mode] = run(mode, mesh, x, args)
        except Exception as e:  # a backend that cannot compile this model: say why, go on
            results[mode] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
    if dist.get_rank() == 0:
        eager = results["eager"][0]  # always first: the reference losses
        print(f"{ws} ranks, mesh (dp=2, tp={ws // 2}), {args.layers} blocks, width {args.width}")
        print("| mode | step ms (median) | compile s | graphs | graph breaks | max loss diff |")
        print("|---|---|---|---|---|---|")
        for mode, res in results.items():
            if isinstance(res, str):
                print(f"| {mode} | failed: {res} | | | | |")
                continue
            losses, times, graphs, breaks = res
            med = statistics.median(times[3:])
            diff = max(abs(a - b) for a, b in zip(losses, eager))
            print(
                f"| {mode} | {med * 1e3:.1f} | {times[0] - med:.1f} | {graphs} | {breaks} "
                f"| {diff:.1e} |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
