"""RaggedShard: conversions and redistribution to and from every placement against one-device
references (nested ``torch.chunk`` for the other placements, then the flat slice of the units,
computed here from the definition), uneven and zero units, on gloo ranks: 1-D meshes of 2 and
4 ranks and a 2x2 mesh, float64, forward and backward; exact collective counts for the main
transitions; the placement's own contract (equality, hash, pickling, validation)."""

from __future__ import annotations

import itertools
import math
import pickle
import random

import pytest
import torch
import torch.distributed as dist

import vescale
from tests.dtensor.reference import coord_of, expected_local, mesh_of, partial_source
from tests.harness.collectives import count_collectives
from vescale import Partial, RaggedShard, Replicate, Shard
from vescale.dtensor.ragged import check_ragged, inner_shape

SHAPE = (6, 5)  # rows split by units summing to 2, 3 or 6; Shard(1) uneven on 2 and 4 ranks
BASIC = [Shard(0), Shard(1), Replicate(), Partial("sum")]


def _slice(inner, p, c):
    """Rows ``[sum(u[:c]), sum(u[:c + 1])) * rows / sum(u)`` of ``inner``'s prefix dims
    ``p.dims``, flattened."""
    k, units = len(p.dims), p.local_units
    rows, block = math.prod(inner.shape[:k]), math.prod(inner.shape[k:])
    per = rows // sum(units)
    start, count = sum(units[:c]) * per * block, units[c] * per * block
    return inner.reshape(-1)[start : start + count]


def ragged_expected(full, mesh_shape, coord, placements):
    """Rank ``coord``'s local tensor: the other placements' chunks (``expected_local``), then
    the RaggedShard's slice of that."""
    other = [Replicate() if isinstance(p, RaggedShard) else p for p in placements]
    inner = expected_local(full, mesh_shape, coord, other)
    for m, p in enumerate(placements):
        if isinstance(p, RaggedShard):
            return _slice(inner, p, coord[m])
    return inner


def _ragged_choices(mesh_shape, rng=None):
    """RaggedShards that fit ``SHAPE`` (and its chunks) on every mesh dim of ``mesh_shape``:
    fixed ones with zero units, or random units (some zero) from ``rng``."""
    n = mesh_shape[0]
    if len(mesh_shape) == 2:  # rows of a Shard(0) chunk: 3; sums of 3 fit every inner shape
        fixed = [RaggedShard((0,), (1, 2)), RaggedShard((0, 1), (3, 0))]
        return fixed if rng is None else [RaggedShard((0,), _units(rng, 2, 3)), *fixed[1:]]
    if rng is None:
        return {
            2: [RaggedShard((0,), (2, 1)), RaggedShard((0, 1), (0, 5)), RaggedShard((0,), (0, 1))],
            4: [
                RaggedShard((0,), (1, 0, 3, 2)),
                RaggedShard((0, 1), (4, 0, 5, 6)),
                RaggedShard((0,), (0, 0, 1, 0)),
            ],
        }[n]
    return [
        RaggedShard((0,), _units(rng, n, 6)),
        RaggedShard((0, 1), _units(rng, n, 30)),
        RaggedShard((0,), _units(rng, n, 3)),
    ]


def _units(rng, n, total):
    """``n`` non-negative ints summing to ``total``, some zero."""
    cuts = sorted(rng.randint(0, total) for _ in range(n - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))


def _layouts(mesh_shape, ragged):
    choices = BASIC + ragged
    return [
        lay
        for lay in itertools.product(choices, repeat=len(mesh_shape))
        if sum(isinstance(p, RaggedShard) for p in lay) <= 1
    ]


def _pairs(mesh_shape, ragged, sample):
    """(src, dst) pairs with a RaggedShard on at least one side; ``sample`` of them (seeded)
    or all (``None``)."""
    lays = _layouts(mesh_shape, ragged)
    pairs = [
        (a, b)
        for a, b in itertools.product(lays, lays)
        if a != b and any(isinstance(p, RaggedShard) for p in (*a, *b))
    ]
    return pairs if sample is None else random.Random(0).sample(pairs, min(sample, len(pairs)))


