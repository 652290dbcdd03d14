"""Tensor-parallel MLP training on a CPU mesh, checked step by step against one device.

    torchrun --standalone --nproc-per-node 4 examples/train_demo.py

Megatron-style layout: the first linear is column-parallel (weight ``Shard(0)``), the second
row-parallel (weight ``Shard(1)``); its output is ``Partial`` and one explicit all-reduce
makes it ``Replicate``. Each step prints the tensor-parallel loss beside the loss of the
same model trained on a single device.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

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


def train(params: dict[str, torch.Tensor], steps: int, lr: float, to_input) -> list[float]:
    opt = torch.optim.SGD(list(params.values()), lr=lr)
    losses = []
    for step in range(steps):
        x, target = batch(step)
        loss = F.mse_loss(mlp(params, to_input(x)), to_input(target))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(
            loss.full_tensor().item() if isinstance(loss, vescale.DTensor) else loss.item()
        )
    return losses


def tensor_parallel_losses(steps: int = 5, lr: float = 0.1) -> tuple[list[float], list[float]]:
    """(tensor-parallel losses, single-device losses) over ``steps`` SGD steps."""
    mesh = vescale.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    layout = {"w1": [Shard(0)], "b1": [Shard(0)], "w2": [Shard(1)], "b2": [Replicate()]}
    full = init_params()
    sharded = {
        k: vescale.distribute_tensor(v, mesh, layout[k]).requires_grad_(True)
        for k, v in full.items()
    }
    replicated = lambda t: vescale.distribute_tensor(t, mesh, [Replicate()])  # noqa: E731
    tp = train(sharded, steps, lr, replicated)
    ref = train(
        {k: v.clone().requires_grad_(True) for k, v in full.items()}, steps, lr, lambda t: t
    )
    return tp, ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    tp, ref = tensor_parallel_losses(args.steps, args.lr)
    worst = max(abs(a - b) for a, b in zip(tp, ref))
    if rank == 0:
        print(f"tensor-parallel MLP on {dist.get_world_size()} CPU ranks (gloo)")
        print(f"{'step':>4}  {'tp loss':>12}  {'1-device loss':>13}  {'|diff|':>9}")
        for i, (a, b) in enumerate(zip(tp, ref)):
            print(f"{i:>4}  {a:>12.6f}  {b:>13.6f}  {abs(a - b):>9.2e}")
        print(f"max |diff| = {worst:.2e} ({'OK' if worst <= 1e-5 else 'MISMATCH'}, tolerance 1e-5)")
    dist.barrier()
    dist.destroy_process_group()
    if worst > 1e-5:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
