"""In-place random ops on ``RaggedShard(dims=(0,))`` DTensors (vescale.fsdp's sharded
parameters: its meta-device path runs ``to_empty`` then an in-place init on them) on CPU:
each rank's slice holds the single-device values at its rows and the generator ends where
one device's does. Each rank's mesh coordinate in turn, on meshes without process groups."""

from __future__ import annotations

import pytest
import torch

import vescale
from vescale import RaggedShard
from vescale.dtensor.propagation import UnsupportedOpError

UNITS = (1, 2, 0, 1)
SHAPE = (8, 12)
OPS = {
    "normal_": lambda t: t.normal_(0.0, 2.0),
    "uniform_": lambda t: t.uniform_(-1.0, 1.0),
    "kaiming_uniform_": lambda t: torch.nn.init.kaiming_uniform_(t, a=5**0.5),
    "bernoulli_": lambda t: t.bernoulli_(0.3),
}


def _ragged(rank: int, units=UNITS, dims=(0,)) -> vescale.DTensor:
    mesh = vescale.DeviceMesh("cpu", torch.arange(4), _rank=rank, _init_backend=False)
    local = torch.zeros(units[rank] * SHAPE[0] * SHAPE[1] // sum(units))
    ragged = [RaggedShard(dims=dims, local_units=units)]
    return vescale.DTensor.from_local(
        local, mesh, ragged, run_check=False, shape=SHAPE, stride=(SHAPE[1], 1)
    )


@pytest.mark.parametrize("name", sorted(OPS))
def test_ragged_random_ops_give_single_device_values(name):
    op = OPS[name]
    torch.manual_seed(3)
    want = op(torch.empty(SHAPE)).flatten()
    after = torch.rand(4)
    starts = [0, *torch.tensor(UNITS).cumsum(0).tolist()]
    for rank in range(4):
        d = _ragged(rank)
        torch.manual_seed(3)
        op(d)
        rows = SHAPE[0] // sum(UNITS)
        lo, hi = starts[rank] * rows * SHAPE[1], starts[rank + 1] * rows * SHAPE[1]
        assert torch.equal(d.to_local(), want[lo:hi]), rank
        assert torch.equal(torch.rand(4), after), rank  # the generator as one device leaves it


def test_ragged_random_op_over_several_dims_is_refused():
    d = _ragged(0, units=(8, 8, 8, 8), dims=(0, 1))
    with pytest.raises(UnsupportedOpError, match=r"uniform_.*dims \(0, 1\).*DeviceMesh"):
        d.uniform_()
