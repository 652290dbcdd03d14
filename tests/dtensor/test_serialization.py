"""``torch.save`` / ``torch.load`` (the default ``weights_only=True`` included), pickling and
``copy.deepcopy`` of vescale DTensors, of ``nn.Parameter``s holding them and of modules
holding those: each round-trips values, placements, mesh and class (issue 40 item 5), while
``data_ptr()`` stays the local shard's."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import vescale
from tests.dtensor.reference import compared, mesh_of
from vescale import InterleavedShard, Partial, Replicate, Shard
from vescale.dtensor.ragged import RaggedShard


def _saved_and_loaded(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)  # weights_only=True: torch 2.13's default


_WAYS: dict[str, Callable[[Any], Any]] = {
    "torch.save": _saved_and_loaded,
    "pickle": lambda x: pickle.loads(pickle.dumps(x)),
    "deepcopy": copy.deepcopy,
}


def _cases(mesh_shape: tuple[int, ...]) -> list[tuple[torch.Tensor, list[Any]]]:
    n = mesh_shape[0]
    rows = torch.arange(2 * n * 3 + 3, dtype=torch.float64).reshape(-1, 3)  # uneven rows
    even = torch.arange(4 * n * 3, dtype=torch.float32).reshape(-1, 3)
    if len(mesh_shape) == 1:
        return [
            (rows, [Shard(0)]),
            (rows, [Replicate()]),
            (even, [Partial()]),
            (even, [InterleavedShard(0, 2)]),
            (torch.arange(18.0).reshape(6, 3), [RaggedShard((0,), (1, 2))]),
        ]
    return [
        (rows, [Shard(0), Shard(1)]),
        (rows, [Partial(), Shard(0)]),
        (even, [InterleavedShard(0, 2), Replicate()]),
        (rows, [Replicate(), RaggedShard((0, 1), (1, 2))]),
    ]


def _same(got: Any, want: vescale.DTensor, full: torch.Tensor, what: str) -> None:
    assert type(got) is vescale.DTensor, (what, type(got))
    assert type(got._spec).__name__ == "VescaleSpec", what
    assert tuple(got.placements) == tuple(want.placements), what
    assert got.device_mesh == want.device_mesh, what
    assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype), what
    assert torch.equal(got.to_local(), want.to_local()), what
    a, b = compared(got, full)
    assert torch.equal(a, b), what


def _check_dtensors(mesh_shape: tuple[int, ...]) -> None:
    mesh = mesh_of(mesh_shape)
    for full, placements in _cases(mesh_shape):
        x = vescale.distribute_tensor(full, mesh, placements)
        for way, f in _WAYS.items():
            what = f"{way} of {placements}"
            y = f(x)
            _same(y, x, full, what)
            local = y.to_local()
            if local.numel():
                assert y.data_ptr() == local.data_ptr() != x.data_ptr(), what  # its own copy


def test_dtensors_round_trip_2(pool2):
    pool2.run(_check_dtensors, (2,))


def test_dtensors_round_trip_2x2(pool4):
    pool4.run(_check_dtensors, (2, 2))


def _check_parameters_and_modules(mesh_shape: tuple[int, ...]) -> None:
    mesh = mesh_of(mesh_shape)
    torch.manual_seed(0)
    ref = nn.Linear(6, 5, dtype=torch.float64)
    sharded = (Replicate(),) * (len(mesh_shape) - 1)
    model = nn.Linear(6, 5, dtype=torch.float64)
    model.weight = nn.Parameter(
        vescale.distribute_tensor(ref.weight.detach(), mesh, [*sharded, Shard(0)])
    )
    model.bias = nn.Parameter(
        vescale.distribute_tensor(ref.bias.detach(), mesh, [*sharded, Shard(0)])
    )
    x = torch.randn(3, 6, dtype=torch.float64)
    model(vescale.distribute_tensor(x, mesh, [Replicate()] * len(mesh_shape))).sum().backward()
    for way, f in _WAYS.items():
        p = f(model.weight)
        assert isinstance(p, nn.Parameter) and p.requires_grad, way
        _same(p, model.weight, ref.weight.detach(), way)
    # an EMA / reference copy of the module: its own parameters, gradients copied too
    twin = copy.deepcopy(model)
    for (name, a), b in zip(twin.named_parameters(), model.parameters()):
        assert isinstance(a, nn.Parameter) and a is not b, name
        _same(a, b, ref.get_parameter(name).detach(), f"deepcopy module {name}")
        assert a.grad is not None and torch.equal(a.grad.to_local(), b.grad.to_local()), name
    with torch.no_grad():
        twin.weight.mul_(0)
    assert not torch.equal(model.weight.full_tensor(), twin.weight.full_tensor())
    # torch.save of the state dict (weights_only load) and of the whole module
    state = _saved_and_loaded(model.state_dict())
    for name, t in state.items():
        _same(t, model.get_parameter(name), ref.get_parameter(name).detach(), f"state {name}")
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    inp = vescale.distribute_tensor(x, mesh, [Replicate()] * len(mesh_shape))
    torch.testing.assert_close(loaded(inp).full_tensor(), ref(x), rtol=0, atol=1e-12)


def test_parameters_and_modules_2(pool2):
    pool2.run(_check_parameters_and_modules, (2,))


def test_parameters_and_modules_2x2(pool4):
    pool4.run(_check_parameters_and_modules, (2, 2))
