"""Plain Llama-3-shaped causal LMs on the meta device (no weights, no memory), for planning.

``LLAMA3_8B``: 32 layers, dim 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256 (8.03 B
parameters); ``LLAMA3_70B``: 80 layers, dim 8192, 64 heads, 8 KV heads, FFN 28672. RMSNorm,
RoPE (cos/sin buffers), grouped-query ``F.scaled_dot_product_attention``, SwiGLU, an untied
head, bf16; ``forward(ids, labels)`` returns the mean cross entropy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LLAMA3_8B", "LLAMA3_70B", "LlamaConfig", "build"]


@dataclass(frozen=True)
class LlamaConfig:
    layers: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 128256
    seq: int = 8192
    theta: float = 500000.0


LLAMA3_8B = LlamaConfig(layers=32, dim=4096, heads=32, kv_heads=8, ffn=14336)
LLAMA3_70B = LlamaConfig(layers=80, dim=8192, heads=64, kv_heads=8, ffn=28672)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        return (x.float() * rms).to(x.dtype) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.dim), MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        head_dim = cfg.dim // cfg.heads
        freqs = 1.0 / cfg.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(cfg.seq).float(), freqs).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        cos, sin = self.cos[:t].to(torch.bfloat16), self.sin[:t].to(torch.bfloat16)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def build(cfg: LlamaConfig, layers: int | None = None) -> Llama:
    """``cfg``'s model (``layers`` of them when given) on the meta device, in bf16 (the RoPE
    tables in float32)."""
    cfg = dataclasses.replace(cfg, layers=cfg.layers if layers is None else layers)
    with torch.device("meta"):
        model = Llama(cfg)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model
