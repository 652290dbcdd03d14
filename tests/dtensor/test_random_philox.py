"""Random ops on Philox (CUDA) devices, checked on CPU by structure: each rank runs the op on
its shard alone (elements drawn per rank = the shard's), at offsets numbering the shard
(the same on replicas, disjoint between shards, every rank's generator then moved by the
same amount); SDPA's fused kernels with dropout get the offsets of their (batch, head)
shard. ``PHILOX_DEVICES`` is widened to the test's device and ``run_at_philox`` (upstream's
``run_dtensor_rng_op`` on CUDA) replaced by a recorder standing in for Philox at an offset."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import vescale
from tests.dtensor.reference import coord_of
from tests.harness import fake_world, local_world
from vescale import Partial, RaggedShard, Replicate, Shard
from vescale._torch_compat import DTensorSpec, StridedShard, TensorMeta, TorchDispatchMode, pytree
from vescale.dtensor import random as vrandom
from vescale.dtensor.layout import contiguous_strides, local_indices
from vescale.dtensor.ragged import ragged_local_range
from vescale.initialize import deferred_init, materialize_dtensor

aten = torch.ops.aten


def _spec(mesh, placements, shape) -> DTensorSpec:
    meta = TensorMeta(torch.Size(shape), contiguous_strides(shape), torch.float32)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


OFFSET_LAYOUTS = [
    ((4,), [Shard(0)]),
    ((4,), [Shard(1)]),
    ((4,), [Replicate()]),
    ((2, 2), [Replicate(), Shard(0)]),
    ((2, 2), [Shard(0), Shard(1)]),
    ((2, 2), [Shard(0), Shard(0)]),
    ((2, 2), [Partial(), Shard(1)]),
    ((2, 2), [StridedShard(0, split_factor=2), Shard(1)]),  # InterleavedShard(0, 2)'s spec
]


OFFSET_CASES = [
    (mesh_shape, placements, shape)
    for (mesh_shape, placements), shape in itertools.product(
        OFFSET_LAYOUTS, [(8, 12), (5, 7), (3, 40), (2, 2)]
    )
    if not isinstance(placements[0], StridedShard) or shape[0] % 2 == 0  # interleaving divides
]


@pytest.mark.parametrize("mesh_shape,placements,shape", OFFSET_CASES, ids=str)
def test_philox_offsets_number_shards(mesh_shape, placements, shape):
    mesh = vescale.DeviceMesh("meta", torch.arange(4).reshape(mesh_shape))
    spec = _spec(mesh, placements, shape)
    by_shard: dict[tuple, set[int]] = {}
    ends = set()
    ranges = []
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        start, end = vrandom.philox_offsets(spec, coord)
        indices = local_indices(shape, mesh, placements, coord)
        numel = math.prod(len(ix) for ix in indices)
        assert start % 4 == 0 and end % 4 == 0, (coord, start, end)
        ends.add(end)
        shard = tuple(tuple(ix.tolist()) for ix in indices)
        if not numel:  # an empty shard draws nothing
            continue
        if shard not in by_shard:
            # a CUDA kernel reserves at least 4 offsets, at most its element count rounded
            ranges.append((start, start + max(4, -(-numel // 4) * 4)))
        by_shard.setdefault(shard, set()).add(start)
    assert len(ends) == 1 and ends.pop() >= math.prod(shape)  # every rank moves alike
    assert all(len(starts) == 1 for starts in by_shard.values())  # replicas agree
    ranges.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ranges)), ranges  # disjoint
    assert all(a >= 0 and b <= end for a, b in ranges)


class _Philox:
    """Stands in for ``run_at_philox``: records ``(start, end, elements)`` per call and draws
    from the default generator seeded with ``start`` (restored after: the test's generator
    state must be untouched by a per-shard draw)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, start, end, op, *args, generator=None, **kwargs):
        self.calls.append((start, end, args[0].numel()))
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(1000 + start)
            return op(*args, **kwargs)


@pytest.fixture
def philox(monkeypatch):
    fake = _Philox()
    monkeypatch.setattr(vrandom, "PHILOX_DEVICES", frozenset({"cpu", "meta"}))
    monkeypatch.setattr(vrandom, "run_at_philox", fake)
    return fake


def _draws(mode) -> dict[int, torch.Tensor]:
    zeros = mode.rank_map(lambda r: torch.zeros(3))
    return dict(torch.rand_like(zeros)._local_tensors)


SHARD_OPS = {
    # what F.dropout runs on CUDA (on CPU it is bernoulli_ and a product)
    "native_dropout": lambda t: aten.native_dropout(t, 0.3, True)[0],
    "dropout": lambda t: F.dropout(t, 0.3, training=True),
    "normal_": lambda t: torch.nn.init.normal_(t, 0.0, 2.0),
    "uniform_": lambda t: t.uniform_(-1.0, 1.0),
    "bernoulli_": lambda t: t.bernoulli_(0.25),
    "bernoulli_tensor": lambda t: t.bernoulli_(torch.full_like(t, 0.5)),
    "rand_like": torch.rand_like,
}


