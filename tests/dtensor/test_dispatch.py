"""Dispatch extension points, built-in hooks and explicit-redistribution mode on gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

import vescale
from tests.dtensor.reference import coord_of, expected_local, mesh_of
from tests.harness import local_world
from tests.harness.collectives import count_collectives
from vescale import DTensor, Partial, Replicate, Shard
from vescale.dtensor import dispatch, hooks
from vescale.dtensor.explicit import explicit_redistribute
from vescale.dtensor.op_args import bind, unbind
from vescale.dtensor.ops import indexing

aten = torch.ops.aten


def _dt(full, placements, mesh_shape=(4,)):
    return vescale.distribute_tensor(full, mesh_of(mesh_shape), placements)


def _check_hooks():
    full_a, full_b = torch.randn(8, 4), torch.randn(8, 4)
    a, b = _dt(full_a, [Shard(0)]), _dt(full_b, [Shard(0)])
    calls = []

    @dispatch.bypass_dispatch(aten.relu.default)
    def fake_relu(op, args, kwargs):
        calls.append(op)
        x = args[0]
        return DTensor.from_local(x.to_local().abs(), x.device_mesh, x.placements, run_check=False)

    try:
        assert torch.equal(torch.relu(a).full_tensor(), full_a.abs())
        assert calls == [aten.relu.default]
        assert torch.equal(
            torch.sigmoid(a).full_tensor(), torch.sigmoid(full_a)
        )  # other op untouched
    finally:
        dispatch.unregister_bypass_dispatch(aten.relu.default)
    assert torch.equal(torch.relu(a).full_tensor(), torch.relu(full_a)) and len(calls) == 1

    @dispatch.pre_dispatch_patch(aten.add.Tensor)
    def double_rhs(op, args, kwargs):
        return (args[0], args[1] * 2), kwargs

    @dispatch.post_dispatch_patch(aten.add.Tensor)
    def times_three(op, out):
        return out * 3

    try:  # pre + post compose on one op
        assert torch.allclose((a + b).full_tensor(), (full_a + 2 * full_b) * 3)
        assert torch.allclose((a - b).full_tensor(), full_a - full_b)
    finally:
        dispatch.unregister_pre_dispatch_patch(aten.add.Tensor)
    assert torch.allclose((a + b).full_tensor(), (full_a + full_b) * 3)  # post only
    dispatch.unregister_post_dispatch_patch(aten.add.Tensor)
    assert torch.allclose((a + b).full_tensor(), full_a + full_b)

    r = _dt(full_a, [Replicate()])

    @dispatch._bypass_for_sharding_prop(aten.neg.default)  # legacy name
    def neg_is_partial(schema):
        return (Partial(),)

    try:
        with CommDebugMode() as comm:
            out = torch.neg(r)
        assert comm.get_total_counts() == 0
        assert tuple(out.placements) == (Partial(),) and out.shape == (8, 4)
        assert torch.equal(out.to_local(), -full_a)  # the local op ran on the inputs as given
    finally:
        dispatch.unregister_bypass_sharding_prop(aten.neg.default)
    assert tuple(torch.neg(r).placements) == (Replicate(),)
    assert dispatch._pre_patch_for_dispatch is dispatch.pre_dispatch_patch
    assert dispatch._post_patch_for_dispatch is dispatch.post_dispatch_patch
    assert dispatch._bypass_for_dispatch is dispatch.bypass_dispatch
    with pytest.raises(TypeError, match="expected an OpOverload"):
        dispatch.bypass_dispatch(aten.relu)(fake_relu)


def _check_builtins():
    rank = dist.get_rank()
    full = torch.arange(16.0).reshape(8, 2)
    s, r = _dt(full, [Shard(0)]), _dt(full, [Replicate()])
    with CommDebugMode() as comm:
        assert torch.ops.aten.is_same_size(s, r)
        assert torch.equal(r, r.clone())
    assert comm.get_total_counts() == 0
    assert torch.equal(s, s.clone())
    other = full.clone()
    other[7, 1] = -1  # differs only in the last rank's shard
    assert not torch.equal(s, _dt(other, [Shard(0)]))
    assert not torch.equal(s, _dt(torch.zeros(4, 2), [Shard(0)]))  # shape, from metadata
    tp = mesh_of((2, 2)).get_submesh([1])  # equal on a sub-mesh talks to it only
    local = torch.tensor([float(rank % 2)]) if rank < 2 else torch.tensor([9.0 + rank % 2])
    x = vescale.from_local(local, tp, [Shard(0)])
    assert torch.equal(x, vescale.from_local(local.clone(), tp, [Shard(0)]))
    p = _dt(full, [Partial()])
    assert tuple(p.to(torch.float64).placements) == (Partial(),)
    assert p.to(torch.float64).dtype == torch.float64
    assert r.sum().item() == full.sum().item()  # .item() reads the local value
    vals = torch.tensor([3.0, 0.0, 3.0, 1.0, 0.0, 2.0])
    rv = _dt(vals, [Replicate()])
    assert torch.equal(torch.nonzero(rv).to_local(), torch.nonzero(vals))
    u, inv, cnt = torch.unique(rv, return_inverse=True, return_counts=True)
    eu, einv, ecnt = torch.unique(vals, return_inverse=True, return_counts=True)
    assert torch.equal(u.to_local(), eu) and torch.equal(inv.to_local(), einv)
    assert torch.equal(cnt.to_local(), ecnt) and u.shape == eu.shape
    with pytest.raises(
        RuntimeError,
        match=r"aten.nonzero.default: supported on Replicate inputs only, got \(Shard\(dim=0\),\)",
    ):
        torch.nonzero(_dt(vals, [Shard(0)]))


def _check_explicit_mode(mode):
    coord = coord_of((4,))
    fa, fb = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    a, b = _dt(fa, [Shard(0)]), _dt(fb, [Shard(0)])
    c = _dt(fb, [Shard(1)])
    if mode == "env-on":
        with pytest.raises(RuntimeError) as err:
            a @ b
        msg = str(err.value)
        assert "aten.mm.default" in msg and "from (Shard(dim=0),) to (Replicate(),)" in msg
        assert (
            "DeviceMesh((4,)" in msg
            and "(the default: VESCALE_DISABLE_REDISTRIBUTE is unset)" in msg
        )
        with pytest.raises(
            RuntimeError,
            match=r"aten.add.Tensor: implicit redistribution of an input from \(Shard\(dim=1\),\) to \(Shard\(dim=0\),\)",
        ):
            a + c
        out = a @ b.redistribute(placements=[Replicate()])  # the same program, explicit
        assert torch.allclose(out.full_tensor(), fa @ fb)
        total = a + c.redistribute(placements=[Shard(0)])
        assert torch.allclose(total.full_tensor(), fa + fb)
        r = _dt(fb, [Replicate()])
        assert torch.allclose((a + r).full_tensor(), fa + fb)  # Replicate -> Shard is local
        with vescale.dtensor.explicit_redistribute(False):
            assert torch.allclose((a @ b).full_tensor(), fa @ fb)
    else:  # env off; the context manager turns it back on
        assert torch.allclose((a @ b).full_tensor(), fa @ fb)
        assert torch.allclose((a + c).full_tensor(), fa + fb)
        assert torch.allclose(
            (a + c).to_local(), expected_local(fa + fb, (4,), coord, (a + c).placements)
        )
        with (
            vescale.dtensor.explicit_redistribute(True),
            pytest.raises(RuntimeError, match=r"aten\.mm\.default"),
        ):
            a @ b


def test_hooks_change_only_their_op_and_unregister(pool4):
    pool4.run(_check_hooks)


def test_builtin_hooks(pool4):
    pool4.run(_check_builtins)


def test_explicit_mode_default_and_context(pool4):
    pool4.run(_check_explicit_mode, "env-on")
    pool4.run(_check_explicit_mode, "env-off", env={"VESCALE_DISABLE_REDISTRIBUTE": "0"})


def test_bind_names_arguments_by_schema_and_back():
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    top = bind(aten.topk.default, (x, 2), {"largest": False})
    assert list(top) == ["self", "k", "dim", "largest", "sorted"]
    assert top["self"] is x and (top["k"], top["dim"], top["largest"], top["sorted"]) == (
        2,
        -1,
        False,
        True,
    )
    add = bind(aten.add.Tensor, (x, y), {"alpha": 2})
    args, kwargs = unbind(aten.add.Tensor, add)
    assert args == (x, y) and kwargs == {"alpha": 2}  # keyword-only stays a keyword
    assert torch.equal(aten.add.Tensor(*args, **kwargs), torch.add(x, y, alpha=2))
    with pytest.raises(TypeError, match=r"aten.topk.default: missing required arguments \['k'\]"):
        bind(aten.topk.default, (x,), {})
    with pytest.raises(TypeError, match=r"aten.add.Tensor: no arguments named \['beta'\]"):
        bind(aten.add.Tensor, (x, y), {"beta": 1})
    with pytest.raises(TypeError, match=r"aten.add.Tensor: 3 positional arguments"):
        bind(aten.add.Tensor, (x, y, 2), {})


def _is_shard(op, args, kwargs):
    return bind(op, args, kwargs)["self"].placements[0].is_shard()


def test_when_predicate_applies_each_hook_only_where_it_holds():
    full = torch.randn(8, 4, dtype=torch.float64)
    calls = []

    def neg_as_abs(op, args, kwargs):
        calls.append(op)
        return hooks.python_dispatch(aten.abs.default, args, kwargs)

    with local_world(2):
        mesh = vescale.init_device_mesh("cpu", (2,))
        s = vescale.distribute_tensor(full, mesh, [Shard(0)])
        r = vescale.distribute_tensor(full, mesh, [Replicate()])
        hooks.bypass_dispatch(aten.neg.default, when=_is_shard)(neg_as_abs)
        try:
            assert torch.equal(torch.neg(s).full_tensor(), full.abs())
            assert torch.equal(torch.neg(r).full_tensor(), -full)  # dispatch as without it
            assert calls == [aten.neg.default]
        finally:
            hooks.unregister_bypass_dispatch(aten.neg.default)
        hooks.pre_dispatch_patch(aten.add.Tensor, when=_is_shard)(
            lambda op, args, kwargs: ((args[0], args[1] * 2), kwargs)
        )
        hooks.post_dispatch_patch(
            aten.add.Tensor, when=lambda op, out: out.placements[0].is_replicate()
        )(lambda op, out: out * 3)
        try:
            assert torch.allclose((s + s).full_tensor(), full * 3)  # pre only
            assert torch.allclose((r + r).full_tensor(), full * 6)  # post only
        finally:
            hooks.unregister_pre_dispatch_patch(aten.add.Tensor)
            hooks.unregister_post_dispatch_patch(aten.add.Tensor)
        hooks.bypass_sharding_prop(
            aten.neg.default, when=lambda schema: schema.args_schema[0].placements[0].is_replicate()
        )(lambda schema: (Partial(),))
        try:
            assert tuple(torch.neg(r).placements) == (Partial(),)
            assert tuple(torch.neg(s).placements) == (Shard(0),)  # upstream's strategy search
            assert torch.equal(torch.neg(s).full_tensor(), -full)
        finally:
            hooks.unregister_bypass_sharding_prop(aten.neg.default)
        assert torch.equal(torch.neg(s).full_tensor(), -full)


@pytest.mark.parametrize(
    ("self_placement", "moves", "counts"),
    [
        (Shard(0), False, {}),  # in place, index and src already laid out alike
        (Replicate(), False, {"all_gather": 2}),  # in place: index and src replicated
        (Shard(1), True, None),  # the scatter dim is sharded: no strategy keeps it
    ],
)
def test_in_place_fallback_is_where_the_in_place_strategy_refuses(self_placement, moves, counts):
    """``scatter_`` along dim 1: the propagator sends it out of place exactly where upstream's
    in-place dispatch refuses (the independent reference); both paths give the single-device
    result and keep ``self``'s placements."""
    x = torch.randn(8, 6, dtype=torch.float64)
    index = torch.randint(0, 6, (8, 3))
    src = torch.randn(8, 3, dtype=torch.float64)
    expected = x.clone().scatter_(1, index, src)
    op = aten.scatter_.src
    with local_world(2), explicit_redistribute(False):
        mesh = vescale.init_device_mesh("cpu", (2,))

        def operands():
            return (
                vescale.distribute_tensor(x, mesh, [self_placement]),
                1,
                vescale.distribute_tensor(index, mesh, [Shard(0)]),
                vescale.distribute_tensor(src, mesh, [Shard(0)]),
            )

        assert indexing.moves_self(op, operands(), {}) is moves
        try:
            hooks.python_dispatch(op, operands(), {})
            refused = False
        except RuntimeError:
            refused = True
        assert refused is moves
        args = operands()
        with count_collectives() as counted:
            out = args[0].scatter_(*args[1:])
        assert out is args[0] and tuple(out.placements) == (self_placement,)
        assert torch.equal(out.full_tensor(), expected)
    if counts is not None:
        assert dict(counted) == counts


