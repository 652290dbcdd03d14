"""Checkpoint and resume onto another mesh (issue 40, docs/checkpoint.md).

The demo GPT (``examples/gpt.py``: Megatron tensor parallelism over tp, ``vescale.ddp`` over
dp) and its Adam state are saved with ``torch.distributed.checkpoint`` through
``torch.distributed.checkpoint.state_dict.get_state_dict`` on one mesh, loaded with
``set_state_dict`` into a fresh model and optimizer on another mesh ((2, 2) -> (4, 1) and
back), and trained on. Every parameter and every optimizer state tensor equals one device's
uninterrupted float64 run.
"""

from __future__ import annotations

import tempfile
from typing import Any

import gpt  # examples/gpt.py (tests/conftest.py puts examples/ on the path)
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import vescale
from vescale.ddp import DistributedDataParallel

STEPS_BEFORE, STEPS_AFTER, LR = 2, 2, 0.01
CFG = gpt.GPTConfig()


def _distributed(shape: tuple[int, int], seed: int) -> tuple[nn.Module, Any]:
    mesh = vescale.init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    return DistributedDataParallel(gpt.parallelize(gpt.build(CFG, seed).double(), mesh)), mesh


def _train(model: nn.Module, opt: Any, steps: range, mesh: Any = None) -> None:
    for step in steps:
        ids, targets = gpt.batch(CFG, step)
        if mesh is not None:
            ids, targets = gpt.shard_batch(mesh, ids, targets)
        model(ids, targets).backward()
        opt.step()
        opt.zero_grad()


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, vescale.DTensor) else torch.as_tensor(t)


def resume_on_other_mesh(before: tuple[int, int], after: tuple[int, int]) -> None:
    path = [tempfile.mkdtemp(prefix="vescale_ckpt_") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(path, src=0)

    model, mesh = _distributed(before, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    _train(model, opt, range(STEPS_BEFORE), mesh)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path[0])
    placements = {n: p.placements for n, p in model.module.named_parameters()}
    del model, opt

    model, mesh = _distributed(after, seed=1)  # other weights: only the checkpoint's survive
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path[0])
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for name, p in model.module.named_parameters():
        assert p.device_mesh.shape == after and p.placements == placements[name], name
    _train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), mesh)

    ref = gpt.build(CFG, 0).double()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR)
    _train(ref, ref_opt, range(STEPS_BEFORE + STEPS_AFTER))
    ref_params = dict(ref.named_parameters())
    for name, p in model.module.named_parameters():
        torch.testing.assert_close(_full(p), ref_params[name].detach(), msg=name)
        got, want = opt.state[p], ref_opt.state[ref_params[name]]
        assert got.keys() == want.keys(), name
        for k in want:
            torch.testing.assert_close(_full(got[k]), want[k], msg=f"{name} {k}")


@pytest.mark.parametrize("before,after", [((2, 2), (4, 1)), ((4, 1), (2, 2))])
def test_resume_on_another_mesh(pool4, before, after):
    pool4.run(resume_on_other_mesh, before, after, timeout_s=300)
