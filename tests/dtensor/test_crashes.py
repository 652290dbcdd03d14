"""Crashes found from outside (issue 16), each against one device: negative dims in view
backwards, and meta meshes (shape-only planning, no communication)."""

from __future__ import annotations

import itertools

import pytest
import torch

import vescale
from tests.dtensor.reference import coord_of, expected_local, mesh_of
from tests.harness import fake_world
from tests.harness.collectives import count_collectives
from vescale import Partial, Replicate, Shard

X = torch.arange(24, dtype=torch.float64).reshape(4, 6) / 7


def _check_view_backward(fn_name, placements, dim, arg):
    """``x.<fn>(dim, ...)`` forward and backward (weighted sum) equal one device."""
    mesh = mesh_of((2,))
    fn = {
        "select": lambda t: t.select(dim, arg),
        "narrow": lambda t: t.narrow(dim, arg, 2),
    }[fn_name]
    ref_in = X.clone().requires_grad_(True)
    ref = fn(ref_in)
    w = torch.linspace(-1, 2, ref.numel(), dtype=torch.float64).view(ref.shape)
    (ref * w).sum().backward()
    dt = vescale.distribute_tensor(X, mesh, placements).requires_grad_(True)
    with vescale.dtensor.explicit_redistribute(False):
        out = fn(dt)
        dw = vescale.distribute_tensor(w, mesh, out.placements)
        (out * dw).sum().backward()
    torch.testing.assert_close(out.full_tensor(), ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(dt.grad.full_tensor(), ref_in.grad, rtol=0, atol=0)


@pytest.mark.parametrize(
    "fn_name,dim,arg", [("select", -1, 0), ("select", -2, 3), ("narrow", -1, 1), ("select", 1, 3)]
)
@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)], [Replicate()]], ids=str)
def test_negative_dim_view_backward(pool2, fn_name, dim, arg, placements):
    pool2.run(_check_view_backward, fn_name, placements, dim, arg)


PLACEMENTS = [Replicate(), Shard(0), Shard(1), Partial()]


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_meta_mesh_redistributes_shapes_only(mesh_shape):
    """Every pair of placements on a meta mesh: local meta tensors of this rank's shard
    shape, global shape kept, no collective; ``full_tensor`` is the global (meta) shape."""
    shape = (10, 6)  # uneven over 4: 3, 3, 3, 1
    ref = torch.empty(shape)
    for rank in (0, 3):
        with fake_world(4, rank):
            mesh = vescale.DeviceMesh("meta", torch.arange(4).reshape(mesh_shape))
            coord = coord_of(mesh_shape, rank)
            per_mesh = list(itertools.product(PLACEMENTS, repeat=len(mesh_shape)))
            with count_collectives() as counts:
                for src, dst in itertools.product(per_mesh, per_mesh):
                    dt = vescale.distribute_tensor(torch.empty(shape, device="meta"), mesh, src)
                    out = dt.redistribute(mesh, dst)
                    expected = expected_local(ref, mesh_shape, coord, dst).shape
                    assert out._local_tensor.device.type == "meta", (src, dst)
                    assert tuple(out._local_tensor.shape) == tuple(expected), (src, dst)
                    assert tuple(out.shape) == shape
                full = dt.full_tensor()
            assert full.device.type == "meta" and tuple(full.shape) == shape
            assert sum(counts.values()) == 0, dict(counts)


def test_meta_mesh_ops_without_redistribution():
    """Ops whose strategy needs no redistribution run on meta shards: matmul of a row
    shard by a replicated weight and a sum to Partial."""
    with fake_world(4, 1):
        mesh = vescale.DeviceMesh("meta", [0, 1, 2, 3])
        x = vescale.distribute_tensor(torch.empty(10, 6, device="meta"), mesh, [Shard(0)])
        w = vescale.distribute_tensor(torch.empty(6, 5, device="meta"), mesh, [Replicate()])
        with count_collectives() as counts:
            y = x @ w
            s = y.sum()
        assert y.placements == (Shard(0),) and tuple(y.shape) == (10, 5)
        assert tuple(y._local_tensor.shape) == (3, 5) and y._local_tensor.is_meta
        assert s.placements == (Partial(),) and s._local_tensor.is_meta
        assert sum(counts.values()) == 0, dict(counts)


def test_meta_mesh_implicit_redistribution_through_ops():
    """Ops whose strategy redistributes an input (matmul of two row shards, an add of a
    row and a column shard, a Partial input to a nonlinear op) plan on a meta mesh: meta
    results of the single-device shapes, this rank's shard shapes, no collective."""
    with fake_world(4, 3):
        mesh = vescale.DeviceMesh("meta", [0, 1, 2, 3])
        x = vescale.distribute_tensor(torch.empty(10, 6, device="meta"), mesh, [Shard(0)])
        w = vescale.distribute_tensor(torch.empty(6, 5, device="meta"), mesh, [Shard(0)])
        c = vescale.distribute_tensor(torch.empty(10, 6, device="meta"), mesh, [Shard(1)])
        p = vescale.distribute_tensor(torch.empty(10, 6, device="meta"), mesh, [Partial()])
        with vescale.dtensor.explicit_redistribute(False), count_collectives() as counts:
            outs = [x @ w, x + c, p.exp()]
        assert sum(counts.values()) == 0, dict(counts)
        for out, shape in zip(outs, [(10, 5), (10, 6), (10, 6)]):
            assert tuple(out.shape) == shape and out._local_tensor.is_meta
            want = expected_local(torch.empty(shape), (4,), (3,), out.placements).shape
            assert tuple(out._local_tensor.shape) == tuple(want), out.placements
