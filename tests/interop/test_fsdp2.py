"""FSDP2 (``fully_shard``) in a process that imported vescale (issue 13 item 3).

1. ``fully_shard`` over plain parameters on 2 ranks; 2. the 2-D recipe on a 2x2 vescale mesh:
parameters tensor-parallel as vescale DTensors over "tp", then ``fully_shard`` over "dp".
Each rank trains on its slice of the batch; loss, gradients (mean over the whole batch, as
FSDP2 averages over dp) and the parameters after two AdamW steps equal the single-device
float64 model trained on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import vescale
from tests.interop._models import MLP, full, mlp
from vescale import Replicate, Shard

BATCH, STEPS, LR = 8, 2, 0.05


def _batches(seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    return [
        (torch.randn(BATCH, 8, dtype=torch.float64), torch.randn(BATCH, 8, dtype=torch.float64))
        for _ in range(STEPS)
    ]


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single device, whole batch: per-step losses and the final parameters."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses = []
    for x, t in _batches():
        loss = F.mse_loss(model(x), t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _train(model: nn.Module, shard: slice) -> list[float]:
    """AdamW steps on this rank's batch slice; returns the losses averaged over all ranks
    (tp replicas repeat their dp rank's loss, so this is the mean over the dp slices)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses = []
    for x, t in _batches():
        out = model(x[shard])
        loss = F.mse_loss(out, t[shard])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def _assert_matches(losses: list[float], model: nn.Module) -> None:
    ref_losses, ref_params = _reference()
    assert all(abs(a - b) < 1e-10 for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    for name, p in model.named_parameters():
        assert torch.allclose(full(p), ref_params[name], atol=1e-10), name


def fsdp2_plain_parameters() -> None:
    ws, rank = dist.get_world_size(), dist.get_rank()
    mesh = vescale.init_device_mesh("cpu", (ws,))
    model = mlp()
    fully_shard(model.w1, mesh=mesh)
    fully_shard(model.w2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for name, p in model.named_parameters():
        assert isinstance(p, torch.distributed.tensor.DTensor), name
        assert p.placements == (torch.distributed.tensor.Shard(0),), (name, p.placements)
    per = BATCH // ws
    _assert_matches(_train(model, slice(rank * per, (rank + 1) * per)), model)


def test_fully_shard_plain_parameters(pool2):
    pool2.run(fsdp2_plain_parameters)


TP_LAYOUT = {
    "w1.weight": [Shard(0)],
    "w1.bias": [Shard(0)],
    "w2.weight": [Shard(1)],
    "w2.bias": [Replicate()],
    "norm.weight": [Replicate()],
    "norm.bias": [Replicate()],
}


class TensorParallelMLP(MLP):
    """The MLP's Megatron layout on vescale DTensors over ``tp``: column- then row-parallel
    linear, the row-parallel Partial output made Replicate by one explicit all-reduce."""

    def __init__(self, tp: vescale.DeviceMesh) -> None:
        super().__init__()
        self.tp = tp
        self.to(torch.float64)
        self.load_state_dict(mlp().state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xd = vescale.from_local(x, self.tp, [Replicate()], run_check=False)
        out = self.w2(torch.relu(self.w1(self.norm(xd)))).redistribute(self.tp, [Replicate()])
        assert isinstance(out, vescale.DTensor), type(out)
        return out.to_local()


def fsdp2_over_tensor_parallel() -> None:
    mesh = vescale.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"]
    model = TensorParallelMLP(tp)
    for name, p in list(model.named_parameters()):
        mod_name, attr = name.rsplit(".", 1)
        dt = vescale.distribute_tensor(p.detach(), tp, TP_LAYOUT[name])
        assert type(dt) is vescale.DTensor
        setattr(model.get_submodule(mod_name), attr, nn.Parameter(dt))
    fully_shard(model.w1, mesh=dp)
    fully_shard(model.w2, mesh=dp)
    fully_shard(model, mesh=dp)
    for name, p in model.named_parameters():
        assert p.device_mesh.mesh_dim_names == ("dp", "tp"), (name, p.device_mesh)
    per = BATCH // 2
    d = dp.get_local_rank()
    _assert_matches(_train(model, slice(d * per, (d + 1) * per)), model)


def test_fully_shard_over_vescale_tensor_parallel(pool4):
    pool4.run(fsdp2_over_tensor_parallel)
