"""Issue 18's reproducers (found by running PyTorch's and veScale legacy's DTensor tests), each
against one device: random ops on every placement, the interleaved-view reshape, explicit
mode on interleaved -> Shard, ranks outside a sub-mesh, distributing a non-leaf tensor and
deferred init under a device context."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import vescale
from tests.dtensor.reference import equals_full, local_dtensor, mesh_of
from tests.harness.collectives import count_collectives
from vescale import DeviceMesh, Partial, Replicate, Shard
from vescale._torch_compat import StridedShard
from vescale.dtensor import explicit_redistribute
from vescale.dtensor.explicit import ImplicitRedistributionError, redistribute_for
from vescale.dtensor.redistribute import _strided_communicates
from vescale.initialize import deferred_init, is_deferred, materialize_module

aten = torch.ops.aten
# torch.manual_seed also queues a CUDA seed with a formatted stack trace (milliseconds a call
# in a loop); the CPU generator alone is what these CPU tests draw from.
SEED = torch.default_generator.manual_seed


# ---- item 2: every random op equals single device on every placement -----------------------


def _random_ops():
    """name -> op on a tensor whose values are probabilities in [0, 1)."""
    return {
        "rand_like": torch.rand_like,
        "randn_like": torch.randn_like,
        "randn_like_f64": lambda t: torch.randn_like(t, dtype=torch.float64),
        "randint_like": lambda t: torch.randint_like(t, 7),
        "randint_like_low": lambda t: torch.randint_like(t, -3, 9, dtype=torch.int64),
        "bernoulli": torch.bernoulli,
        "bernoulli_p": lambda t: torch.bernoulli(t, 0.3),
        "normal_": lambda t: torch.nn.init.normal_(t, 1.5, 0.8),
        "uniform_": lambda t: torch.nn.init.uniform_(t, 0, 1.2),
        "kaiming_uniform_": torch.nn.init.kaiming_uniform_,
        "bernoulli_": lambda t: t.bernoulli_(0.25),
        "bernoulli__tensor": lambda t: t.bernoulli_(t * 0.5),
        "exponential_": lambda t: t.exponential_(2.0),
        "cauchy_": lambda t: t.cauchy_(),
        "log_normal_": lambda t: t.log_normal_(),
        "geometric_": lambda t: t.geometric_(0.3),
        "random_": lambda t: t.random_(0, 10),
        "native_dropout": lambda t: aten.native_dropout(t, 0.4, True),
        "dropout": lambda t: F.dropout(t, 0.3, training=True),
    }


def _outs(out):
    return list(out) if isinstance(out, tuple) else [out]


def _check_random_ops(mesh_shape, shape):
    choices = [Replicate(), Partial(), *(Shard(d) for d in range(len(shape)))]
    bad, checked = [], 0
    for pl in itertools.product(choices, repeat=len(mesh_shape)):
        if len({p.dim for p in pl if p.is_shard()}) < sum(p.is_shard() for p in pl):
            continue
        for name, op in _random_ops().items():
            SEED(1)
            x = torch.rand(shape)
            SEED(0)
            ref = _outs(op(x.clone()))
            after = torch.rand(3)
            dx = local_dtensor(x, mesh_shape, pl)
            SEED(0)
            with explicit_redistribute(False):  # bernoulli(p) of a Partial p replicates it
                out = _outs(op(dx))
            checked += 1
            same = [equals_full(o, r) for o, r in zip(out, ref)]
            if not all(same) or not torch.equal(torch.rand(3), after):
                bad.append((pl, name))
    assert not bad, f"{len(bad)}/{checked} wrong on {mesh_shape} {shape}: {bad[:6]}"
    return checked


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_random_ops_equal_single_device_on_every_placement(pool4, mesh_shape):
    for shape in [(8, 4), (5, 6, 7)]:
        pool4.run(_check_random_ops, mesh_shape, shape)


def _check_random_off_submesh():
    """Ranks outside a sub-mesh advance the generator exactly as ranks on it."""
    mesh = DeviceMesh("cpu", [0, 2])
    x = torch.rand(6, 5)
    for name, op in _random_ops().items():
        SEED(0)
        ref = _outs(op(x.clone()))
        after = torch.rand(3)
        dx = vescale.distribute_tensor(x, mesh, [Shard(0)])
        SEED(0)
        out = _outs(op(dx))
        assert torch.equal(torch.rand(3), after), name
        if mesh.get_coordinate() is None:
            assert all(o.to_local().numel() == 0 for o in out), name
        else:
            assert all(torch.equal(o.full_tensor(), r) for o, r in zip(out, ref)), name


def test_random_ops_off_submesh(pool4):
    pool4.run(_check_random_off_submesh)


# ---- item 3: a reshape of an interleaved shard redistributes and is right ------------------


def _check_interleaved_reshape():
    mesh = mesh_of((4,))
    t = torch.arange(4 * 24 * 30, dtype=torch.float64).reshape(4, 24, 30)
    dt = vescale.distribute_tensor(t, mesh, [Shard(1)]).reshape(-1, 30)  # no communication
    assert dt.placements == (vescale.InterleavedShard(0, 4),)
    assert torch.equal(dt.full_tensor(), t.reshape(-1, 30))
    with explicit_redistribute(False):
        out = dt.reshape(8, -1, 30)
    assert torch.equal(out.full_tensor(), t.reshape(8, -1, 30))


def test_interleaved_reshape_redistributes(pool4):
    pool4.run(_check_interleaved_reshape)


# ---- explicit mode sees interleaved -> Shard redistributions ---------------------------------


def _check_strided_explicit():
    """Upstream prices ``_StridedShard -> Shard`` at 0 communication; it all-gathers."""
    mesh = mesh_of((4,))
    t = torch.arange(4 * 24 * 30, dtype=torch.float64).reshape(4, 24, 30)
    dt = vescale.distribute_tensor(t, mesh, [Shard(1)]).reshape(-1, 30)  # InterleavedShard(0, 4)
    b = vescale.distribute_tensor(torch.ones(96, 30, dtype=torch.float64), mesh, [Shard(0)])
    with explicit_redistribute(True), pytest.raises(ImplicitRedistributionError) as err:
        dt + b
    for part in ("aten.add.Tensor", "_StridedShard(dim=0, sf=4)", "Shard(dim=0)", "DeviceMesh"):
        assert part in str(err.value), str(err.value)
    with explicit_redistribute(False), count_collectives() as counts:
        out = dt + b
    assert sum(counts.values()) > 0
    assert torch.equal(out.full_tensor(), t.reshape(-1, 30) + 1)
    r = vescale.distribute_tensor(t.reshape(-1, 30), mesh, [Replicate()])
    with explicit_redistribute(True), count_collectives() as counts:  # a local slice: allowed
        sliced = redistribute_for(aten.add.Tensor, r, dt.placements)
    assert sum(counts.values()) == 0
    assert torch.equal(sliced.to_local(), dt.to_local())


def test_explicit_mode_sees_interleaved_to_shard(pool4):
    pool4.run(_check_strided_explicit)


@pytest.mark.parametrize(
    "src,dst,mesh_shape,communicates",
    [
        ((StridedShard(0, split_factor=2),), (Shard(0),), (4,), True),
        ((Shard(0),), (StridedShard(0, split_factor=2),), (4,), True),
        ((Replicate(),), (StridedShard(0, split_factor=2),), (4,), False),
        ((StridedShard(0, split_factor=2),), (Shard(0),), (1,), False),
        ((Shard(0),), (Shard(1),), (4,), False),  # no strided shard: upstream's cost decides
        # one mesh dim at a time: mesh dim 1 goes to Replicate before mesh dim 0 changes
        ((Replicate(), StridedShard(0, split_factor=2)), (Shard(1), StridedShard(0, split_factor=2)), (2, 2), True),
        ((Shard(1), Replicate()), (Shard(1), StridedShard(0, split_factor=2)), (2, 2), False),
    ],
)  # fmt: skip
def test_strided_communicates(src, dst, mesh_shape, communicates):
    assert _strided_communicates(src, dst, mesh_shape) is communicates


# ---- item 4: ranks outside a sub-mesh ------------------------------------------------------


def _check_submesh_outside():
    mesh = DeviceMesh("cpu", [0, 2])  # ranks 1 and 3 are outside
    inside = mesh.get_coordinate() is not None
    dt = vescale.from_local(torch.ones(3, 4), mesh, [Shard(0)])
    assert tuple(dt.shape) == (6, 4)
    assert tuple(dt.to_local().shape) == ((3, 4) if inside else (0,))
    a = vescale.from_local(torch.ones(4, 3), mesh, [Shard(0)])
    b = vescale.from_local(torch.ones(4, 3), mesh, [Shard(0)])
    c = vescale.from_local(torch.ones(8, 3), mesh, [Replicate()])
    assert a.equal(b) and torch.equal(a, b)
    if inside:  # different layouts: compared after laying b out as a (explicit mode off)
        with explicit_redistribute(False):
            assert torch.equal(a, c)
        assert torch.equal(a.full_tensor(), torch.ones(8, 3))
    else:
        assert torch.equal(a, c)  # no communication outside the mesh


def test_submesh_ranks_outside_hold_empty_and_do_not_communicate(pool4):
    pool4.run(_check_submesh_outside)


# ---- item 5: only leaf tensors are distributed ---------------------------------------------


def _check_non_leaf():
    mesh = mesh_of((2,))
    t = torch.randn(4, 4, requires_grad=True) + 2
    with pytest.raises(RuntimeError, match="only leaf tensors can be distributed"):
        vescale.distribute_tensor(t, mesh, [Shard(0)])
    d = vescale.distribute_tensor(t.detach(), mesh, [Shard(0)])
    assert torch.equal(d.full_tensor(), t.detach())


def test_distribute_non_leaf_raises(pool2):
    pool2.run(_check_non_leaf)


# ---- item 6: deferred init under a device context ------------------------------------------


def test_deferred_init_under_meta_device_context():
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 6)
    after = torch.rand(3)
    torch.manual_seed(0)
    with torch.device("meta"):
        t = deferred_init(torch.empty, (4, 16, 16))
        m = deferred_init(torch.nn.Linear, 4, 6)
        r = deferred_init(torch.arange, 5.0)
    assert is_deferred(t) and is_deferred(m) and is_deferred(r)
    assert t.device.type == "meta" and tuple(t.shape) == (4, 16, 16)
    assert torch.equal(torch.rand(3), after)  # the generator advanced as in eager init
    materialize_module(m)
    assert m.weight.device.type == "cpu"
    assert torch.equal(m.weight, ref.weight) and torch.equal(m.bias, ref.bias)
    from vescale.dtensor.deferred_init import _materialize_tensor

    assert torch.equal(_materialize_tensor(r), torch.arange(5.0))


# ---- legacy error wording: veScale legacy's tests match these phrases ------------------------


def _check_legacy_error_wording():
    mesh = mesh_of((2,))
    t = torch.randn(4, 4, requires_grad=True) + 2
    with pytest.raises(RuntimeError, match="distribute leaf tensor"):
        vescale.distribute_tensor(t, mesh, [Shard(0)])
    local = torch.randn(4, 4)
    with pytest.raises(ValueError, match="Please pass both shape and stride at the same time!"):
        vescale.from_local(local, mesh, [Replicate()], shape=local.size())
    with pytest.raises(ValueError, match="Please pass both shape and stride at the same time!"):
        vescale.from_local(local, mesh, [Replicate()], stride=local.stride())


def test_legacy_error_wording(pool2):
    pool2.run(_check_legacy_error_wording)


def _check_distribute_dtensor_elsewhere():
    mesh = mesh_of((2, 2))
    d = vescale.distribute_tensor(torch.randn(8, 8), mesh, [Shard(0), Shard(1)])
    with pytest.raises(ValueError, match="to a different device mesh"):
        vescale.distribute_tensor(d, mesh_of((4,)), [Shard(0)])
    with pytest.raises(ValueError, match="to a different placements"):
        vescale.distribute_tensor(d, mesh, [Shard(0), Replicate()])
    with pytest.raises(TypeError, match="input is already a DTensor"):
        vescale.distribute_tensor(d, mesh, [Shard(0), Shard(1)])


def test_distribute_dtensor_to_another_mesh_or_placements(pool4):
    pool4.run(_check_distribute_dtensor_elsewhere)
