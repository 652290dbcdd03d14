"""Misuse of ``DistributedDataParallel`` and deferred init: a clear error, on every rank, at
the call that can tell (construction, ``materialize_module``, the forward), never a silent
wrong result."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vescale
from tests.harness.misuse import error_everywhere
from vescale import Replicate, Shard
from vescale.ddp import DistributedDataParallel


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc(x))


def _mixed() -> None:
    mesh = vescale.init_device_mesh("cpu", (2,))
    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(vescale.distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
    DistributedDataParallel(lin)


def _two_dim_dp_mesh() -> None:
    mesh = vescale.init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    DistributedDataParallel(nn.Linear(4, 4), dp_mesh=mesh)


def test_mixed_dtensor_and_plain_parameters_name_the_plain_ones(pool2):
    err = error_everywhere(pool2, _mixed)
    assert err.kind == "ValueError", err
    assert "['bias']" in err.message or "'bias'" in err.message, err.message
    assert "'weight'" in err.message and "(Shard(dim=0),)" in err.message, err.message
    assert "mixing them fails" in err.message, err.message


def test_dp_mesh_must_be_one_dimensional(pool2):
    err = error_everywhere(pool2, _two_dim_dp_mesh)
    assert err.kind == "ValueError" and "1-D" in err.message and "mesh['dp']" in err.message, err


def _plan_typo() -> None:
    mesh = vescale.init_device_mesh("cpu", (2,))
    model = vescale.deferred_init(_Net)
    vescale.materialize_module(model, {"fc.weigth": (mesh, [Shard(0)])})


def _plan_shadowed() -> None:
    mesh = vescale.init_device_mesh("cpu", (2,))
    model = vescale.deferred_init(_Net)
    vescale.materialize_module(model, {"*": (mesh, [Replicate()]), "fc.weight": (mesh, [Shard(0)])})


def test_plan_pattern_matching_nothing_is_an_error(pool2):
    """A typo in a plan name (the weight silently stayed a full plain tensor)."""
    err = error_everywhere(pool2, _plan_typo)
    assert err.kind == "ValueError", err
    assert "'fc.weigth'" in err.message and "matches no parameter or buffer" in err.message
    assert "did you mean 'fc.weight'?" in err.message, err.message


def test_plan_pattern_shadowed_by_an_earlier_one_is_an_error(pool2):
    err = error_everywhere(pool2, _plan_shadowed)
    assert err.kind == "ValueError", err
    assert "'fc.weight'" in err.message and "taken by an earlier pattern" in err.message, err


def test_tied_names_taking_different_entries_is_an_error():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(6, 4)
            self.head = nn.Linear(4, 6, bias=False)
            self.head.weight = self.emb.weight

    mesh = vescale.DeviceMesh("meta", [0, 1])
    model = vescale.deferred_init(Tied)
    with pytest.raises(ValueError, match=r"tied tensor 'emb.weight' / 'head.weight'"):
        vescale.materialize_module(
            model, {"head.weight": (mesh, [Shard(0)]), "*": (mesh, [Replicate()])}
        )
    assert vescale.is_deferred(model)  # nothing was materialized


def test_forward_before_materialize_names_the_deferred_tensor():
    """A forward on a deferred module returned ``DeferredTensor(shape=())``."""
    model = vescale.deferred_init(_Net)
    with pytest.raises(
        RuntimeError,
        match=r"_Net was built by vescale.deferred_init and its "
        r"tensor 'fc.weight' \(shape \(4, 4\)\) is still deferred .*materialize",
    ):
        model(torch.randn(3, 4))
    with pytest.raises(RuntimeError, match=r"Linear 'out' .* tensor 'out.weight'"):
        model.out(torch.randn(3, 4))
    torch.manual_seed(0)
    model = vescale.deferred_init(_Net)
    vescale.materialize_module(model)
    torch.manual_seed(0)
    eager = _Net()
    x = torch.randn(3, 4)
    assert torch.equal(model(x), eager(x))
    assert not any(m._forward_pre_hooks for m in model.modules())  # the guards are gone