@pytest.mark.parametrize("name", sorted(SHARD_OPS))
def test_random_ops_draw_only_the_shard(philox, name):
    """(2, 2) mesh, [Replicate(), Shard(1)]: ranks 0 and 2 hold columns 0-5, 1 and 3 the
    rest; one draw per rank of exactly its 48 elements, nothing from the CPU stream."""
    x = torch.arange(96.0).view(8, 12) + 1.0
    with local_world(4) as mode:
        mesh = vescale.init_device_mesh("cpu", (2, 2))
        d = vescale.distribute_tensor(x, mesh, [Replicate(), Shard(1)])
        torch.manual_seed(0)
        before = _draws(mode)
        torch.manual_seed(0)
        out = SHARD_OPS[name](d)
        after = _draws(mode)
        locals_ = dict(out.to_local()._local_tensors)
    assert [n for _, _, n in philox.calls] == [48] * 4, philox.calls  # O(shard) per rank
    starts = [s for s, _, _ in philox.calls]
    assert starts[0] == starts[2] and starts[1] == starts[3] and starts[0] != starts[1]
    assert len({e for _, e, _ in philox.calls}) == 1
    for rank in range(4):
        assert torch.equal(before[rank], after[rank]), rank  # no whole-tensor CPU walk
    assert torch.equal(locals_[0], locals_[2]) and torch.equal(locals_[1], locals_[3])
    assert not torch.equal(locals_[0], locals_[1])
    assert tuple(out.placements) == (Replicate(), Shard(1))


@pytest.mark.parametrize(
    "mesh_shape,placements", [((4,), [Replicate()]), ((4, 1), [Replicate(), Shard(0)])], ids=str
)
def test_unsharded_tensors_draw_as_one_device(philox, mesh_shape, placements):
    """No mesh dim of more than one rank shards the tensor: every rank runs the op itself,
    as one device does (same values, same generator advance), no offsets."""
    torch.manual_seed(5)
    want = torch.empty(8, 12).uniform_(-1.0, 1.0)
    after = torch.rand(3)
    with local_world(4) as mode:
        mesh = vescale.init_device_mesh("cpu", mesh_shape)
        d = vescale.distribute_tensor(torch.zeros(8, 12), mesh, placements)
        torch.manual_seed(5)
        d.uniform_(-1.0, 1.0)
        locals_ = dict(d.to_local()._local_tensors)
        draws = _draws(mode)
    assert philox.calls == []
    for rank in range(4):
        assert torch.equal(locals_[rank], want) and torch.equal(draws[rank], after), rank


def test_native_dropout_on_a_partial_input_stays_partial(philox):
    """The same mask on every rank of a Partial mesh dim (the dropped sum is the sum
    dropped), replicated; ``out = x * mask / (1 - p)`` on each shard."""
    with local_world(4):
        mesh = vescale.init_device_mesh("cpu", (2, 2))
        d = vescale.DTensor.from_local(
            torch.ones(4, 6), mesh, [Partial(), Shard(0)], run_check=False
        )
        out, mask = aten.native_dropout(d, 0.5, True)
        assert tuple(out.placements) == (Partial(), Shard(0))
        assert tuple(mask.placements) == (Replicate(), Shard(0)) and mask.dtype == torch.bool
        outs = dict(out.to_local()._local_tensors)
        masks = dict(mask.to_local()._local_tensors)
    assert [n for _, _, n in philox.calls] == [24] * 4
    assert torch.equal(masks[0], masks[2]) and not torch.equal(masks[0], masks[1])
    for rank in range(4):
        assert torch.equal(outs[rank], masks[rank].float() * 2.0)


