"""Muon on a flat-buffer FSDP model: each 2-D weight's update orthogonalized whole on one rank.

    torchrun --standalone --nproc-per-node 4 examples/muon.py [--steps N] [--device cpu|cuda]

Muon (Keller Jordan et al.) replaces a weight matrix's momentum update by its nearest
semi-orthogonal matrix (a Newton-Schulz iteration): it needs the *whole* matrix. Under
``vescale.fsdp.fully_shard`` each weight is a ``RaggedShard`` DTensor whose rows are spread
over the ranks. :class:`Muon` keeps the momentum on each rank's rows (element-wise, no
communication), then, per matrix:

1. gather: ``redistribute`` the update to ``RaggedShard`` with every unit on one *owner*
   rank (owners chosen by load balance: :func:`owners`, largest Newton-Schulz cost first,
   to the least loaded rank);
2. compute: Newton-Schulz on the owner only;
3. scatter: ``redistribute`` back to the weight's placements; each rank applies its rows.

On plain tensors (one device) the same class runs steps 2 and 3 in place: the distributed
result equals it (``tests/fsdp/test_muon.py``, float64). The other parameters (embeddings,
head, biases, norms) take AdamW, as in the Muon reference setup.

Each rank prints the loss of its own slice of the random batch (``gpt.batch``): it stays near
``ln(64) = 4.16``. ``tests/fsdp/test_muon.py`` checks the updates against Muon on one device.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpt
from launch import add_device_argument, init_distributed

import vescale
from vescale import RaggedShard
from vescale.fsdp import fully_shard

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of Muon: ``g`` mapped to (about) ``U V^T`` of its
    SVD ``U S V^T``, in ``g``'s dtype."""
    a, b, c = NS_COEFFICIENTS
    x = g / (g.norm() + eps)
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return x.T if tall else x


def owners(shapes: Sequence[torch.Size], world: int) -> list[int]:
    """The rank that orthogonalizes each matrix: by Newton-Schulz cost
    (``rows * cols * min(rows, cols)``), largest first, to the least loaded rank (lowest
    rank on ties); the same on every rank."""
    load = [0] * world
    out = [0] * len(shapes)
    cost = [s[0] * s[1] * min(s[0], s[1]) for s in shapes]
    for i in sorted(range(len(shapes)), key=lambda i: (-cost[i], i)):
        out[i] = min(range(world), key=lambda r: (load[r], r))
        load[out[i]] += cost[i]
    return out


def _orthogonalized(p: torch.Tensor, update: torch.Tensor, owner: int, steps: int) -> torch.Tensor:
    """Newton-Schulz of the whole matrix whose local part (as ``p`` is laid out) is ``update``;
    returns the result's local part."""
    if not isinstance(p, vescale.DTensor):
        return newton_schulz(update, steps)
    mesh, placements = p.device_mesh, p.placements
    if mesh.ndim != 1:
        raise ValueError(f"Muon: weights on a 1-D mesh only, got {mesh} for {placements}")
    spread = vescale.from_local(
        update, mesh, placements, run_check=False, shape=p.shape, stride=p.stride()
    )
    units = tuple(p.shape[0] if r == owner else 0 for r in range(mesh.size(0)))
    whole = spread.redistribute(mesh, [RaggedShard(dims=(0,), local_units=units)])
    local = whole.to_local()
    if mesh.get_local_rank(0) == owner:
        local = newton_schulz(local.view(p.shape), steps).reshape(-1)
    result = vescale.from_local(
        local, mesh, whole.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
    return result.redistribute(mesh, placements).to_local()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, vescale.DTensor) else t


class Muon(torch.optim.Optimizer):
    """Muon for 2-D weights, plain or DTensor on a 1-D mesh (see the module doc): momentum
    ``buf = momentum * buf + grad``, update ``grad + momentum * buf`` (Nesterov) or ``buf``,
    orthogonalized, scaled by ``max(1, rows / cols) ** 0.5``; decoupled weight decay."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(
                        f"Muon: 2-D weights only, got a parameter of shape {tuple(p.shape)}; "
                        "give it to another optimizer (AdamW)"
                    )

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            world = (
                params[0].device_mesh.size(0)
                if params and isinstance(params[0], vescale.DTensor)
                else 1
            )
            for p, owner in zip(params, owners([p.shape for p in params], world)):
                grad = _local(p.grad)
                state = self.state[p]
                buf = state.setdefault("momentum_buffer", torch.zeros_like(grad))
                buf.mul_(group["momentum"]).add_(grad)
                update = grad.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
                ortho = _orthogonalized(p, update, owner, group["ns_steps"])
                scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
                local = _local(p)
                local.mul_(1 - group["lr"] * group["weight_decay"])
                local.add_(ortho.view_as(local), alpha=-group["lr"] * scale)


def optimizers(model: gpt.GPT, lr: float = 0.02) -> list[torch.optim.Optimizer]:
    """Muon for the blocks' 2-D weights, AdamW for every other parameter."""
    matrices = [
        p for name, p in model.named_parameters() if name.startswith("blocks.") and p.dim() == 2
    ]
    chosen = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    return [Muon(matrices, lr=lr), torch.optim.AdamW(rest, lr=lr / 10)]


def shard(model: gpt.GPT, mesh: Any) -> gpt.GPT:
    """``fully_shard`` every block, then the root."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(
    model: nn.Module, opts: Sequence[torch.optim.Optimizer], batches: Sequence[Any]
) -> list[float]:
    """One optimizer step per ``(ids, targets)`` batch; the losses."""
    losses = []
    for ids, targets in batches:
        loss = model(ids, targets)
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    add_device_argument(parser)
    args = parser.parse_args()
    device = init_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = gpt.GPTConfig()
    mesh = vescale.init_device_mesh(device, (world,))
    model = shard(gpt.build(cfg, device=device), mesh)
    batches = []
    for step in range(args.steps):
        ids, targets = gpt.batch(cfg, step, batch_size=2 * world, device=device)
        batches.append((ids[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]))
    losses = train(model, optimizers(model), batches)
    if rank == 0:
        for step, loss in enumerate(losses):
            print(f"step {step}  loss (rank 0's batch) {loss:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
