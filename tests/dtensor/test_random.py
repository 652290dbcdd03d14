"""Single-device-equivalent random numbers: any subset of a random op's elements, produced
piece by piece, equals the same elements of the op on the whole tensor, bit for bit, and the
generator ends where the whole-tensor op leaves it; DTensor ``nn.init.*`` and dropout on CPU
meshes (1-D, 2-D, uneven) equal single-device torch under the same seed."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import vescale
from tests.dtensor.reference import coord_of, expected_local, local_dtensor, mesh_of
from tests.harness.collectives import count_collectives
from vescale import InterleavedShard, Replicate, Shard
from vescale.dtensor import random as vrandom

aten = torch.ops.aten
# torch.manual_seed also queues a CUDA seed with a formatted stack trace (milliseconds a call
# in a loop); the CPU generator alone is what these CPU tests draw from.
SEED = torch.default_generator.manual_seed
OPS = [
    (aten.uniform_.default, (-0.3, 0.7)),
    (aten.normal_.default, (0.5, 2.0)),
    (aten.bernoulli_.float, (0.3,)),
]
SHAPES = [(5,), (16,), (40,), (17, 3), (5, 7, 3), (64, 32), (3, 100)]


def _subsets(shape: tuple[int, ...], seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Index sets per dim: everything, a leading range, a strided set, a random set, nothing."""
    g = torch.Generator().manual_seed(seed)
    out = [tuple(torch.arange(s) for s in shape)]
    out.append(tuple(torch.arange(s)[s // 3 : s // 3 + max(1, s // 2)] for s in shape))
    out.append(tuple(torch.arange(s)[1::3] for s in shape))
    out.append(tuple(torch.randperm(s, generator=g)[: max(1, s // 2)].sort().values for s in shape))
    out.append(tuple(torch.arange(0) if d == 0 else torch.arange(s) for d, s in enumerate(shape)))
    return out


@pytest.mark.parametrize("piece", [7, 64, vrandom.PIECE_ELEMENTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_any_subset_equals_the_whole_tensor_op(monkeypatch, piece, dtype):
    monkeypatch.setattr(vrandom, "PIECE_ELEMENTS", piece)
    g = torch.Generator()
    for shape, (op, args) in itertools.product(SHAPES, OPS):
        g.manual_seed(5)
        full = op(torch.empty(shape, dtype=dtype), *args, generator=g)
        after = g.get_state()
        for indices in _subsets(shape, len(shape)):
            g.manual_seed(5)
            rop = vrandom.RandomOp(op, args, g)
            local = vrandom.run_random(rop, shape, dtype, torch.device("cpu"), indices)
            case = (shape, op, [ix.tolist() for ix in indices])
            assert torch.equal(local, vrandom.take_local(full, indices)), case
            assert torch.equal(g.get_state(), after), case
        g.manual_seed(5)
        assert vrandom.run_random(rop, shape, dtype, torch.device("cpu"), None) is None
        assert torch.equal(g.get_state(), after), (shape, op)  # advancing alone


def test_non_contiguous_global_layout_is_exact():
    """A transposed global layout consumes the stream in storage order (the full fallback)."""
    g = torch.Generator().manual_seed(3)
    full = torch.empty(40, 24).t().normal_(generator=g)
    after = g.get_state()
    indices = (torch.arange(5, 12), torch.arange(0, 40, 2))
    g.manual_seed(3)
    rop = vrandom.RandomOp(aten.normal_.default, (0.0, 1.0), g)
    local = vrandom.run_random(
        rop, (24, 40), torch.float32, torch.device("cpu"), indices, stride=full.stride()
    )
    assert torch.equal(local, vrandom.take_local(full, indices))
    assert torch.equal(g.get_state(), after)


def test_normal_tail_and_partial_block_layout():
    """The documented layout of CPU normal_: blocks of 16, the last 16 from 16 extra words."""
    for n in (16, 17, 31, 40, 1000):
        torch.manual_seed(0)
        full = torch.empty(n).normal_()
        torch.manual_seed(0)
        head = torch.empty(n // 16 * 16).normal_()
        torch.empty(n % 16).uniform_()  # the partial block's words
        tail = torch.empty(16).normal_() if n % 16 else torch.empty(0)
        expected = torch.cat([head, torch.empty(n % 16)])
        if n % 16:
            expected[n - 16 :] = tail
        assert torch.equal(full, expected), n


# ---- DTensor random ops on gloo ranks ----------------------------------------------------

LAYOUTS = [((4,), [p]) for p in (Replicate(), Shard(0), Shard(1))] + [
    ((2, 2), list(pl)) for pl in itertools.product([Replicate(), Shard(0), Shard(1)], repeat=2)
]


def _inits():
    return {
        "normal_": lambda t: torch.nn.init.normal_(t, 0.1, 2.0),
        "uniform_": lambda t: torch.nn.init.uniform_(t, -1.0, 3.0),
        "kaiming_uniform_": lambda t: torch.nn.init.kaiming_uniform_(t, a=5**0.5),
        "xavier_normal_": torch.nn.init.xavier_normal_,
        "trunc_normal_": lambda t: torch.nn.init.trunc_normal_(t, std=0.02),
        "dropout": lambda t: F.dropout(t, 0.3, training=True),
        "bernoulli_": lambda t: t.bernoulli_(0.25),
    }


def _check_inits(shape):
    x = torch.arange(float(torch.Size(shape).numel())).view(shape) + 1.0
    for mesh_shape, placements in LAYOUTS:
        with count_collectives() as counts:  # none for any init on this layout
            for name, init in _inits().items():
                SEED(7)
                expected = init(x.clone())
                after = torch.rand(3)
                d = local_dtensor(x, mesh_shape, placements)
                SEED(7)
                out = init(d)
                case = (mesh_shape, placements, name)
                assert isinstance(out, vescale.DTensor), case
                assert tuple(out.placements) == tuple(placements), case
                local = expected_local(expected, mesh_shape, coord_of(mesh_shape), placements)
                assert torch.equal(out.to_local(), local), case
                assert torch.equal(torch.rand(3), after), case  # as on one device
        assert sum(counts.values()) == 0, (mesh_shape, placements, counts)


@pytest.mark.parametrize("shape", [(8, 12), (5, 7), (3, 40)])  # even; uneven; empty shards
def test_dtensor_random_ops_equal_single_device(pool4, shape):
    pool4.run(_check_inits, shape)


def _check_interleaved_inits():
    layouts = [
        ((4,), [InterleavedShard(0, 3)]),
        ((2, 2), [InterleavedShard(0, 3), Shard(1)]),
        ((2, 2), [Replicate(), InterleavedShard(1, 2)]),
    ]
    x = torch.zeros(24, 8)  # a merged QKV weight: 3 groups of 8 rows
    for (mesh_shape, placements), (name, init) in itertools.product(layouts, _inits().items()):
        mesh = mesh_of(mesh_shape)
        SEED(4)
        expected = init(x.clone() + 1)
        d = vescale.distribute_tensor(x + 1, mesh, placements)
        SEED(4)
        out = init(d)
        want = vescale.distribute_tensor(expected, mesh, placements).to_local()
        assert torch.equal(out.to_local(), want), (mesh_shape, placements, name)


def test_dtensor_random_ops_on_interleaved_shards(pool4):
    pool4.run(_check_interleaved_inits)


# Inductor's first import in this process imports torch.utils.mkldnn, whose ScriptModules
# use torch.jit.script_method: torch's own deprecation warnings, not raised by vescale code.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("backend", ["aot_eager", "vescale", "inductor"])
def test_dropout_compiles_and_equals_eager(backend):
    """F.dropout on a vescale DTensor under torch.compile (each backend; the kernel probes and
    scratch buffers must not mix real or earlier fake tensors into the trace): on CPU the
    compiled mask equals single-device eager under the same seed."""
    from tests.harness import fake_world

    torch._dynamo.reset()
    with fake_world(1):
        mesh = vescale.init_device_mesh("cpu", (1,))
        x = vescale.distribute_tensor(torch.ones(8, 8), mesh, [Shard(0)])
        fn = lambda t: F.dropout(t, 0.5, training=True)  # noqa: E731
        SEED(0)
        want = fn(torch.ones(8, 8))
        compiled = torch.compile(fn, backend=backend)
        for _ in range(2):  # a second trace (fresh fake mode) too
            torch._dynamo.reset()
            SEED(0)
            got = compiled(x)
            assert isinstance(got, vescale.DTensor)
            assert torch.equal(got.full_tensor(), want), backend
