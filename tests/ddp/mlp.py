"""A small seeded MLP with its loss, shared by the DDP tests (eager and compiled)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Mlp(nn.Module):
    """``mse(fc2(tanh(fc1(x))), target)``; the same weights on every construction (seed 0)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(torch.tanh(self.fc1(x))), target)