def _sdpa(kernel, qkv, p):
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention(*qkv, p, False)[0]
    return aten._scaled_dot_product_efficient_attention(*qkv, None, False, p, False)[0]


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
@pytest.mark.parametrize(
    "mesh_shape,placements",
    [((4,), [Shard(1)]), ((2, 2), [Replicate(), Shard(1)]), ((2, 2), [Shard(0), Shard(1)])],
    ids=str,
)
def test_sdpa_dropout_offsets_per_head_shard(philox, kernel, mesh_shape, placements):
    """The fused kernels with dropout (meta tensors: shapes, no GPU): each rank's kernel runs
    at the offsets of its (batch, head) shard of a (B, H, L, max(S, 32)) virtual tensor:
    distinct across head shards, the same on replicas, never one seed+offset for all."""
    B, H, L, S, E = 4, 8, 16, 8, 64
    starts = {}
    for rank in range(4):
        mesh = vescale.DeviceMesh("meta", torch.arange(4).reshape(mesh_shape), _rank=rank)
        q, k, v = (
            vescale.distribute_tensor(
                torch.empty(B, H, n, E, device="meta", dtype=torch.bfloat16), mesh, placements
            )
            for n in (L, S, S)
        )
        philox.calls.clear()
        _sdpa(kernel, (q, k, v), 0.0)
        assert philox.calls == []  # no dropout: the kernel runs as upstream runs it
        out = _sdpa(kernel, (q, k, v), 0.5)
        assert tuple(out.placements) == tuple(placements)
        ((start, end, _),) = philox.calls
        spec = _spec(mesh, placements, (B, H, L, 32))
        want = vrandom.philox_offsets(spec, coord_of(mesh_shape, rank))
        assert (start, end) == want
        starts[rank] = start
    if mesh_shape == (4,):
        assert len(set(starts.values())) == 4
    elif placements[0] == Replicate():
        assert starts[0] == starts[2] != starts[1] == starts[3]
    else:
        assert len(set(starts.values())) == 4


class _PhiloxGenerator:
    """A generator whose state is CUDA's: 16 bytes, the seed then the offset (int64)."""

    def __init__(self, seed: int, offset: int) -> None:
        self.state = torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8)

    def get_state(self) -> torch.Tensor:
        return self.state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self.state = state.clone()

    def offset(self) -> int:
        return int(self.state.view(torch.int64)[1])


def test_run_at_philox_moves_an_explicit_generator():
    """The op sees the offset ``start`` past the generator's, which ends ``end`` past it."""
    gen = _PhiloxGenerator(seed=7, offset=40)
    seen = []

    def op(t, *, generator):
        seen.append(generator.offset())
        return t

    vrandom.run_at_philox(96, 256, op, torch.zeros(3), generator=gen)
    assert seen == [40 + 96] and gen.offset() == 40 + 256
    assert int(gen.state.view(torch.int64)[0]) == 7  # the seed stays


def test_sdpa_dropout_offsets_per_simulated_rank(philox, monkeypatch):
    """Under LocalTensorMode each simulated rank's kernel runs at its own shard's offsets (the
    kernel itself on meta copies: CPU has no flash kernel; zeros of its outputs' shapes)."""

    def on_meta(start, end, op, *args, generator=None, **kwargs):
        philox.calls.append((start, end, args[0].numel()))
        meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
        out = op(*meta, **kwargs)
        return tuple(
            torch.zeros(o.shape, dtype=o.dtype) if isinstance(o, torch.Tensor) else o for o in out
        )

    monkeypatch.setattr(vrandom, "run_at_philox", on_meta)
    with local_world(4):
        mesh = vescale.init_device_mesh("cpu", (2, 2))
        q = vescale.distribute_tensor(torch.randn(2, 4, 16, 8), mesh, [Replicate(), Shard(1)])
        out = aten._scaled_dot_product_flash_attention(q, q, q, 0.5, False)[0]
        assert tuple(out.placements) == (Replicate(), Shard(1))
    starts = [s for s, _, _ in philox.calls]
    assert [n for _, _, n in philox.calls] == [2 * 2 * 16 * 8] * 4  # each rank's own shard
    assert starts[0] == starts[2] != starts[1] == starts[3]
    assert len({e for _, e, _ in philox.calls}) == 1


# ---- deferred init and vescale.fsdp materialization on a Philox device ------------------


