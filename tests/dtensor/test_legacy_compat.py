"""veScale legacy's names (thin aliases over vescale's), each checked against one device:
mesh collectives, ``vescale_all_*``, DeviceMesh keywords and groups, DTensor factories, the
legacy constructor, ``tolist``, ``equal``/``allclose`` and the layout helpers."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import vescale
from tests.dtensor.reference import coord_of, expected_local, mesh_of
from vescale import DeviceMesh, DTensor, InterleavedShard, Partial, Replicate, Shard
from vescale import dtensor as vdt
from vescale.dtensor import _collective_utils as cu
from vescale.dtensor._utils import (
    compute_global_tensor_info,
    compute_local_shape,
    gather_local_tensor_shape,
)
from vescale.dtensor.api import vescale_all_gather, vescale_all_reduce, vescale_reduce_scatter
from vescale.dtensor.loss import loss_parallel
from vescale.dtensor.random import is_rng_supported_mesh, manual_seed


def _rank_tensor(r: int, *shape: int) -> torch.Tensor:
    """A tensor every rank can rebuild for any rank ``r``."""
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape) + 100 * r


def _check_collectives() -> None:
    mesh = mesh_of((2, 2))
    me = dist.get_rank()
    row, col = coord_of((2, 2))
    for mesh_dim, peers in ((0, [col, 2 + col]), (1, [2 * row, 2 * row + 1])):
        mine = _rank_tensor(me, 2, 3)
        got = cu.mesh_all_gather(mine, (4, 3), mesh, scatter_dim=0, mesh_dim=mesh_dim)
        torch.testing.assert_close(got, torch.cat([_rank_tensor(r, 2, 3) for r in peers]))
        total = sum(_rank_tensor(r, 4, 3) for r in peers)
        for op in ("sum", dist.ReduceOp.SUM):
            got = cu.mesh_all_reduce(_rank_tensor(me, 4, 3), mesh, op, mesh_dim=mesh_dim)
            torch.testing.assert_close(got, total)
        got = cu.mesh_reduce_scatter(_rank_tensor(me, 4, 3), mesh, "sum", 0, mesh_dim)
        torch.testing.assert_close(got, total.chunk(2)[peers.index(me)])
        t = _rank_tensor(me, 3)
        assert cu.mesh_broadcast(t, mesh, mesh_dim=mesh_dim) is t
        torch.testing.assert_close(t, _rank_tensor(peers[0], 3))
        out = torch.empty(3, dtype=torch.float64)
        cu.mesh_scatter(out, [_rank_tensor(me, 3) + i for i in range(2)], mesh, mesh_dim=mesh_dim)
        torch.testing.assert_close(out, _rank_tensor(peers[0], 3) + peers.index(me))
        outs = [torch.empty(2, dtype=torch.float64) for _ in peers]
        cu.mesh_all_to_all(outs, [_rank_tensor(me, 2) + 10 * i for i in range(2)], mesh, mesh_dim)
        expected = [_rank_tensor(r, 2) + 10 * peers.index(me) for r in peers]
        torch.testing.assert_close(outs, expected)
    with pytest.raises(ValueError, match="mesh_all_gather: 2 shards of size 2 on dim 0"):
        cu.mesh_all_gather(_rank_tensor(me, 2, 3), (5, 3), mesh, scatter_dim=0, mesh_dim=0)


def test_mesh_collectives(pool4):
    pool4.run(_check_collectives)


def _check_api_collectives() -> None:
    mesh = mesh_of((2, 2))
    full = torch.randn(4, 6, dtype=torch.float64)
    d = vescale.distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    g = vescale_all_gather(d, mesh_dims=0, async_op=False)
    assert g.placements == (Replicate(), Shard(1))
    torch.testing.assert_close(g.full_tensor(), full)
    assert vescale_all_gather(d).placements == (Replicate(), Replicate())
    with pytest.raises(ValueError, match=r"vescale_all_gather: mesh dim 1 is not sharded"):
        vescale_all_gather(vescale.distribute_tensor(full, mesh, [Shard(0)]), mesh_dims=1)
    p = vescale.distribute_tensor(full, mesh, [Partial(), Replicate()])
    r = vescale_all_reduce(p, mesh_dims=[0])
    assert r.placements == (Replicate(), Replicate())
    torch.testing.assert_close(r.to_local(), full)
    with pytest.raises(ValueError, match=r"vescale_all_reduce: mesh dim 1 is not Partial"):
        vescale_all_reduce(p, mesh_dims=1)
    s = vescale_reduce_scatter(p, reduce_mesh_dims=0, scatter_dims=1, mesh_dims=0)
    assert s.placements == (Shard(1), Replicate())
    torch.testing.assert_close(s.full_tensor(), full)


def test_vescale_all_gather_reduce_scatter(pool4):
    pool4.run(_check_api_collectives)


def _check_mesh() -> None:
    ranks = torch.arange(4).reshape(2, 2)
    mesh = DeviceMesh("cpu", ranks)
    groups = mesh.get_dim_groups()
    assert [dist.get_process_group_ranks(g) for g in groups] == [
        ranks[:, mesh.get_coordinate()[1]].tolist(),
        ranks[mesh.get_coordinate()[0]].tolist(),
    ]
    assert mesh.get_dim_groups(1) is groups[1]
    assert (mesh.size(dim=1), mesh.size(0), mesh.size()) == (2, 2, 4)
    infos = mesh._dim_group_infos
    assert [i[1] for i in infos] == [dist.get_process_group_ranks(g) for g in groups]
    assert [i[2] for i in infos] == [g.group_name for g in groups]
    lazy = DeviceMesh("cpu", [0, 3], _init_process_groups=False)
    with pytest.raises(RuntimeError, match="process groups not initialized!"):
        lazy.get_dim_groups()
    assert lazy._dim_group_infos == []
    with pytest.raises(RuntimeError, match="duplicate values"):
        DeviceMesh("cpu", torch.zeros(4))
    with pytest.raises(RuntimeError, match="bigger than the world size 4"):
        DeviceMesh("cpu", torch.arange(8))
    DeviceMesh("cpu", torch.arange(8), _validate_mesh=False, _init_process_groups=False)
    with pytest.raises(ValueError, match="mesh or pg must be provided!"):
        DeviceMesh("cpu")
    with pytest.raises(ValueError, match="must have the same content"):
        DeviceMesh("cpu", [0, 1], pg=dist.group.WORLD)
    assert not Shard(0).is_interleaved_shard() and not Replicate().is_interleaved_shard()
    assert not Partial().is_interleaved_shard()
    assert InterleavedShard(0, 2).is_interleaved_shard()


def test_device_mesh_legacy_api(pool4):
    pool4.run(_check_mesh)


_FACTORIES = [
    (vdt.zeros, torch.zeros, ()),
    (vdt.ones, torch.ones, ()),
    (vdt.full, torch.full, (2.5,)),
]


def _check_factories() -> None:
    mesh1, mesh2 = mesh_of((4,)), mesh_of((2, 2))
    cases = [
        (mesh1, [Shard(0)]),
        (mesh1, [Shard(1)]),
        (mesh1, [Replicate()]),
        (mesh1, [Partial()]),
        (mesh1, [Partial("max")]),
        (mesh2, [Shard(0), Partial()]),
        (mesh2, [Partial(), Shard(1)]),
        (mesh2, [Partial(), Partial()]),
        (mesh2, [Shard(1), Shard(0)]),
    ]
    for shape in ((4, 8), (5, 7)):
        for mesh, pl in cases:
            coord = coord_of(mesh.shape)
            for dfac, tfac, extra in _FACTORIES:
                size = (shape,) if tfac is torch.full else shape
                d = dfac(*size, *extra, device_mesh=mesh, placements=pl, requires_grad=True)
                ref = tfac(shape, *extra) if tfac is torch.full else tfac(shape)
                assert d.shape == ref.shape and d.requires_grad and d.is_leaf
                assert tuple(d.placements) == tuple(pl)
                torch.testing.assert_close(
                    d.to_local(), expected_local(ref, mesh.shape, coord, pl), rtol=0, atol=0
                )
                torch.testing.assert_close(d.full_tensor(), ref, rtol=0, atol=0)
            e = vdt.empty(shape, device_mesh=mesh, placements=pl, dtype=torch.float16)
            assert e.dtype == torch.float16 and e.shape == shape
            for dfac, tfac in ((vdt.rand, torch.rand), (vdt.randn, torch.randn)):
                torch.manual_seed(7)
                ref = tfac(shape, dtype=torch.float64)
                torch.manual_seed(7)
                d = dfac(shape, dtype=torch.float64, device_mesh=mesh, placements=pl)
                torch.testing.assert_close(d.full_tensor(), ref, rtol=0, atol=0)
    for args in ((5,), (0, 4), (11, 22, 2), (0, -10, -1), (2, -100, -3), (0.0, 1.0, 0.25)):
        ref = torch.arange(*args)
        for pl in ([Shard(0)], [Replicate()], [Partial()]):
            d = vdt.arange(*args, device_mesh=mesh1, placements=pl)
            assert d.dtype == ref.dtype
            torch.testing.assert_close(
                d.to_local(), expected_local(ref, (4,), coord_of((4,)), pl), rtol=0, atol=0
            )
            torch.testing.assert_close(d.full_tensor(), ref, rtol=0, atol=0)
    # a sub-mesh without process groups: ranks outside hold an empty local tensor
    sub = DeviceMesh("cpu", [0, 3], _init_process_groups=False)
    for pl, local in (([Shard(0)], (16, 3)), ([Partial()], (32, 3))):
        d = vdt.zeros(32, 3, device_mesh=sub, placements=pl)
        assert d.shape == (32, 3)
        assert d.to_local().shape == (local if dist.get_rank() in (0, 3) else (0,))
    with pytest.raises(ValueError, match="arange: step must be nonzero"):
        vdt.arange(0, 4, 0, device_mesh=mesh1)


def test_factories_match_torch(pool4):
    pool4.run(_check_factories)


def _check_legacy_constructor() -> None:
    mesh = mesh_of((4,))
    local = torch.randn(3, 3, requires_grad=True)
    d = DTensor(
        local,
        mesh,
        [Shard(0)],
        shape=torch.Size([12, 3]),
        dtype=local.dtype,
        requires_grad=True,
        stride=local.stride(),
    )
    assert type(d) is DTensor and d.shape == (12, 3) and d.placements == (Shard(0),)
    assert d._local_tensor is local and torch.equal(d.to_local(), local)
    for local_grad in (True, False):
        with pytest.warns(UserWarning, match="To construct"):
            DTensor(local.detach().requires_grad_(local_grad), mesh, [Shard(0)], shape=(12, 3),
                    dtype=local.dtype, requires_grad=not local_grad, stride=(3, 1))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same = DTensor(local.detach(), d._spec, requires_grad=False)  # upstream's signature
    assert same.placements == (Shard(0),) and same.shape == (12, 3)
    full = torch.arange(16.0).view(4, 4)
    for pl in ([Replicate()], [Shard(0)], [Shard(1)]):
        t = vescale.distribute_tensor(full, mesh, pl)
        assert t.tolist() == expected_local(full, (4,), coord_of((4,)), pl).tolist()


def test_legacy_constructor_and_tolist(pool4):
    pool4.run(_check_legacy_constructor)


def _check_equal_and_utils() -> None:
    mesh = mesh_of((4,))
    full = torch.ones(8, 8)
    d1 = vescale.distribute_tensor(full, mesh, [Shard(1)])
    assert vdt.equal(d1, d1) and vdt.allclose(d1, d1)
    assert vdt.equal(d1, vescale.distribute_tensor(full.clone(), mesh, [Shard(1)]))
    assert not vdt.equal(d1, vescale.distribute_tensor(full, mesh, [Shard(0)]))
    assert not vdt.equal(d1, vescale.distribute_tensor(full.requires_grad_(), mesh, [Shard(1)]))
    full.requires_grad_(False)
    near = vescale.distribute_tensor(full + 1e-6, mesh, [Shard(1)])
    assert not vdt.equal(d1, near) and vdt.allclose(d1, near)
    assert not vdt.allclose(d1, vescale.distribute_tensor(full + 0.1, mesh, [Shard(1)]))
    assert not vdt.equal(d1, full)
    mesh2 = mesh_of((2, 2))
    assert compute_local_shape((5, 7), mesh2, [Shard(0), Shard(1)]) == tuple(
        expected_local(torch.empty(5, 7), (2, 2), coord_of((2, 2)), [Shard(0), Shard(1)]).shape
    )
    assert compute_local_shape((5, 7), DeviceMesh("cpu", [0, 1], _init_process_groups=False),
                               [Shard(0)]) == ((3, 7) if dist.get_rank() == 0 else (2, 7) if
                                               dist.get_rank() == 1 else ())  # fmt: skip
    for pl in ([Shard(1)], [Replicate()]):
        g = torch.randn(4, 5, 3)
        local = vescale.distribute_tensor(g, mesh, pl).to_local()
        shapes = gather_local_tensor_shape(local, mesh, pl)
        expected = [list(expected_local(g, (4,), (r,), pl).shape) for r in range(4)]
        assert shapes == {0: expected}
        assert gather_local_tensor_shape(local, mesh, pl, shard_only=True) == (
            {0: expected} if pl[0].is_shard() else {}
        )
        shape, stride = compute_global_tensor_info(local, mesh, pl, shapes)
        assert (shape, stride) == (list(g.shape), list(g.stride()))
    for pl in ([Shard(2), Shard(1)], [Partial(), Shard(1)], [Shard(1), Replicate()]):
        g = torch.randn(4, 7, 3)
        local = vescale.distribute_tensor(g, mesh2, pl).to_local()
        shapes = gather_local_tensor_shape(local, mesh2, pl)
        shape, stride = compute_global_tensor_info(local, mesh2, pl, shapes)
        assert (shape, stride) == (list(g.shape), list(g.stride()))


def _check_manual_seed() -> None:
    mesh = mesh_of((4,))
    manual_seed(3, mesh)
    ref = torch.rand(4, 4)
    manual_seed(3, mesh)
    d = vdt.rand(4, 4, device_mesh=mesh, placements=[Shard(0)])
    torch.testing.assert_close(d.full_tensor(), ref, rtol=0, atol=0)
    assert is_rng_supported_mesh(mesh)
    with pytest.raises(
        ValueError, match=r"manual_seed: ranks passed different seeds \[0, 1, 2, 3\]"
    ):
        manual_seed(dist.get_rank(), mesh)


def test_manual_seed(pool4):
    pool4.run(_check_manual_seed)


def test_equal_allclose_and_layout_helpers(pool4):
    pool4.run(_check_equal_and_utils)


def _check_loss_parallel() -> None:
    mesh = mesh_of((4,))
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    target = torch.randint(8, (6,))
    y = F.cross_entropy(x, target)
    y.backward()
    dx = vescale.distribute_tensor(x.detach(), mesh, [Shard(1)]).requires_grad_()
    with loss_parallel():
        dy = F.cross_entropy(dx, target)
        assert dy.placements == (Replicate(),)
        torch.testing.assert_close(dy.to_local(), y)
        dy.backward()
    assert dx.grad.placements == (Shard(1),)
    torch.testing.assert_close(dx.grad.full_tensor(), x.grad)


def test_loss_parallel_import_path(pool4):
    pool4.run(_check_loss_parallel)


@pytest.mark.parametrize("dim", [0, 1])
def test_shard_unpad_tensor_undoes_split_padding(dim):
    """Legacy's ``Shard._unpad_tensor`` on the padded pieces of ``_split_tensor`` gives
    ``torch.chunk``'s pieces (13 rows over 4: 4, 4, 4, 1; over 6: five of 3, none), as views."""
    t = torch.arange(13 * 5, dtype=torch.float64).view(13, 5)
    t = t if dim == 0 else t.t().contiguous()
    for n in (4, 6):
        padded, pads = Shard(dim)._split_tensor(t, n, with_padding=True, contiguous=True)
        chunks = list(torch.chunk(t, n, dim=dim))
        assert len(padded) == n and len(set(p.size(dim) for p in padded)) == 1
        for i, (piece, pad) in enumerate(zip(padded, pads)):
            out = Shard(dim)._unpad_tensor(piece, pad)
            assert out._base is piece or out._base is piece._base  # a view
            want = chunks[i] if i < len(chunks) else t.narrow(dim, 0, 0)
            assert torch.equal(out, want), (n, i)
