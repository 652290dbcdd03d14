"""Tensor-parallel attention with one fused QKV linear, eager and ``backend="vescale"``.

    torchrun --standalone --nproc-per-node 2 examples/merged_qkv_attention.py [--device cpu|cuda]

The layer is plain PyTorch: ``qkv = Linear(dim, 3 * dim)``, split into q, k, v, causal
``scaled_dot_product_attention`` over heads, output projection. Its merged weight ``[3 * dim,
dim]`` is laid out ``InterleavedShard(0, 3)`` (and its bias likewise): each rank holds its
heads' rows of Q, *and* of K and V, so ``chunk(3)`` gives q, k, v sharded over heads with no
communication, exactly like Megatron's separate column-parallel q/k/v. The output projection
is row-parallel (``Shard(1)``), its ``Partial`` output all-reduced by a forward hook: one
all-reduce forward, as in plain tensor-parallel attention. The script runs both layouts,
eager and compiled, and checks output and gradients against one device
(``tests/test_merged_qkv.py`` also checks that both issue the same collectives).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from datetime import timedelta

import gpt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch import add_device_argument, init_distributed
from torch import nn

import vescale
from vescale import InterleavedShard, Placement, Replicate, Shard

TOLERANCE = 1e-10  # float64


class MergedQKVAttention(nn.Module):
    """Causal self-attention with one ``[3 * dim, dim]`` QKV projection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for y in self.qkv(x).chunk(3, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


MERGED_PLAN: dict[str, list[Placement]] = {
    "qkv.*": [InterleavedShard(0, 3)],  # this rank's rows of Q, K and V
    "proj.weight": [Shard(1)],
}
SEPARATE_PLAN: dict[str, list[Placement]] = {"[qkv].*": [Shard(0)], "proj.weight": [Shard(1)]}


def build(dim: int = 16, heads: int = 4, seed: int = 0) -> MergedQKVAttention:
    """The single-device layer, float64, identical on every rank."""
    torch.manual_seed(seed)
    return MergedQKVAttention(dim, heads).double()


def separate_copy(merged: MergedQKVAttention) -> gpt.Attention:
    """The same weights with q, k, v as three linears: the demo GPT's attention layer (the
    plain tensor-parallel baseline)."""
    dim = merged.proj.in_features
    out = gpt.Attention(gpt.GPTConfig(dim=dim, heads=merged.heads)).double()
    with torch.no_grad():
        for lin, w, b in zip(
            (out.q, out.k, out.v), merged.qkv.weight.chunk(3), merged.qkv.bias.chunk(3)
        ):
            lin.weight.copy_(w)
            lin.bias.copy_(b)
        out.proj.load_state_dict(merged.proj.state_dict())
    return out


def parallelize(
    model: nn.Module, mesh: vescale.DeviceMesh, plan: dict[str, list[Placement]]
) -> nn.Module:
    """Parameters become DTensors per ``plan`` (the rest replicated), in place, each rank
    slicing its own shards; the output projection's ``Partial`` result is all-reduced to
    ``Replicate``."""
    layout = {name: (mesh, placements) for name, placements in plan.items()}
    vescale.materialize_module(model, {**layout, "*": (mesh, [Replicate()])})
    model.proj.register_forward_hook(  # type: ignore[union-attr]
        lambda _m, _a, y: y.redistribute(placements=[Replicate()])
    )
    return model


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's output (what gets compiled)."""
    return model(x)


def step(
    fwd: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    model: nn.Module,
    x: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """``fwd`` and the backward of a weighted sum of its output; returns the output."""
    out = fwd(model, x)
    (out * weights).sum().backward()
    return out.detach()


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter gradients as full tensors (q/k/v of a separate layer merged back)."""
    grads = {
        n: (p.grad.full_tensor() if isinstance(p.grad, vescale.DTensor) else p.grad)
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    if "q.weight" in grads:
        for kind in ("weight", "bias"):
            grads[f"qkv.{kind}"] = torch.cat([grads.pop(f"{c}.{kind}") for c in "qkv"])
    return grads


def shard_inputs(
    model: nn.Module, x: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (requiring grad) and ``weights`` replicated on the model's mesh; identical on
    every rank already, so no communication."""
    mesh = next(p.device_mesh for p in model.parameters() if isinstance(p, vescale.DTensor))
    dx = vescale.from_local(x, mesh, [Replicate()], run_check=False).requires_grad_(True)
    return dx, vescale.from_local(weights, mesh, [Replicate()], run_check=False)


def results(
    model: nn.Module, out: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Output, input gradient and parameter gradients as full tensors."""
    full = [t.full_tensor() if isinstance(t, vescale.DTensor) else t for t in (out, x.grad)]
    return full[0].detach(), full[1], gradients(model)  # type: ignore[return-value]


def reference(
    model: nn.Module, x: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Single-device output, input gradient and parameter gradients."""
    x = x.clone().requires_grad_(True)
    return results(model, step(forward, model, x, weights), x)


def inputs(dim: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 6, dim, generator=g, dtype=torch.float64)
    return x, torch.randn(2, 6, dim, generator=g, dtype=torch.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    device = init_distributed(parser.parse_args().device, timeout=timedelta(seconds=60))
    mesh = vescale.init_device_mesh(device, (dist.get_world_size(),))
    x, weights = (t.to(device) for t in inputs())
    ref_out, ref_dx, ref_grads = reference(build().to(device), x, weights)
    compiled = torch.compile(forward, backend="vescale", options={"codegen": "fx"})
    bad = 0
    for name, make, plan in (
        ("merged", build, MERGED_PLAN),
        ("separate", lambda: separate_copy(build()), SEPARATE_PLAN),
    ):
        for mode, fwd in (("eager", forward), ("compiled", compiled)):
            model = parallelize(make(), mesh, plan)
            dx, dw = shard_inputs(model, x, weights)
            out, grad_x, grads = results(model, step(fwd, model, dx, dw), dx)
            err = max(
                (out - ref_out).abs().max().item(),
                (grad_x - ref_dx).abs().max().item(),
                *((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads),
            )
            bad += err > TOLERANCE
            if dist.get_rank() == 0:
                print(f"{name:9s}{mode:9s}max |diff| vs one device = {err:.2e}")
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
