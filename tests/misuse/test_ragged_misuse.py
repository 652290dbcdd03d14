"""Unsupported ops on ``RaggedShard`` DTensors (issue 29 item 2): the same clear error on every
rank, within seconds, naming the op, the placements and the mesh and saying to redistribute
first; never a hang, a wrong result or an error from inside another handler."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import vescale
from tests.harness.misuse import error_everywhere
from vescale import RaggedShard, Replicate

PLACEMENT = RaggedShard((0,), (3, 1))
PLACEMENT_2D = RaggedShard((0, 1), (3, 1))  # random ops draw dims=(0,) shares only


def _x() -> vescale.DTensor:
    mesh = vescale.init_device_mesh("cpu", (dist.get_world_size(),))
    return vescale.distribute_tensor(torch.ones(8, 6, dtype=torch.float64), mesh, [PLACEMENT])


def _ragged_2d() -> vescale.DTensor:
    mesh = vescale.init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.ones(8, 6, dtype=torch.float64)
    return vescale.distribute_tensor(x, mesh, [PLACEMENT_2D])


def _replicated(shape: tuple[int, ...]) -> vescale.DTensor:
    mesh = vescale.init_device_mesh("cpu", (dist.get_world_size(),))
    return vescale.distribute_tensor(torch.ones(shape, dtype=torch.float64), mesh, [Replicate()])


CASES = {
    # op without a rule: the sharding gate
    "view": (lambda: _x().view(-1), "aten.view.default: not supported on RaggedShard inputs"),
    "matmul": (
        lambda: _x() @ _replicated((6, 2)),
        "aten.mm.default: not supported on RaggedShard inputs",
    ),
    "cumsum": (lambda: _x().cumsum(0), "aten.cumsum.default: not supported"),
    # ops with a dispatch handler of their own
    "topk": (lambda: _x().topk(2), "aten.topk.default: not supported on RaggedShard inputs"),
    # random ops: RaggedShard(dims=(0,)) draws its rows (vescale.fsdp); several dims are refused
    "dropout": (
        lambda: torch.nn.functional.dropout(_ragged_2d(), 0.5),
        "aten.bernoulli_.float: not supported on RaggedShard inputs with dims (0, 1)",
    ),
    # element-wise ops on layouts that do not match
    "other_units": (
        lambda: (
            _x()
            + vescale.distribute_tensor(
                torch.ones(8, 6, dtype=torch.float64), _x().device_mesh, [RaggedShard((0,), (1, 1))]
            )
        ),
        "aten.add.Tensor: an input laid out as (RaggedShard(dims=(0,), local_units=(1, 1)),)",
    ),
    "broadcast": (
        lambda: _x() * _replicated((6,)),
        "aten.mul.Tensor: an input laid out as (Replicate(),) [6] does not match",
    ),
    # reductions over a flattened dim, or an order without a pending reduction
    "sum_dim0": (lambda: _x().sum(0), "aten.sum.dim_IntList: reducing dims [0]"),
    "norm_ord0": (
        lambda: torch.linalg.vector_norm(_x(), 0),
        "aten.linalg_vector_norm.default: ord=0.0",
    ),
}


def run_case(name: str) -> None:
    CASES[name][0]()


@pytest.mark.parametrize("name", list(CASES))
def test_unsupported_op_same_error_everywhere(pool2, name):
    error = error_everywhere(pool2, run_case, name)
    assert error.kind == "UnsupportedOpError", error
    assert CASES[name][1] in error.message, error.message
    placement = PLACEMENT_2D if name == "dropout" else PLACEMENT
    assert str(placement) in error.message or repr(placement) in error.message, error.message
    assert "DeviceMesh((2,)" in error.message and "redistribute" in error.message, error.message


def integer_mean() -> None:
    _x().to(torch.int64).mean()


def test_reduction_argument_errors_are_torchs(pool2):
    """A reduction's argument errors are torch's own, on every rank (checked on the global
    shape before anything runs): the mean of an integer tensor."""
    error = error_everywhere(pool2, integer_mean)
    assert error.kind == "RuntimeError" and "mean()" in error.message, error
