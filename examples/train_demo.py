"""Tensor-parallel MLP training on a CPU mesh, eager and with ``backend="vescale"``,
checked step by step against the same model on one device.

    torchrun --standalone --nproc-per-node 4 examples/train_demo.py [--dump-dir DIR]

Megatron-style layout: the first linear is column-parallel (weight ``Shard(0)``), the second
row-parallel (weight ``Shard(1)``); its output is ``Partial`` and one explicit all-reduce
makes it ``Replicate``. Each step prints the tensor-parallel loss beside the loss of the
same model trained on a single device.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import vescale
from vescale import Replicate, Shard

D_IN, HIDDEN, D_OUT, BATCH = 16, 64, 8, 32


def init_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(HIDDEN, D_IN, generator=g) * D_IN**-0.5,
        "b1": torch.randn(HIDDEN, generator=g) * 0.1,
        "w2": torch.randn(D_OUT, HIDDEN, generator=g) * HIDDEN**-0.5,
        "b2": torch.randn(D_OUT, generator=g) * 0.1,
    }


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)


def mlp(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = F.gelu(x @ p["w1"].T + p["b1"])
    y = h @ p["w2"].T
    if isinstance(y, vescale.DTensor):
        y = y.redistribute(placements=[Replicate()])  # Partial -> Replicate: one all-reduce
    return y + p["b2"]


def train(model, params: dict[str, torch.Tensor], steps: int, lr: float, to_input) -> list[float]:
    opt = torch.optim.SGD(list(params.values()), lr=lr)
    losses = []
    for step in range(steps):
        x, target = batch(step)
        loss = F.mse_loss(model(params, to_input(x)), to_input(target))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(
            loss.full_tensor().item() if isinstance(loss, vescale.DTensor) else loss.item()
        )
    return losses


def tensor_parallel_losses(
    steps: int = 5, lr: float = 0.1, dump_dir: str | None = None
) -> tuple[list[float], list[float], list[float]]:
    """(eager TP losses, compiled TP losses, single-device losses) over ``steps`` SGD steps."""
    mesh = vescale.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    layout = {"w1": [Shard(0)], "b1": [Shard(0)], "w2": [Shard(1)], "b2": [Replicate()]}
    full = init_params()

    def sharded() -> dict[str, torch.Tensor]:
        return {
            k: vescale.distribute_tensor(v, mesh, layout[k]).requires_grad_(True)
            for k, v in full.items()
        }

    def replicated(t: torch.Tensor) -> torch.Tensor:
        return vescale.distribute_tensor(t, mesh, [Replicate()])

    options = {"dump_dir": dump_dir} if dump_dir else None
    compiled_mlp = torch.compile(mlp, backend="vescale", options=options)
    eager = train(mlp, sharded(), steps, lr, replicated)
    compiled = train(compiled_mlp, sharded(), steps, lr, replicated)
    single = {k: v.clone().requires_grad_(True) for k, v in full.items()}
    ref = train(mlp, single, steps, lr, lambda t: t)
    return eager, compiled, ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--dump-dir", default="vescale_dumps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    t0 = time.perf_counter()
    eager, compiled, ref = tensor_parallel_losses(args.steps, args.lr, args.dump_dir)
    worst = max(abs(a - c) for run in (eager, compiled) for a, c in zip(run, ref))
    if rank == 0:
        print(f"tensor-parallel MLP on {dist.get_world_size()} CPU ranks (gloo)")
        print(f"{'step':>4}  {'eager':>10}  {'vescale':>10}  {'1-device':>10}  {'max |diff|':>10}")
        for i, (a, b, c) in enumerate(zip(eager, compiled, ref)):
            print(
                f"{i:>4}  {a:>10.6f}  {b:>10.6f}  {c:>10.6f}  {max(abs(a - c), abs(b - c)):>10.2e}"
            )
        records = json.loads((Path(args.dump_dir) / "rank0" / "collectives.json").read_text())
        for r in records:
            print(
                f"collective: {r['graph']} {r['kind']} {r['bytes']} B over ranks {r['group_ranks']}"
                f" (mesh dim {r['mesh_dim']}) from {r['source']}"
            )
        print(
            f"graph dumps: {Path(args.dump_dir).resolve()}/rank*/ ({time.perf_counter() - t0:.1f} s)"
        )
        print(f"max |diff| = {worst:.2e} ({'OK' if worst <= 1e-5 else 'MISMATCH'}, tolerance 1e-5)")
    dist.barrier()
    dist.destroy_process_group()
    if worst > 1e-5:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
