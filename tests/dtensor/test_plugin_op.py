"""A C++ fused kernel (raw pointers, torch.library) inside a tensor-parallel DTensor MLP,
eager and compiled, against the same MLP on one device."""

from __future__ import annotations

import pytest
import torch

import vescale
from tests.dtensor import plugin_kernel
from tests.dtensor.reference import mesh_of
from vescale import Replicate, Shard
from vescale.dtensor.dispatch import plugin_op


@pytest.fixture(scope="module", autouse=True)
def built_kernel():
    plugin_kernel.load()  # build once here; the workers load it from the cache


def _pointers_seen(x, b):
    _pointers_seen.seen = (x.data_ptr(), type(x))
    return torch.ops.vescale_test.fused_bias_relu(x, b)


def _mlp(params, x, fused):
    h = x @ params["w1"].T  # column parallel: Shard(1)
    h = fused(h, params["b1"])
    y = h @ params["w2"].T  # row parallel: Partial
    if isinstance(y, vescale.DTensor):
        y = y.redistribute(placements=[Replicate()])
    return (y**2).mean()


def _check_plugin(compiled):
    plugin_kernel.load()
    torch.manual_seed(0)
    full = {"w1": torch.randn(16, 8), "b1": torch.randn(16), "w2": torch.randn(4, 16)}
    x = torch.randn(6, 8)
    ref = {k: v.clone().requires_grad_(True) for k, v in full.items()}
    ref_loss = _mlp(ref, x, lambda h, b: torch.relu(h + b))
    ref_loss.backward()

    mesh = mesh_of((4,))
    layout = {"w1": [Shard(0)], "b1": [Shard(0)], "w2": [Shard(1)]}
    params = {
        k: vescale.distribute_tensor(v, mesh, layout[k]).requires_grad_(True)
        for k, v in full.items()
    }
    kernel = torch.ops.vescale_test.fused_bias_relu if compiled else _pointers_seen
    fused = plugin_op(kernel, out_placements=[Shard(1)])
    dx = vescale.distribute_tensor(x, mesh, [Replicate()])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = torch.compile(_mlp, backend="vescale") if compiled else _mlp
    loss = step(params, dx, fused)
    loss.backward()
    assert torch.allclose(loss.full_tensor(), ref_loss, atol=1e-5)
    for k in full:
        assert tuple(params[k].grad.placements) == tuple(layout[k]), k
        assert torch.allclose(params[k].grad.full_tensor(), ref[k].grad, atol=1e-5), k
    if not compiled:  # the kernel got a plain, waited local shard
        assert _pointers_seen.seen[1] is torch.Tensor
        return None
    stats = torch._dynamo.utils.counters
    return dict(stats["graph_break"]), stats["stats"]["unique_graphs"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cpp_plugin_kernel_in_tp_mlp(pool4, compiled):
    for result in pool4.run(_check_plugin, compiled):
        if compiled:
            breaks, graphs = result
            assert breaks == {} and graphs == 1, result
