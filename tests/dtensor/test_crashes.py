"""Crashes found from outside (issue 16), each against one device: negative dims in view
backwards, and meta meshes (shape-only planning, no communication), also for every op case
of the fuzz (``python -m tests.dtensor.test_crashes`` prints that sweep's table)."""

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


def _check_empty_reshapes():
    """Reshapes of empty tensors in every layout: upstream's ``view_groups`` never returns
    for ``(2, 0) -> (0, 2)`` (every rank hung); explicit mode on, nothing to redistribute."""
    mesh = mesh_of((2,))
    for placements in ([Shard(0)], [Replicate()], [Partial()]):
        for shape, size in (((2, 0), (0, 2)), ((0, 3), (3, 0)), ((4, 0, 2), (2, 0, 4))):
            if placements == [Partial()]:
                dt = vescale.from_local(torch.empty(shape), mesh, placements, run_check=False)
            else:
                dt = vescale.distribute_tensor(torch.empty(shape), mesh, placements)
            with count_collectives() as counts:
                for out in (dt.view(size), dt.reshape(size)):
                    assert out.shape == torch.Size(size), (placements, shape, out.shape)
                    assert out.to_local().numel() == 0
            assert sum(counts.values()) == 0, (placements, shape, dict(counts))


def test_reshapes_of_empty_tensors_return(pool2):
    pool2.run(_check_empty_reshapes, timeout_s=120)


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
                for src in per_mesh:
                    dt = vescale.distribute_tensor(torch.empty(shape, device="meta"), mesh, src)
                    for dst in per_mesh:
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


# Every op case of the fuzz (tests/dtensor/op_cases.py) on a meta mesh, shapes only.
META_NOT_APPLICABLE = {"unique"}  # data-dependent output shape: no meta kernel on one device


def _meta_layouts(case, inputs):
    """All inputs replicated; each input alone on each of its placements (Shard per dim,
    Partial where the case allows it); for shared inputs (attention's q, k, v) each placement."""
    opts = [
        [*(Shard(d) for d in range(t.ndim)), *([Partial()] if i in case.partial else [])]
        for i, t in enumerate(inputs)
    ]
    every = [(Replicate(),) * len(inputs)]
    if case.shared:
        return every + [(p,) * len(inputs) for p in opts[0]]
    for i, ps in enumerate(opts):
        every += [tuple(p if j == i else Replicate() for j in range(len(inputs))) for p in ps]
    return every


def _outs(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _check_meta_layout(case, inputs, ref, mesh, rank, layout):
    """One layout on the meta mesh: the single-device global shapes and dtypes, meta local
    tensors of this rank's shard shapes."""
    d = [vescale.distribute_tensor(x, mesh, [p]) for x, p in zip(inputs, layout)]
    with vescale.dtensor.explicit_redistribute(False):
        out = _outs(case.fn(*d))
    for o, r in zip(out, ref):
        assert (tuple(o.shape), o.dtype) == (tuple(r.shape), r.dtype), (o, r)
        assert o._local_tensor.is_meta
        if all(type(p) in (Replicate, Shard) for p in o.placements):
            want = expected_local(torch.empty(r.shape), (4,), (rank,), o.placements)
            assert o._local_tensor.shape == want.shape, o.placements


def _meta_sweep(rank):
    """(layouts run, {case: first failure}) of every case on a meta mesh of 4 as ``rank``;
    a case and size whose layouts issue any collective fail."""
    from tests.dtensor.op_cases import CASES, EVEN, EXTRA_CASES, UNEVEN

    ran, failed = 0, {}
    # The sharding caches key on the mesh, not on this process's rank: entries that an
    # earlier fake world of another rank left (local shape rewrites of views) are not ours.
    vescale._patches._clear_caches()
    with fake_world(4, rank):
        mesh = vescale.DeviceMesh("meta", [0, 1, 2, 3])
        for case, size in itertools.product((*CASES, *EXTRA_CASES), (EVEN, UNEVEN)):
            inputs = [x.to("meta") for x in case.make(*size, torch.Generator().manual_seed(0))]
            if case.name in META_NOT_APPLICABLE:
                with pytest.raises(NotImplementedError):
                    case.fn(*inputs)
                continue
            ref = _outs(case.fn(*inputs))
            with count_collectives() as n:  # one profiler per case and size, not per layout
                for layout in _meta_layouts(case, inputs):
                    ran += 1
                    try:
                        _check_meta_layout(case, inputs, ref, mesh, rank, layout)
                    except Exception as e:
                        msg = f"{size} {layout}: {type(e).__name__}: {e}"
                        failed.setdefault(case.name, msg[:300])
            if sum(n.values()):
                failed.setdefault(case.name, f"{size}: collectives {dict(n)}")
    return ran, failed


def test_op_cases_on_a_meta_mesh():
    """Every fuzz case on a meta mesh of 4 (fake process group) as rank 3, which holds the
    short and the empty shards of uneven sizes: outputs of the single-device global shapes
    and dtypes, meta local tensors of this rank's shard shapes, no collective;
    every case passes (handlers that communicate skip their collectives on a meta mesh, random
    ops draw nothing there)."""
    ran, failed = _meta_sweep(3)
    assert ran >= 300, ran
    assert not failed, failed


if __name__ == "__main__":  # the meta-mesh sweep's table: python -m tests.dtensor.test_crashes
    n, gaps = _meta_sweep(3)
    print(f"meta mesh (4,), rank 3: {n} layouts; cases with a failing layout: {len(gaps)}")
    for name, first in sorted(gaps.items()):
        print(f"  {name:28s} {first[:120]}")