def test_in_place_fallback_where_upstream_lays_the_result_out_elsewhere():
    """``scatter_add_`` of column-sharded index and src into a replicated ``self``: upstream
    propagates it through its decomposition to ``Shard(1)`` while the kernel writes ``self``'s
    whole local tensor (its own DTensors then claim ``Shard(1)`` for a full (8, 12) tensor).
    vescale runs it out of place and keeps ``self`` replicated, equal to one device."""
    x = torch.randn(8, 12, dtype=torch.float64)
    index = torch.randint(0, 8, (8, 12))
    src = torch.randn(8, 12, dtype=torch.float64)
    expected = x.clone().scatter_add_(0, index, src)
    op = aten.scatter_add_.default
    with local_world(4), explicit_redistribute(False):
        mesh = vescale.init_device_mesh("cpu", (4,))
        args = (
            vescale.distribute_tensor(x, mesh, [Replicate()]),
            0,
            vescale.distribute_tensor(index, mesh, [Shard(1)]),
            vescale.distribute_tensor(src, mesh, [Shard(1)]),
        )
        assert indexing.moves_self(op, args, {})
        out = args[0].scatter_add_(*args[1:])
        assert out is args[0] and tuple(out.placements) == (Replicate(),)
        assert tuple(out._local_tensor.shape) == (8, 12)
        assert torch.equal(out.full_tensor(), expected)
