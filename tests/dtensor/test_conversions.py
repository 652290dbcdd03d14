"""distribute_tensor / from_local / to_local / full_tensor / redistribute against torch.chunk
references on real gloo ranks: 1-D meshes of 2 and 4 ranks and a 2x2 mesh, uneven shapes,
forward and backward (redistribution: every pair on 1-D meshes, a strength-3 covering on 2x2,
every pair with --full)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import vescale
from tests.dtensor.reference import (
    coord_of,
    expected_local,
    layout_pairs,
    mesh_of,
    partial_source,
)
from vescale import DTensor, Partial, Replicate, Shard
from vescale._torch_compat import AsyncCollectiveTensor

MESHES = {2: [(2,)], 4: [(4,), (2, 2)]}
SHAPE = (5, 7)  # uneven on every mesh above
BASIC = [Shard(0), Shard(1), Replicate(), Partial("sum")]


def _placement_sets(ndim: int):
    return list(itertools.product(BASIC, repeat=ndim))


def _check_distribute(mesh_shape):
    mesh = mesh_of(mesh_shape)
    coord = coord_of(mesh_shape)
    rank = dist.get_rank()
    base = torch.arange(35, dtype=torch.float64).reshape(SHAPE)
    for placements in _placement_sets(len(mesh_shape)):
        mine = base + 100 * rank  # data must come from coordinate 0 (rank 0 here)
        before = mine.clone()
        d = vescale.distribute_tensor(mine, mesh, placements)
        assert isinstance(d, DTensor)
        assert torch.equal(mine, before), "caller's tensor modified"
        assert d.shape == SHAPE and tuple(d.placements) == placements
        want = expected_local(base, mesh_shape, coord, placements)
        assert torch.equal(d.to_local(), want), (placements, d.to_local(), want)
        assert torch.equal(d.full_tensor(), base), placements


def _check_partial_int_exact(mesh_shape):
    mesh = mesh_of(mesh_shape)
    coord = coord_of(mesh_shape)
    big = torch.tensor([2**40 + 1, -7, 3], dtype=torch.int64)
    for op in ("sum", "max", "min", "avg", "product"):
        if op == "avg":
            continue  # averaging integers is not exact in any layout
        placements = [Partial(op)] * len(mesh_shape)
        d = vescale.distribute_tensor(big, mesh, placements)
        assert torch.equal(d.to_local(), expected_local(big, mesh_shape, coord, placements)), op
        assert torch.equal(d.full_tensor(), big), op


def _check_from_local_uneven(mesh_shape):
    mesh = mesh_of(mesh_shape)
    coord = coord_of(mesh_shape)
    full = torch.randn(*SHAPE, dtype=torch.float64)
    for placements in _placement_sets(len(mesh_shape)):
        if any(p.is_partial() for p in placements):
            continue
        local = expected_local(full, mesh_shape, coord, placements).clone()
        d = vescale.from_local(local, mesh, placements, run_check=False)
        assert d.shape == SHAPE, (placements, d.shape)
        assert d.stride() == full.stride(), (placements, d.stride())
        assert torch.equal(d.full_tensor(), full), placements
        assert d.to_local().data_ptr() == local.data_ptr() == d.data_ptr()


def _check_from_local_bad_sizes():
    mesh = mesh_of((4,))
    rows = [1, 3, 2, 2][dist.get_rank()]  # sums to 8 but is not torch.chunk(8, 4) = 2,2,2,2
    with pytest.raises(ValueError, match=r"not the torch.chunk split of 8 over 4"):
        vescale.from_local(torch.zeros(rows, 3), mesh, [Shard(0)])
    with pytest.raises(ValueError, match="does not match the shard"):
        vescale.from_local(torch.zeros(3, 3), mesh, [Shard(0)], shape=(8, 3), stride=(3, 1))


def _check_run_check():
    mesh = mesh_of((4,))
    rank = dist.get_rank()
    mine = torch.full((3,), float(rank))
    d = vescale.from_local(mine, mesh, [Replicate()])
    assert torch.equal(d.to_local(), torch.zeros(3)), "Replicate data must come from rank 0"
    assert torch.equal(mine, torch.full((3,), float(rank))), "caller's tensor modified"
    kept = vescale.from_local(mine, mesh, [Replicate()], run_check=False)
    assert torch.equal(kept.to_local(), mine)


def _check_run_check_env_off():
    mesh = mesh_of((4,))
    mine = torch.full((3,), float(dist.get_rank()))
    assert torch.equal(vescale.from_local(mine, mesh, [Replicate()]).to_local(), mine)


def _grad_layout(placements):
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def _check_redistribute_pairs(mesh_shape, pairs):
    mesh = mesh_of(mesh_shape)
    coord = coord_of(mesh_shape)
    for src, dst in pairs:
        full, local = partial_source(src, mesh_shape, SHAPE)
        leaf = local.clone().requires_grad_(True)
        x = vescale.from_local(leaf, mesh, src, run_check=False)
        assert x.shape == SHAPE, (src, x.shape)
        y = x.redistribute(mesh, dst)
        assert tuple(y.placements) == tuple(dst) and y.shape == SHAPE, (src, dst)
        whole = y.full_tensor()  # one gather, checked and differentiated through
        assert torch.allclose(whole, full, atol=1e-12), (src, dst)
        if not any(p.is_partial() for p in dst):
            want = expected_local(full, mesh_shape, coord, dst)
            assert torch.allclose(y.to_local(async_output=False), want, atol=1e-12), (src, dst)
        if {p.reduce_op for p in src if isinstance(p, Partial)} <= {"sum"}:
            weight = torch.randn(*SHAPE, dtype=torch.float64)
            (whole * weight).sum().backward()
            want_grad = expected_local(weight, mesh_shape, coord, _grad_layout(src))
            assert torch.allclose(leaf.grad, want_grad, atol=1e-12), (src, dst)
    return len(pairs)


def _check_replicate_to_partial_is_local():
    mesh = mesh_of((2, 2))
    coord = coord_of((2, 2))
    full = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    r = vescale.distribute_tensor(full, mesh, [Replicate(), Replicate()])
    p = r.redistribute(mesh, [Partial(), Replicate()])
    want = full if coord[0] == 0 else torch.zeros_like(full)
    assert torch.equal(p.to_local(), want)
    assert torch.equal(r.to_local(), full), "source must stay untouched"
    s = vescale.distribute_tensor(full, mesh, [Shard(0), Replicate()]).redistribute(
        mesh, [Replicate(), Partial()]
    )
    assert torch.equal(s.to_local(), full if coord[1] == 0 else torch.zeros_like(full))
    assert torch.equal(s.full_tensor(), full)


def _check_async():
    mesh = mesh_of((4,))
    full = torch.randn(8, 4)
    d = vescale.distribute_tensor(full, mesh, [Shard(0)])
    r = d.redistribute(mesh, [Replicate()])  # async_op=True by default
    assert isinstance(r._local_tensor, AsyncCollectiveTensor)
    out = r.to_local(async_output=False)
    assert type(out) is torch.Tensor and torch.equal(out, full)
    r2 = d.redistribute(mesh, [Replicate()])
    assert isinstance(r2.to_local(), AsyncCollectiveTensor)  # async_output=True keeps it lazy
    assert r2.data_ptr() == r2._local_tensor.wait().data_ptr()
    sync = d.redistribute(mesh, [Replicate()], async_op=False)
    assert not isinstance(sync._local_tensor, AsyncCollectiveTensor)
    pending = d.redistribute(mesh, [Replicate()]).to_local()
    lazy = vescale.from_local(pending, mesh, [Replicate()], run_check=False)
    assert torch.equal(lazy.full_tensor(), full)
    waited = vescale.from_local(pending, mesh, [Replicate()], run_check=False, async_input=False)
    assert type(waited._local_tensor) is not AsyncCollectiveTensor


def _check_local_grads():
    mesh = mesh_of((2, 2))
    coord = coord_of((2, 2))
    full = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    placements = [Shard(0), Shard(1)]
    d = vescale.distribute_tensor(full.detach(), mesh, placements).requires_grad_(True)
    local = d.to_local()
    (local * 3).sum().backward()
    assert tuple(d.grad.placements) == tuple(placements)
    assert torch.equal(d.grad.full_tensor(), torch.full((6, 4), 3.0, dtype=torch.float64))
    weight = torch.randn(6, 4, dtype=torch.float64)
    for grad_placements, want in (
        (None, weight),  # the gradient of a Partial input is Replicate by default
        ([Partial(), Replicate()], weight if coord[0] == 0 else torch.zeros_like(weight)),
    ):
        leaf = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
        p = vescale.from_local(
            leaf, mesh, [Partial(), Replicate()], run_check=False, grad_placements=grad_placements
        )
        (p.full_tensor() * weight).sum().backward()
        assert torch.equal(leaf.grad, want), grad_placements
    src = vescale.distribute_tensor(full.detach(), mesh, [Replicate(), Shard(1)])
    src.requires_grad_(True)
    loc = src.to_local(grad_placements=[Partial(), Shard(1)])
    (loc.sum() * (coord[0] + 1)).backward()  # each row of ranks holds one partial piece
    assert tuple(src.grad.placements) == (Partial(), Shard(1))
    assert torch.equal(src.grad.full_tensor(), torch.full((6, 4), 3.0, dtype=torch.float64))


@pytest.mark.parametrize("world", [2, 4])
def test_distribute_tensor(world, request):
    pool = request.getfixturevalue(f"pool{world}")
    for mesh_shape in MESHES[world]:
        pool.run(_check_distribute, mesh_shape)
        pool.run(_check_partial_int_exact, mesh_shape)


@pytest.mark.parametrize("world", [2, 4])
def test_from_local_uneven(world, request):
    pool = request.getfixturevalue(f"pool{world}")
    for mesh_shape in MESHES[world]:
        pool.run(_check_from_local_uneven, mesh_shape)


def test_from_local_rejects_non_chunk_sizes(pool4):
    pool4.run(_check_from_local_bad_sizes)


def test_run_check_broadcasts_replicate(pool4):
    pool4.run(_check_run_check)
    pool4.run(_check_run_check_env_off, env={"VESCALE_DISABLE_RUN_CHECK": "1"})


def _redistribute_pairs(world, mesh_shape, request, full):
    pool = request.getfixturevalue(f"pool{world}")
    pairs = layout_pairs(BASIC, len(mesh_shape), full=full)
    if len(mesh_shape) == 1:
        mx = (Partial("max"),)
        pairs += [(mx, (Replicate(),)), (mx, (Shard(0),)), (mx, (Shard(1),)), (mx, mx)]
        pairs += [((Replicate(),), mx), ((Shard(1),), mx), ((Partial("sum"),), mx)]
    assert pool.run(_check_redistribute_pairs, mesh_shape, pairs)[0] == len(pairs)


@pytest.mark.parametrize(
    "world,mesh_shape", [(2, (2,)), (4, (4,)), (4, (2, 2))], ids=["1d-2", "1d-4", "2d-2x2"]
)
def test_redistribute_every_pair(world, mesh_shape, request):
    """Every pair on 1-D meshes (and Partial("max") to and from each kind); on 2x2 the
    strength-3 covering of reference.layout_pairs (each mesh dim's transition with every
    placement of the other mesh dim as source and as destination: 64 of the 256 pairs); the
    full product runs with --full."""
    _redistribute_pairs(world, mesh_shape, request, full=False)


def test_default_2x2_pairs_cover_every_triple():
    """The promise of reference.layout_pairs that the 2x2 defaults rest on: any three of
    (src[0], src[1], dst[0], dst[1]) take every combination of choices; --full is the product."""
    choices = [*BASIC, Partial("max")]
    rows = [(*src, *dst) for src, dst in layout_pairs(choices, 2, full=False)]
    for factors in itertools.combinations(range(4), 3):
        seen = {tuple(repr(r[f]) for f in factors) for r in rows}
        assert len(seen) == len(choices) ** 3, factors
    full = layout_pairs(choices, 2, full=True)
    assert len(set(map(repr, full))) == len(choices) ** 4


@pytest.mark.full
def test_redistribute_every_pair_2x2_full_product(request):
    """All 256 pairs on 2x2 (nightly-style)."""
    _redistribute_pairs(4, (2, 2), request, full=True)


def test_replicate_to_partial_is_local(pool4):
    pool4.run(_check_replicate_to_partial_is_local)


def test_async_collectives(pool4):
    pool4.run(_check_async)


def test_to_local_and_from_local_gradients(pool4):
    pool4.run(_check_local_grads)
