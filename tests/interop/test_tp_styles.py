"""Upstream tensor-parallel styles in a process that imported vescale (issue 13 item 3).

``parallelize_module`` with ``SequenceParallel`` (LayerNorm), ``ColwiseParallel`` and
``RowwiseParallel`` lays out the MLP on an upstream mesh and on a vescale mesh; forward and
backward equal the single-device float64 model, and every DTensor the program sees (parameters,
activations, gradients) is upstream's class: vescale semantics never reach it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import vescale
from tests.interop._models import full, mlp

PLAN = {
    "norm": SequenceParallel(),
    "w1": ColwiseParallel(input_layouts=Shard(1)),
    "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
}


def tp_forward_backward(mesh_kind: str) -> None:
    """Sequence-parallel MLP on 2 ranks vs one device: output, loss and every gradient."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    if mesh_kind == "vescale":
        mesh = vescale.init_device_mesh("cpu", (ws,))
        assert isinstance(mesh, vescale.DeviceMesh)
    else:
        mesh = init_device_mesh("cpu", (ws,))
    ref = mlp()
    model = parallelize_module(mlp(), mesh, PLAN)
    for name, p in model.named_parameters():
        assert type(p.data) is DTensor, (name, type(p.data))
    torch.manual_seed(1)
    x = torch.randn(2, 4 * ws, 8, dtype=torch.float64)
    out = model(x.chunk(ws, dim=1)[rank])  # each rank holds its sequence chunk
    assert type(out) is DTensor and out.placements == (Shard(1),), (type(out), out.placements)
    expected = ref(x)
    assert torch.allclose(out.full_tensor(), expected, atol=1e-12)
    loss = (out * out).sum()
    assert type(loss) is DTensor
    loss.backward()
    (expected * expected).sum().backward()
    assert torch.allclose(loss.full_tensor(), (expected * expected).sum(), atol=1e-10)
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert type(p.grad) is DTensor, (name, type(p.grad))
        assert torch.allclose(full(p.grad), ref_grads[name].grad, atol=1e-10), name


@pytest.mark.parametrize("mesh_kind", ["upstream", "vescale"])
def test_tp_styles_equal_single_device(pool2, mesh_kind):
    pool2.run(tp_forward_backward, mesh_kind)
