"""Placements, meta meshes, and the single-process harnesses (fake process group,
LocalTensorMode), all in the pytest process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensor
from torch.distributed.tensor import DTensor as UpstreamDTensor
from torch.distributed.tensor import Partial as UpstreamPartial

import vescale
from tests.harness import fake_world, local_world
from vescale import Partial, Replicate, Shard


def test_partial_accepts_reduce_op_and_hashes_like_upstream():
    assert Partial(dist.ReduceOp.SUM) == Partial("sum") == Partial() == UpstreamPartial("sum")
    assert Partial(dist.ReduceOp.MAX).reduce_op == "max"
    assert Partial(dist.ReduceOp(dist.ReduceOp.AVG)) == Partial("avg")
    assert Partial("sum") != Partial("max")
    table = {Partial("sum"): "p", Shard(0): "s0", Replicate(): "r"}
    assert table[UpstreamPartial("sum")] == "p" and table[Shard(0)] == "s0"
    assert table[Replicate()] == "r" and Shard(1) not in table
    assert isinstance(UpstreamPartial("max"), Partial)  # op outputs are ours too
    assert vescale.Shard is torch.distributed.tensor.Shard


def test_meta_mesh_needs_no_process_group():
    assert not dist.is_initialized()
    mesh = vescale.DeviceMesh("meta", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    assert mesh.shape == (2, 2) and tuple(mesh.get_coordinate()) == (0, 0)
    x = vescale.from_local(torch.empty(4, 3, device="meta"), mesh, [Shard(0), Shard(1)])
    assert x.shape == (8, 6) and x.device.type == "meta"
    d = vescale.distribute_tensor(
        torch.empty(8, 6, device="meta"), vescale.init_device_mesh("meta", (4,)), [Shard(1)]
    )
    assert d.to_local().shape == (8, 2)
    assert [m.mesh.tolist() for m in mesh.get_all_submesh("tp")] == [[0, 1], [2, 3]]
    assert mesh.get_submesh("dp").mesh.tolist() == [0, 2]


def test_fake_process_group_at_512_ranks():
    with fake_world(512, rank=37):
        mesh = vescale.init_device_mesh("cpu", (16, 32), mesh_dim_names=("dp", "tp"))
        assert tuple(mesh.get_coordinate()) == (1, 5)
        x = vescale.distribute_tensor(torch.randn(100, 64), mesh, [Shard(0), Shard(1)])
        assert x.to_local().shape == (7, 2)  # torch.chunk(100, 16)[1] has 7 rows
        assert isinstance(x + x, vescale.DTensor)
        y = (x * 2).redistribute(mesh, [Replicate(), Shard(1)])
        assert y.to_local(async_output=False).shape == (100, 2)


def test_local_tensor_mode_simulates_real_numerics():
    full = torch.randn(10, 6, dtype=torch.float64)
    with local_world(4):
        mesh = vescale.init_device_mesh("cpu", (2, 2))
        x = vescale.distribute_tensor(full, mesh, [Shard(0), Shard(1)])
        y = (x.redistribute(mesh, [Replicate(), Shard(0)]) * 3).full_tensor()
        p = vescale.distribute_tensor(full, mesh, [Partial(), Replicate()])
        s = p.redistribute(mesh, [Shard(1), Replicate()]).full_tensor()
    assert isinstance(y, LocalTensor) and isinstance(s, LocalTensor)  # one value per rank
    assert torch.allclose(y.reconcile(), full * 3)  # reconcile: every rank holds the same
    assert torch.allclose(s.reconcile(), full)


def test_vescale_dtensor_is_an_upstream_dtensor():
    assert issubclass(vescale.DTensor, UpstreamDTensor)
    assert issubclass(vescale.DeviceMesh, torch.distributed.device_mesh.DeviceMesh)


def test_strided_shard_gathers_on_fake_tensors():
    """``_StridedShard -> Replicate`` traces on fake tensors (the plan path's capture and
    Dynamo run there: upstream's own gather reads the pieces' offsets out of a tensor and
    raised ``DataDependentOutputException``); values: ``test_interleaved_shard.py``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vescale._torch_compat import StridedShard

    for rows, k in ((32, 2), (30, 2), (7, 3)):
        with fake_world(2):
            mesh = vescale.init_device_mesh("cpu", (2,))
            with FakeTensorMode():
                empty = torch.empty(rows, 3)
                strided = [StridedShard(0, split_factor=k)]
                x = vescale.distribute_tensor(empty, mesh, strided, src_data_rank=None)
                assert x.redistribute(mesh, [Replicate()]).to_local().shape == (rows, 3)
