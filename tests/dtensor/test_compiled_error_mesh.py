"""The compiled path's ImplicitRedistributionError names the mesh as eager's does (shape,
ranks, dim names), never the opaque FakeScriptObject the trace holds it in."""

from __future__ import annotations

import torch

import vescale
from vescale import Shard
from vescale.dtensor.dispatch import ImplicitRedistributionError


def _check_compiled_error_names_mesh() -> str:
    mesh = vescale.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    a = vescale.distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    b = vescale.distribute_tensor(torch.ones(4, 4), mesh, [Shard(1)])
    torch._dynamo.reset()
    f = torch.compile(lambda x, y: x + y, backend="vescale", options={"codegen": "fx"})
    try:
        f(a, b)
    except Exception as e:
        text = str(e)
        assert isinstance(e, ImplicitRedistributionError) or "ImplicitRedistributionError" in text
        assert "FakeScriptObject" not in text, text
        assert "DeviceMesh((tp=2), 'cpu'" in text, text
        return text
    raise AssertionError("no ImplicitRedistributionError")


def test_compiled_error_names_mesh(pool2):
    pool2.run(_check_compiled_error_names_mesh)
