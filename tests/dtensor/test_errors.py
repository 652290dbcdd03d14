"""Bad input gets a clear error naming the API or op, the placements and the mesh."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import vescale
from tests.dtensor.reference import mesh_of
from vescale import Partial, Replicate, Shard


def _check_errors():
    mesh = mesh_of((2, 2))
    t = torch.randn(4, 4)
    with pytest.raises(
        ValueError,
        match=r"distribute_tensor: Shard\(dim=2\) on mesh dim 0 is out of range for a 2-D tensor",
    ):
        vescale.distribute_tensor(t, mesh, [Shard(2)])
    with pytest.raises(ValueError, match=r"from_local: 3 placements .* for a 2-D mesh"):
        vescale.from_local(t, mesh, [Shard(0), Replicate(), Replicate()])
    with pytest.raises(TypeError, match=r"placements\[1\] = 'shard' is not a Placement"):
        vescale.distribute_tensor(t, mesh, [Shard(0), "shard"])
    with pytest.raises(TypeError, match="must be a sequence of Placement"):
        vescale.distribute_tensor(t, mesh, Shard(0))
    with pytest.raises(ValueError, match="pass both shape and stride or neither"):
        vescale.from_local(t, mesh, [Shard(0)], shape=(8, 4))
    d = vescale.distribute_tensor(t, mesh, [Shard(0)])
    with pytest.raises(
        TypeError,
        match=r"from_local: expected the local torch.Tensor shard, got a DTensor \(placements \(Shard\(dim=0\), Replicate\(\)\)",
    ):
        vescale.from_local(d, mesh, [Shard(0)])
    with pytest.raises(TypeError, match="distribute_tensor: input is already a DTensor"):
        vescale.distribute_tensor(d, mesh, [Shard(0)])
    with pytest.raises(
        ValueError,
        match=r"redistribute: placements is required \(DTensor has \(Shard\(dim=0\), Replicate\(\)\)",
    ):
        d.redistribute(mesh, None)
    with pytest.raises(ValueError, match="mixed Partial reduce ops"):
        d.redistribute(mesh, [Partial("sum"), Partial("max")])
    with pytest.raises(ValueError, match="cannot move a DTensor from"):
        d.redistribute(mesh_of((4,)), [Replicate()])
    with pytest.raises(RuntimeError, match=r"aten.add.Tensor got mixed torch.Tensor and DTensor"):
        d + torch.ones(4, 4)
    with pytest.raises(
        NotImplementedError,
        match=r"aten._cdist_forward.default: no sharding strategy for inputs "
        r"\(Shard\(dim=0\), Replicate\(\)\) \[4, 4\], .* on DeviceMesh\(\(2, 2\)",
    ):
        torch.cdist(d, d)
    with pytest.raises(ValueError, match="unsupported reduce_op 'mean'"):
        Partial("mean")
    with pytest.raises(ValueError, match="no device_mesh given and none active"):
        vescale.distribute_tensor(t)
    with mesh:
        assert vescale.distribute_tensor(t).placements == (Replicate(), Replicate())


def _check_mesh_from_pg():
    rank = dist.get_rank()
    pg = dist.new_group([0, 1, 2, 3])
    m = vescale.DeviceMesh("cpu", pg=pg)
    assert isinstance(m, vescale.DeviceMesh) and m.mesh.tolist() == [0, 1, 2, 3]
    assert m.get_group(0) is pg
    same = vescale.DeviceMesh("cpu", [0, 1, 2, 3], pg=pg)
    assert same.mesh.tolist() == [0, 1, 2, 3]
    with pytest.raises(
        ValueError, match=r"mesh \[0, 1\] and process group ranks \[0, 1, 2, 3\] differ"
    ):
        vescale.DeviceMesh("cpu", [0, 1], pg=pg)
    with pytest.raises(ValueError, match="pass mesh=, pg=, or both"):
        vescale.DeviceMesh("cpu")
    x = vescale.distribute_tensor(torch.arange(8.0), m, [Shard(0)])
    assert x.to_local().tolist() == [2.0 * rank, 2.0 * rank + 1]
    g = vescale.DeviceMesh.from_group(pg, "cpu")
    assert isinstance(g, vescale.DeviceMesh) and g.mesh.tolist() == [0, 1, 2, 3]


def _check_submeshes():
    rank = dist.get_rank()
    named = vescale.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert isinstance(named, vescale.DeviceMesh) and isinstance(named["tp"], vescale.DeviceMesh)
    for mesh in (named, mesh_of((2, 2))):
        tp = mesh.get_submesh([1])
        assert isinstance(tp, vescale.DeviceMesh)
        assert tp.mesh.tolist() == [2 * (rank // 2), 2 * (rank // 2) + 1]
        dp = mesh.get_submesh([0])
        assert dp.mesh.tolist() == [rank % 2, rank % 2 + 2]
        assert mesh.get_submesh([0, 1]).mesh.tolist() == [[0, 1], [2, 3]]
        rows = mesh.get_all_submesh(1)
        assert [r.mesh.tolist() for r in rows] == [[0, 1], [2, 3]]
        cols = mesh.get_all_submesh(0)
        assert [c.mesh.tolist() for c in cols] == [[0, 2], [1, 3]]
        mine = next(c for c in cols if rank in c.mesh.tolist())
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mine.get_group(0))  # the split meshes own usable groups
        assert t.item() == float(rank % 2 + rank % 2 + 2)
        s = vescale.distribute_tensor(torch.arange(4.0), tp, [Shard(0)])
        assert s.to_local().tolist() == [2.0 * (rank % 2), 2.0 * (rank % 2) + 1]
    assert named.get_submesh("tp").mesh_dim_names == ("tp",)
    with pytest.raises(ValueError, match="no mesh dim named 'pp'"):
        named.get_submesh("pp")
    with pytest.raises(ValueError, match="mesh dim 2 out of range"):
        named.get_all_submesh(2)


def test_errors(pool4):
    pool4.run(_check_errors)


def test_mesh_from_process_group(pool4):
    pool4.run(_check_mesh_from_pg)


def test_submeshes(pool4):
    pool4.run(_check_submeshes)