class _Sizes(TorchDispatchMode):
    """The element count of every tensor an op makes within the block."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor):
                self.sizes.append(o.numel())
        return out


DEFERRED_LAYOUTS = [
    ((4,), [Shard(0)]),
    ((4,), [Shard(1)]),
    ((2, 2), [Replicate(), Shard(1)]),
    ((2, 2), [Shard(0), Shard(1)]),
    ((4,), [RaggedShard(dims=(0,), local_units=(1, 2, 0, 1))]),  # vescale.fsdp's layout
    ((2, 2), [Replicate(), RaggedShard(dims=(0,), local_units=(3, 1))]),  # HSDP's
]
DEFERRED_OPS = {
    "uniform_": (lambda: torch.empty(8, 12).uniform_(-1.0, 1.0), lambda t: t.uniform_(-1.0, 1.0)),
    "randn": (lambda: torch.randn(8, 12), lambda t: t.normal_()),
}


def _rank_mesh(mesh_shape, rank) -> vescale.DeviceMesh:
    """A CPU mesh as rank ``rank`` sees it, without process groups."""
    ranks = torch.arange(4).reshape(mesh_shape)
    return vescale.DeviceMesh("cpu", ranks, _rank=rank, _init_backend=False)


def _shard_shape(shape, mesh, placements, coord) -> tuple[int, ...]:
    if any(isinstance(p, RaggedShard) for p in placements):
        return (ragged_local_range(shape, mesh, placements, coord)[1],)
    return tuple(len(ix) for ix in local_indices(shape, mesh, placements, coord))


@pytest.mark.parametrize("op", sorted(DEFERRED_OPS))
@pytest.mark.parametrize("mesh_shape,placements", DEFERRED_LAYOUTS, ids=str)
def test_deferred_init_draws_each_shard_at_its_offsets(philox, op, mesh_shape, placements):
    """A deferred random init materialized as a DTensor on a Philox device (each rank's mesh
    coordinate in turn, meshes without groups: none is needed): recording draws nothing and
    moves the generator past a reservation for any layout (world size x elements); each
    rank's materialization is one draw of exactly its shard's elements at its shard's
    offsets within it (the offsets the same op on a DTensor of that layout draws at), no
    tensor larger than the shard is made (per-dim index sets aside), the CPU generator is untouched; replicas equal,
    shards differ. ``materialize_dtensor`` with a RaggedShard is what vescale.fsdp runs."""
    make, draw = DEFERRED_OPS[op]
    shape = (8, 12)
    torch.manual_seed(0)
    cpu_state = torch.get_rng_state()
    locals_ = {}
    with fake_world(4):
        for rank in range(4):
            philox.calls.clear()
            t = deferred_init(make)
            assert philox.calls == [(0, 4 * 96, 0)], philox.calls  # reserved, nothing drawn
            philox.calls.clear()
            mesh = _rank_mesh(mesh_shape, rank)
            with _Sizes() as made:
                d = materialize_dtensor(t, mesh, placements)
            coord = coord_of(mesh_shape, rank)
            local = d.to_local()
            want_shape = _shard_shape(shape, mesh, placements, coord)
            assert tuple(local.shape) == want_shape and local.device.type == "cpu"
            numel = math.prod(want_shape)
            start, end = vrandom.philox_offsets(_spec(mesh, placements, shape), coord)
            assert philox.calls == [(start, end, numel)], (rank, philox.calls)
            # O(shard): the shard and per-dim index sets, never the whole tensor
            assert max(made.sizes) <= max(numel, *shape), (rank, made.sizes)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1000 + start)
                want = draw(torch.empty(numel)).view(want_shape)
            assert torch.equal(local, want), rank
            locals_[rank] = (start, local)
    assert torch.equal(torch.get_rng_state(), cpu_state)
    by_start: dict[int, torch.Tensor] = {}
    for start, local in locals_.values():
        if start in by_start:
            assert torch.equal(by_start[start], local)  # replicas equal
        by_start[start] = local
    assert len(by_start) == math.prod(
        n for n, p in zip(mesh_shape, placements) if not isinstance(p, Replicate)
    )


def test_deferred_init_reservation_too_small_is_an_error(philox):
    """Recorded with no process group (world size 1: one tensor's offsets reserved), a
    sharded materialization would draw past them into the next op's: a ValueError naming
    the op, the placements and the mesh, before anything is drawn."""
    t = deferred_init(lambda: torch.empty(5, 12).uniform_())
    mesh = _rank_mesh((4,), 3)
    philox.calls.clear()
    with pytest.raises(ValueError, match=r"uniform_.*reserved 60 .*Shard\(dim=0\).*init_process"):
        materialize_dtensor(t, mesh, [Shard(0)])
    assert philox.calls == []


def test_ragged_dtensor_random_ops_draw_only_the_shard(philox):
    """What vescale.fsdp's meta-device path runs (``to_empty``, then an in-place init on the
    sharded parameters): a random op on a RaggedShard DTensor draws each rank's slice
    alone, at its offsets (distinct between ranks), every rank's generator moved alike."""
    units = (1, 2, 0, 1)
    ragged = [RaggedShard(dims=(0,), local_units=units)]
    for rank in range(4):
        mesh = _rank_mesh((4,), rank)
        local = torch.zeros(units[rank] * 24)
        d = vescale.DTensor.from_local(
            local, mesh, ragged, run_check=False, shape=(8, 12), stride=(12, 1)
        )
        d.uniform_(-1.0, 1.0)
        assert d.to_local() is local or d.to_local().numel() == local.numel()
    assert [n for _, _, n in philox.calls] == [u * 24 for u in units]
    starts = [s for s, _, _ in philox.calls]
    spec = _spec(_rank_mesh((4,), 0), ragged, (8, 12))
    assert starts == [vrandom.philox_offsets(spec, (r,))[0] for r in range(4)]
    assert len(set(starts)) == 4 and len({e for _, e, _ in philox.calls}) == 1