def _source(src, mesh_shape):
    """(global tensor, this rank's local tensor laid out as ``src``), distinct Partial pieces."""
    plain = [Replicate() if isinstance(p, RaggedShard) else p for p in src]
    full, local = partial_source(plain, mesh_shape, SHAPE)
    coord = coord_of(mesh_shape)
    for m, p in enumerate(src):
        if isinstance(p, RaggedShard):
            local = _slice(local, p, coord[m])
    return full, local


def _check_pairs(mesh_shape, pairs):
    mesh = mesh_of(mesh_shape)
    coord = coord_of(mesh_shape)
    for src, dst in pairs:
        torch.manual_seed(len(repr((src, dst))))  # the same pieces on every rank
        full, local = _source(src, mesh_shape)
        leaf = local.clone().requires_grad_(True)
        x = vescale.from_local(leaf, mesh, src, run_check=False, shape=SHAPE, stride=(SHAPE[1], 1))
        y = x.redistribute(mesh, dst)
        assert tuple(y.placements) == tuple(dst) and y.shape == SHAPE, (src, dst)
        if not any(p.is_partial() for p in dst):
            want = ragged_expected(full, mesh_shape, coord, dst)
            got = y.to_local(async_output=False)
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-12), (src, dst)
        whole = y.full_tensor()
        assert torch.allclose(whole, full, atol=1e-12), (src, dst)
        weight = torch.randn(*SHAPE, dtype=torch.float64)
        (whole * weight).sum().backward()
        grad_layout = [Replicate() if p.is_partial() else p for p in src]
        want_grad = ragged_expected(weight, mesh_shape, coord, grad_layout)
        assert torch.allclose(leaf.grad, want_grad, atol=1e-12), (src, dst)
    return len(pairs)


MESHES = [(2, (2,)), (4, (4,)), (4, (2, 2))]
IDS = ["1d-2", "1d-4", "2d-2x2"]


@pytest.mark.parametrize("world,mesh_shape", MESHES, ids=IDS)
def test_redistribute_sample(world, mesh_shape, request):
    """A seeded sample of the pairs with a RaggedShard on either side (fixed units, zeros
    included); every pair runs with --full."""
    pool = request.getfixturevalue(f"pool{world}")
    pairs = _pairs(mesh_shape, _ragged_choices(mesh_shape), sample=24)
    assert pool.run(_check_pairs, mesh_shape, pairs)[0] == len(pairs)


