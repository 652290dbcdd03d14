"""Small models and single-device references shared by the interoperability tests."""

from __future__ import annotations

import torch
from torch import nn

D, H = 8, 16


class MLP(nn.Module):
    """``w2(relu(w1(norm(x))))``: the block upstream TP styles are written for."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.w1 = nn.Linear(D, H)
        self.w2 = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(self.norm(x))))


def mlp(seed: int = 0, dtype: torch.dtype = torch.float64) -> MLP:
    """The same weights on every rank (and in the reference) for a given seed."""
    torch.manual_seed(seed)
    model = MLP().to(dtype)
    with torch.no_grad():  # non-trivial norm parameters, so their gradients are tested too
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    """The global value of a DTensor (any class), or ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
