"""Checkpoint and resume onto another mesh (issue 40, docs/checkpoint.md).

A tensor-parallel model (DTensor parameters on a (dp, tp) mesh, ``vescale.ddp`` over dp) and
its Adam state are saved with ``torch.distributed.checkpoint`` through
``torch.distributed.checkpoint.state_dict.get_state_dict`` on one mesh, loaded with
``set_state_dict`` into a fresh model and optimizer on another mesh ((2, 2) -> (4, 1) and
back), and trained on. Every parameter and every optimizer state tensor equals one device's
uninterrupted float64 run.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import vescale
from vescale import Replicate, Shard
from vescale.ddp import DistributedDataParallel

BATCH, STEPS_BEFORE, STEPS_AFTER = 8, 2, 2
# parameter -> its tensor-parallel placement (Megatron: column then row parallel)
TP = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1), "2.bias": Replicate()}


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 6, dtype=torch.float64, generator=g)
    return x, torch.randn(BATCH, 4, dtype=torch.float64, generator=g)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    out = model(x)
    if isinstance(out, vescale.DTensor):  # the row-parallel layer's partial sums, summed
        out = out.redistribute(placements=[Shard(0), Replicate()])
    ((out - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def _distributed(shape: tuple[int, int], values: nn.Module) -> tuple[nn.Module, Any]:
    mesh = vescale.init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    for name, p in list(values.named_parameters()):
        owner, leaf = name.rsplit(".", 1)
        dt = vescale.distribute_tensor(p.detach(), mesh, [Replicate(), TP[name]])
        setattr(values.get_submodule(owner), leaf, nn.Parameter(dt))
    return DistributedDataParallel(values), mesh


def _train_distributed(model: nn.Module, mesh: Any, opt: Any, steps: range) -> None:
    for step in steps:
        x, y = _batch(step)
        _step(
            model,
            opt,
            vescale.distribute_tensor(x, mesh, [Shard(0), Replicate()]),
            vescale.distribute_tensor(y, mesh, [Shard(0), Replicate()]),
        )


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, vescale.DTensor) else torch.as_tensor(t)


def resume_on_other_mesh(before: tuple[int, int], after: tuple[int, int]) -> None:
    path = [tempfile.mkdtemp(prefix="vescale_ckpt_") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(path, src=0)

    model, mesh = _distributed(before, _model())
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    _train_distributed(model, mesh, opt, range(STEPS_BEFORE))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path[0])
    del model, opt

    fresh = _model()
    for p in fresh.parameters():
        nn.init.zeros_(p)  # nothing of the saved run survives but the checkpoint
    model, mesh = _distributed(after, fresh)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path[0])
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for name, p in model.module.named_parameters():
        assert p.device_mesh.shape == after and p.placements == (Replicate(), TP[name]), name
    _train_distributed(model, mesh, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))

    ref = _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    for step in range(STEPS_BEFORE + STEPS_AFTER):
        _step(ref, ref_opt, *_batch(step))
    ref_params = dict(ref.named_parameters())
    for name, p in model.module.named_parameters():
        torch.testing.assert_close(_full(p), ref_params[name].detach(), msg=name)
        got, want = opt.state[p], ref_opt.state[ref_params[name]]
        assert got.keys() == want.keys(), name
        for k in want:
            torch.testing.assert_close(_full(got[k]), want[k], msg=f"{name} {k}")


@pytest.mark.parametrize("before,after", [((2, 2), (4, 1)), ((4, 1), (2, 2))])
def test_resume_on_another_mesh(pool4, before, after):
    pool4.run(resume_on_other_mesh, before, after)
