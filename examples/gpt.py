"""A small GPT-style model (plain ``nn.Module``) and its data-parallel x tensor-parallel plan.

The model is ordinary single-device PyTorch: token + position embeddings, pre-norm blocks of
layer norm + causal self-attention (``F.scaled_dot_product_attention``) + GELU MLP, a final
layer norm and an untied head, cross-entropy loss. :func:`parallelize` turns the same module
into a DTensor model on a ``(dp, tp)`` mesh, Megatron-style:

* q/k/v and the first MLP linear are column-parallel (weight ``Shard(0)`` over tp), so
  attention runs on this rank's heads with no communication;
* the attention output projection and the second MLP linear are row-parallel (weight
  ``Shard(1)``); their ``Partial`` output is all-reduced to ``Replicate`` by a forward hook:
  the only forward collectives of a block;
* the head is column-parallel and its logits stay sharded over the vocabulary: the
  cross-entropy runs on them as they are (two all-reduces of one value per token over tp, one
  in backward: Megatron's vocabulary-parallel loss), never gathering the logits;
* everything else is replicated; the batch is sharded over dp.

Gradients of replicated parameters arrive ``Partial`` over dp; wrap the model in
``vescale.ddp.DistributedDataParallel`` to reduce them to the parameters' placements.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import vescale
from vescale import Placement, Replicate, Shard


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq: int = 16
    dim: int = 32
    heads: int = 4
    layers: int = 2


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            lin(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for lin in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.proj = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos.weight[:t]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def build(cfg: GPTConfig, seed: int = 0, device: torch.device | str = "cpu") -> GPT:
    """The model with weights drawn from ``seed`` (identical on every rank, whatever
    ``device`` it is moved to)."""
    torch.manual_seed(seed)
    return GPT(cfg).to(device)


def build_deferred(cfg: GPTConfig, seed: int = 0) -> GPT:
    """:func:`build` without allocating any weight (``vescale.deferred_init``):
    :func:`parallelize` then materializes only each rank's shards, with :func:`build`'s values."""
    torch.manual_seed(seed)
    return vescale.deferred_init(GPT, cfg)


def batch(
    cfg: GPTConfig, step: int, batch_size: int = 8, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets of training step ``step`` (same on every rank, drawn
    on the CPU and moved to ``device``). The tokens are uniformly random, a new batch each
    step: there is nothing to learn but that, so a few steps move the loss around
    ``ln(vocab)`` (4.16 for 64) rather than down; the examples check that every way of
    running the model computes the same losses, not that it learns."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, cfg.vocab, (batch_size, cfg.seq + 1), generator=g).to(device)
    return ids[:, :-1], ids[:, 1:]


# Parameter name pattern -> placements over (dp, tp); unmatched parameters are replicated.
PLAN: dict[str, tuple[Placement, ...]] = {
    "blocks.*.attn.[qkv].*": (Replicate(), Shard(0)),
    "blocks.*.mlp.fc.*": (Replicate(), Shard(0)),
    "blocks.*.attn.proj.weight": (Replicate(), Shard(1)),
    "blocks.*.mlp.proj.weight": (Replicate(), Shard(1)),
    "head.weight": (Replicate(), Shard(0)),
}
# Module name pattern -> placements its output is redistributed to.
OUTPUTS: dict[str, tuple[Placement, ...]] = {
    "blocks.*.attn.proj": (Shard(0), Replicate()),  # Partial over tp -> all-reduce
    "blocks.*.mlp.proj": (Shard(0), Replicate()),
}
INPUTS: tuple[Placement, ...] = (Shard(0), Replicate())  # token ids and targets


def _placements_of(name: str, plan: dict[str, tuple[Placement, ...]]) -> Sequence[Placement]:
    return next((p for pat, p in plan.items() if fnmatch.fnmatchcase(name, pat)), ())


def materialize_plan(
    mesh: vescale.DeviceMesh,
) -> dict[str, tuple[vescale.DeviceMesh, Sequence[Placement]]]:
    """:data:`PLAN` on ``mesh`` as a ``vescale.materialize_module`` plan (the rest replicated)."""
    plan = {pattern: (mesh, placements) for pattern, placements in PLAN.items()}
    return {**plan, "*": (mesh, (Replicate(), Replicate()))}


def parallelize(model: nn.Module, mesh: vescale.DeviceMesh) -> nn.Module:
    """Make ``model``'s parameters DTensors on ``mesh`` per :data:`PLAN` (in place) and add
    the output redistributions of :data:`OUTPUTS` as forward hooks. Each rank computes its own
    shards, without communication: from the deferred record of a :func:`build_deferred`
    model, or by slicing the weights of a :func:`build` model (identical on every rank)."""
    vescale.materialize_module(model, materialize_plan(mesh))
    for name, module in model.named_modules():
        out = _placements_of(name, OUTPUTS)
        if out:
            module.register_forward_hook(
                lambda _m, _args, y, out=out: y.redistribute(placements=out)
            )
    return model


def shard_batch(
    mesh: vescale.DeviceMesh, ids: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch as DTensors, sharded over dp and replicated over tp."""
    return (
        vescale.distribute_tensor(ids, mesh, INPUTS),
        vescale.distribute_tensor(targets, mesh, INPUTS),
    )