@pytest.mark.full
@pytest.mark.parametrize("world,mesh_shape", MESHES, ids=IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_redistribute_every_pair_fuzzed(world, mesh_shape, seed, request):
    """Every pair with a RaggedShard on either side, units drawn at random (zeros included)."""
    pool = request.getfixturevalue(f"pool{world}")
    ragged = _ragged_choices(mesh_shape, random.Random(seed))
    pairs = _pairs(mesh_shape, ragged, sample=None)
    assert pool.run(_check_pairs, mesh_shape, pairs)[0] == len(pairs)


def _check_conversions(mesh_shape):
    mesh = mesh_of(mesh_shape)
    coord = coord_of(mesh_shape)
    base = torch.arange(30, dtype=torch.float64).reshape(SHAPE)
    rank = dist.get_rank()
    for lay in _layouts(mesh_shape, _ragged_choices(mesh_shape)):
        if not any(isinstance(p, RaggedShard) for p in lay):
            continue
        mine = base + 100 * rank  # data comes from coordinate 0 (rank 0)
        before = mine.clone()
        d = vescale.distribute_tensor(mine, mesh, lay)
        assert torch.equal(mine, before), lay
        assert d.shape == SHAPE and d.stride() == (5, 1) and tuple(d.placements) == lay
        want = ragged_expected(base, mesh_shape, coord, lay)
        assert torch.equal(d.to_local(), want), (lay, d.to_local(), want)
        assert torch.equal(d.full_tensor(), base), lay
        if not any(p.is_partial() for p in lay):
            back = vescale.from_local(want.clone(), mesh, lay, shape=SHAPE, stride=(5, 1))
            assert torch.equal(back.full_tensor(), base), lay


@pytest.mark.parametrize("world,mesh_shape", MESHES, ids=IDS)
def test_distribute_from_local_full_tensor(world, mesh_shape, request):
    request.getfixturevalue(f"pool{world}").run(_check_conversions, mesh_shape)


def _check_inferred_shape_and_grad():
    mesh = mesh_of((4,))
    rank = dist.get_rank()
    units = (1, 0, 3, 2)
    local = torch.arange(units[rank] * 2, dtype=torch.float64) + 10 * rank
    leaf = local.clone().requires_grad_(True)
    d = vescale.from_local(leaf, mesh, [RaggedShard((0,), units)])
    assert d.shape == (12,)
    full = torch.cat(
        [torch.arange(u * 2, dtype=torch.float64) + 10 * r for r, u in enumerate(units)]
    )
    assert torch.equal(d.full_tensor(), full)
    (d.full_tensor() * torch.arange(12.0, dtype=torch.float64)).sum().backward()
    start = sum(units[:rank]) * 2
    assert torch.equal(
        leaf.grad, torch.arange(12.0, dtype=torch.float64)[start : start + local.numel()]
    )
    # to_local's gradient comes back as the RaggedShard (1-D local, N-D global)
    x = vescale.distribute_tensor(
        torch.ones(6, 5, dtype=torch.float64), mesh, [RaggedShard((0,), units)]
    )
    x.requires_grad_(True)
    (x.to_local() * 2).sum().backward()
    assert tuple(x.grad.placements) == (RaggedShard((0,), units),) and x.grad.stride() == (5, 1)
    assert torch.equal(x.grad.full_tensor(), torch.full((6, 5), 2.0, dtype=torch.float64))
    p = torch.nn.Parameter(x.detach())
    assert isinstance(p, vescale.DTensor) and tuple(p.placements) == (RaggedShard((0,), units),)


def test_from_local_infers_1d_shape_and_gradients(pool4):
    pool4.run(_check_inferred_shape_and_grad)


def _counts(mesh_shape, src, dst):
    mesh = mesh_of(mesh_shape)
    x = vescale.distribute_tensor(torch.randn(*SHAPE, dtype=torch.float64), mesh, src)
    with count_collectives() as counts:
        y = x.redistribute(mesh, dst, async_op=False)
    assert torch.equal(y.full_tensor(), x.full_tensor())
    return dict(counts)


COUNTS = [
    ((4,), [RaggedShard((0,), (1, 0, 3, 2))], [Replicate()], {"all_gather": 1}),
    (
        (4,),
        [RaggedShard((0,), (1, 0, 3, 2))],
        [RaggedShard((0, 1), (4, 0, 5, 6))],
        {"all_to_all": 1},
    ),
    ((4,), [RaggedShard((0,), (1, 0, 3, 2))], [RaggedShard((0,), (0, 0, 1, 0))], {"all_to_all": 1}),
    ((4,), [RaggedShard((0,), (1, 0, 3, 2))], [Shard(0)], {"all_to_all": 1}),
    ((4,), [Shard(0)], [RaggedShard((0,), (1, 0, 3, 2))], {"all_to_all": 1}),
    ((4,), [RaggedShard((0,), (1, 0, 3, 2))], [Shard(1)], {"all_gather": 1}),
    ((4,), [RaggedShard((0,), (1, 0, 3, 2))], [Partial()], {"all_gather": 1}),
    ((4,), [Replicate()], [RaggedShard((0,), (1, 0, 3, 2))], {}),
    ((4,), [Partial()], [RaggedShard((0,), (1, 0, 3, 2))], {"reduce_scatter": 1}),
    ((2, 2), [Shard(1), Partial()], [Shard(1), RaggedShard((0, 1), (3, 0))], {"reduce_scatter": 1}),
    ((2, 2), [RaggedShard((0,), (1, 2)), Shard(1)], [Replicate(), Shard(1)], {"all_gather": 1}),
    (
        (2, 2),
        [Shard(1), RaggedShard((0,), (1, 2))],
        [Shard(1), RaggedShard((0,), (2, 1))],
        {"all_to_all": 1},
    ),
    ((2, 2), [Shard(0), RaggedShard((0,), (1, 2))], [Shard(0), Replicate()], {"all_gather": 1}),
]


def test_collective_counts(pool4):
    """One all-gather to Replicate (or to a layout it must gather for), one all-to-all
    between RaggedShards and to/from Shard(0), one reduce-scatter from Partial("sum"), none
    from Replicate."""
    for mesh_shape, src, dst, want in COUNTS:
        got = pool4.run(_counts, mesh_shape, src, dst)[0]
        assert got == want, (mesh_shape, src, dst, got)


def test_placement_contract():
    p = RaggedShard((0,), (1, 0, 3))
    assert p == RaggedShard(dims=[0], local_units=[1, 0, 3]) and hash(p) == hash(
        RaggedShard((0,), (1, 0, 3))
    )
    assert p != RaggedShard((0, 1), (1, 0, 3)) and p != RaggedShard((0,), (1, 3, 0))
    assert p != Shard(0) and Shard(0) != p and not p.is_shard() and not p.is_replicate()
    assert repr(p) == "RaggedShard(dims=(0,), local_units=(1, 0, 3))"
    assert pickle.loads(pickle.dumps(p)) == p
    with pytest.raises(AttributeError, match="frozen"):
        p.local_units = (1, 1, 1)
    assert p.local_ranges((8, 5)) == ((0, 10), (10, 0), (10, 30))
    assert RaggedShard((0, 1), (1, 2)).local_ranges((3, 2, 4)) == ((0, 8), (8, 16))


@pytest.mark.parametrize(
    "dims,units,kind,match",
    [
        ((1,), (1, 1), ValueError, r"dims must be a prefix"),
        ((0, 2), (1, 1), ValueError, r"dims must be a prefix"),
        ((), (1, 1), ValueError, r"dims must be a prefix"),
        ((0,), (), ValueError, r"local_units must be non-negative"),
        ((0,), (1, -1), ValueError, r"local_units must be non-negative"),
        ((0,), (0, 0), ValueError, r"positive sum"),
        ((0,), (1.5, 1), TypeError, r"tuple of ints"),
        (0, (1, 1), TypeError, r"dims must be a tuple of ints"),
    ],
)
def test_bad_arguments(dims, units, kind, match):
    with pytest.raises(kind, match=match):
        RaggedShard(dims, units)


def test_shape_checks_on_a_meta_mesh():
    """Units that do not divide the rows, the wrong number of units, two RaggedShards, dims
    beyond the tensor: a ValueError naming the shape, the units and the mesh."""
    mesh = vescale.DeviceMesh("meta", torch.arange(4).view(2, 2))
    ok = [RaggedShard((0,), (1, 2)), Shard(1)]
    check_ragged((6, 5), mesh, ok, what="t")
    assert inner_shape((6, 5), mesh, ok, (1, 1)) == (6, 2)
    bad = [
        (
            (5, 4),
            [RaggedShard((0,), (1, 2)), Replicate()],
            r"cannot split the 5 rows of shape \(5, 4\).*sum\(local_units\) = 3",
        ),
        (
            (6, 4),
            [Shard(0), RaggedShard((0,), (1, 3))],
            r"cannot split the 3 rows of shape \(3, 4\)",
        ),
        ((6, 4), [RaggedShard((0,), (1, 2, 3)), Replicate()], r"3 local_units for the 2 ranks"),
        (
            (6, 4),
            [RaggedShard((0,), (1, 2)), RaggedShard((0,), (1, 2))],
            r"at most one RaggedShard",
        ),
        ((6,), [RaggedShard((0, 1), (1, 2)), Replicate()], r"dims exceed the 1-D tensor"),
        (
            (6, 4),
            [RaggedShard((0,), (1, 2)), vescale.InterleavedShard(1, 2)],
            r"does not compose with an interleaved shard",
        ),
    ]
    for shape, placements, match in bad:
        with pytest.raises(ValueError, match=match) as info:
            check_ragged(shape, mesh, placements, what="distribute_tensor")
        assert "mesh" in str(info.value) and "distribute_tensor" in str(info.value)


def _redistribute_for_compile(x, mesh):
    y = x.redistribute(mesh, [Replicate()])
    z = x.redistribute(mesh, [RaggedShard((0,), (2, 1))])
    return y.to_local(), z.to_local()


def _check_compiled():
    mesh = mesh_of((2,))
    full = torch.arange(12.0, dtype=torch.float64).reshape(6, 2)
    x = vescale.distribute_tensor(full, mesh, [RaggedShard((0,), (1, 2))])
    torch._dynamo.reset()
    step = torch.compile(_redistribute_for_compile, backend="vescale", fullgraph=True)
    y, z = step(x, mesh)
    assert torch.equal(y, full)
    assert torch.equal(z, _slice(full, RaggedShard((0,), (2, 1)), dist.get_rank()))


@pytest.mark.full  # a minute of compiling on a loaded 2-core machine
def test_compiled_redistribution(pool2):
    """Under backend="vescale" (one graph): the all-gather and the uneven all-to-all, whose
    sizes differ by rank, pass the rank-consistency check and give the eager values."""
    pool2.run(_check_compiled)


def test_meta_mesh_redistribution_gives_local_shapes():
    """On a meta mesh (shape-only planning) nothing is communicated: the local shape of the
    target at coordinate (0, 0)."""
    from vescale.dtensor.placement_types import make_spec
    from vescale.dtensor.redistribute import redistribute_local_tensor

    mesh = vescale.DeviceMesh("meta", torch.arange(4).view(2, 2))

    def spec(placements):
        return make_spec(mesh, placements, SHAPE, (5, 1), torch.float64)

    ragged = spec([RaggedShard((0,), (1, 2)), Shard(1)])
    local = torch.empty(6, device="meta")  # 2 of 6 rows of the (6, 3) column chunk
    out = redistribute_local_tensor(local, ragged, spec([Replicate(), Shard(1)]))
    assert out.shape == (6, 3) and out.device.type == "meta"
    back = redistribute_local_tensor(out, spec([Replicate(), Shard(1)]), ragged)
    assert back.shape == (6,)


def _check_factories():
    mesh = mesh_of((2, 2))
    placements = [Shard(1), RaggedShard((0,), (1, 2))]
    coord = coord_of((2, 2))
    for make, ref in [
        (vescale.dtensor.zeros, torch.zeros),
        (vescale.dtensor.ones, torch.ones),
        (vescale.dtensor.rand, torch.rand),
        (vescale.dtensor.randn, torch.randn),
    ]:
        torch.manual_seed(5)
        want = ref(*SHAPE, dtype=torch.float64)
        torch.manual_seed(5)
        d = make(*SHAPE, dtype=torch.float64, device_mesh=mesh, placements=placements)
        assert tuple(d.placements) == tuple(placements) and d.shape == SHAPE
        assert torch.equal(d.to_local(), ragged_expected(want, (2, 2), coord, placements)), make
    a = vescale.dtensor.arange(
        12, device_mesh=mesh, placements=[RaggedShard((0,), (3, 1)), Replicate()]
    )
    assert torch.equal(a.to_local(), torch.arange(9) if coord[0] == 0 else torch.arange(9, 12))


def test_factories(pool4):
    """zeros/ones/rand/randn/arange to a RaggedShard: the one-device values' slices."""
    pool4.run(_check_factories)


def _check_deferred():
    from vescale.initialize import deferred_init, materialize_dtensor

    torch.manual_seed(3)
    eager = torch.nn.Linear(5, 6, dtype=torch.float64).weight.detach()
    torch.manual_seed(3)
    deferred = deferred_init(torch.nn.Linear, 5, 6, dtype=torch.float64).weight
    for mesh_shape, placements in [
        ((4,), [RaggedShard((0,), (1, 0, 3, 2))]),
        ((2, 2), [RaggedShard((0, 1), (3, 0)), Shard(1)]),
    ]:
        with count_collectives() as counts:
            dt = materialize_dtensor(deferred, mesh_of(mesh_shape), placements)
        assert sum(counts.values()) == 0 and tuple(dt.placements) == tuple(placements)
        want = ragged_expected(eager, mesh_shape, coord_of(mesh_shape), placements)
        assert torch.equal(dt.to_local(), want), placements


def test_materialize_deferred_init(pool4):
    """A deferred parameter materialized as a RaggedShard: the eager values' slice, no
    communication."""
    pool4.run(_check_deferred)
