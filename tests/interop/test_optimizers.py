"""``torch.optim`` on vescale DTensor parameters (issue 13 item 3).

AdamW (for-loop, foreach and fused CPU kernels) and SGD with momentum step vescale DTensor
parameters (uneven Shard, Shard of dim 1, Replicate, 2-D mesh) with DTensor gradients; after
three steps every parameter equals the same optimizer run on the full float64 tensors, and
parameters and optimizer state stay vescale DTensors in their placements.
"""

from __future__ import annotations

import pytest
import torch

import vescale
from vescale import Replicate, Shard

OPTIMIZERS = {
    "adamw-for-loop": lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, foreach=False),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
}
# (global shape, mesh shape, placements)
LAYOUTS = [
    ((7, 3), (4,), [Shard(0)]),
    ((3, 6), (4,), [Shard(1)]),
    ((5,), (4,), [Replicate()]),
    ((6, 5), (2, 2), [Shard(0), Shard(1)]),
]
STEPS = 3


def optimizer_steps(name: str) -> None:
    torch.manual_seed(3)
    values = [torch.randn(shape, dtype=torch.float64) for shape, _, _ in LAYOUTS]
    grads = [[torch.randn_like(v) for v in values] for _ in range(STEPS)]
    ref = [torch.nn.Parameter(v.clone()) for v in values]
    params = [
        torch.nn.Parameter(
            vescale.distribute_tensor(v, vescale.init_device_mesh("cpu", mesh), placements)
        )
        for v, (_, mesh, placements) in zip(values, LAYOUTS)
    ]
    ref_opt, opt = OPTIMIZERS[name](ref), OPTIMIZERS[name](params)
    for step in range(STEPS):
        for r, p, g in zip(ref, params, grads[step]):
            r.grad = g
            p.grad = vescale.distribute_tensor(g, p.device_mesh, p.placements)
        ref_opt.step()
        opt.step()
    for r, p, (_, _, placements) in zip(ref, params, LAYOUTS):
        assert type(p.data) is vescale.DTensor and p.placements == tuple(placements)
        assert torch.allclose(p.full_tensor(), r.detach(), atol=1e-12, rtol=0), name
        for key, state in opt.state[p].items():
            if key != "step":
                assert type(state) is vescale.DTensor, (key, type(state))
                assert state.placements == tuple(placements), (key, state.placements)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_on_vescale_parameters_equals_full_tensors(pool4, name):
    pool4.run(optimizer_steps, name)
