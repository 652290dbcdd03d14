"""A 2-rank (``fake`` group) tensor-parallel MLP compiled by ``backend="vescale"``, run as a
script by tests/fx/test_observability.py under ``TORCH_TRACE`` / ``TORCH_LOGS``."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

import vescale
from tests.harness.simulated import fake_world


def main() -> None:
    with fake_world(2):
        mesh = vescale.init_device_mesh("cpu", (2,))
        w1 = vescale.distribute_tensor(torch.randn(8, 16), mesh, [Shard(1)]).requires_grad_()
        w2 = vescale.distribute_tensor(torch.randn(16, 8), mesh, [Shard(0)]).requires_grad_()

        def mlp(x: torch.Tensor) -> torch.Tensor:
            return ((x @ w1).relu() @ w2).redistribute(mesh, [Replicate()]).sum()

        x = vescale.distribute_tensor(torch.randn(4, 8), mesh, [Replicate()])
        torch.compile(mlp, backend="vescale", options={"codegen": "fx"})(x).backward()


if __name__ == "__main__":
    main()
