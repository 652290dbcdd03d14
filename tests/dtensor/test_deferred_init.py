"""Deferred initialization: no parameter memory before materialization; materialized tensors
(plain, or this rank's shard on 1-D/2-D meshes, uneven and interleaved included) equal eager
single-device initialization under the same seed, exactly, without communication; the
generator state matches eager construction throughout."""

from __future__ import annotations

import fnmatch
import itertools

import gpt
import pytest
import torch
from torch import nn

import vescale
from tests.dtensor.reference import compared, coord_of, expected_local, mesh_of
from tests.harness.collectives import count_collectives
from vescale import Partial, Replicate, Shard
from vescale.dtensor.deferred_init import _local_ok
from vescale.dtensor.placement_types import InterleavedShard
from vescale.initialize import deferred_init, is_deferred, materialize_dtensor, materialize_module


class Custom(nn.Module):
    """Init patterns beyond the stock layers: random factories, trunc_normal_, ops after an
    init, in-place ops through views, a derived (orthogonal) init, constants, tied weights."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 20, padding_idx=-3)
        self.a = nn.Parameter(torch.randn(33, 21))
        self.b = nn.Parameter(torch.empty(19, 40, dtype=torch.float64))
        nn.init.trunc_normal_(self.b, std=0.02)
        self.c = nn.Parameter(torch.rand(7, 9) * 2 - 1)  # derived from a random factory
        self.d = nn.Parameter(torch.empty(12, 8))
        nn.init.orthogonal_(self.d)
        with torch.no_grad():
            self.a.mul_(0.5).add_(0.25)
            self.a[:, 3].fill_(7.0)
            self.a[2:30:3].zero_()
        self.register_buffer("pos", torch.arange(30).float())
        self.register_buffer("halves", self.a.new_full((4, 6), 0.5))
        self.register_buffer("noise", torch.randn_like(self.b))
        self.register_buffer("scale", torch.ones(21).copy_(torch.linspace(0, 1, 21)))
        self.head = nn.Linear(20, 37, bias=False)
        self.head.weight = self.emb.weight  # tied


def _modules():
    return {
        "linear": lambda: nn.Linear(40, 33),
        "embedding": lambda: nn.Embedding(50, 17, padding_idx=3),
        "layernorm": lambda: nn.LayerNorm(17),
        "custom": Custom,
        "gpt": lambda: gpt.GPT(gpt.GPTConfig()),
    }


@pytest.mark.parametrize("name", list(_modules()))
def test_deferred_then_materialized_equals_eager(name):
    fn = _modules()[name]
    torch.manual_seed(0)
    eager = fn()
    after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    m = deferred_init(fn)
    assert is_deferred(m)
    for t in [*m.parameters(), *m.buffers()]:
        assert is_deferred(t)
        with pytest.raises(RuntimeError, match="invalid python storage"):
            t.untyped_storage().data_ptr()  # no memory behind it
    assert torch.equal(torch.get_rng_state(), after_eager)  # consumed as eager construction
    materialize_module(m)
    assert not is_deferred(m)
    assert torch.equal(torch.get_rng_state(), after_eager)  # materializing consumes nothing
    assert list(m.state_dict()) == list(eager.state_dict())
    for (key, got), want in zip(m.state_dict().items(), eager.state_dict().values()):
        assert type(got) is torch.Tensor and torch.equal(got, want), key
    assert {n for n, _ in m.named_parameters()} == {n for n, _ in eager.named_parameters()}
    if name == "custom":
        assert m.head.weight is m.emb.weight


def test_stock_layers_replay_on_the_shard_only():
    """The init ops of Linear, Embedding (padding row), LayerNorm, the GPT and the custom
    module's randn/trunc_normal_/view fills and casts (arange().float()) replay on the shard;
    derived inits (orthogonal_, arithmetic on a deferred tensor, copy from one) do not."""
    local = {}
    for name, fn in _modules().items():
        m = deferred_init(fn)
        for key, t in [*m.named_parameters(), *m.named_buffers()]:
            local[f"{name}.{key}"] = not t._view and _local_ok(t._record)
    derived = {"custom.c", "custom.d", "custom.scale"}
    assert {k for k, ok in local.items() if not ok} == derived


def test_random_ops_after_deferred_init_continue_the_stream():
    torch.manual_seed(3)
    nn.Linear(30, 30)
    expected = nn.Linear(30, 30).weight.detach()
    torch.manual_seed(3)
    deferred_init(nn.Linear, 30, 30)
    assert torch.equal(nn.Linear(30, 30).weight.detach(), expected)


# ---- sharded materialization on gloo ranks -----------------------------------------------

LAYOUTS = [((4,), [p]) for p in (Replicate(), Shard(0), Shard(1), Partial())] + [
    ((2, 2), list(pl)) for pl in itertools.product([Replicate(), Shard(0), Shard(1)], repeat=2)
]


def _check_sharded(name):
    fn = _modules()[name]
    torch.manual_seed(11)
    eager = dict(fn().named_parameters())
    torch.manual_seed(11)
    m = deferred_init(fn)
    state = torch.get_rng_state()
    for mesh_shape, placements in LAYOUTS:
        mesh = mesh_of(mesh_shape)
        with count_collectives() as counts:  # none for any parameter of this layout
            for pname, param in m.named_parameters():
                sharded = (p.dim + 1 for p in placements if isinstance(p, Shard))
                if param.ndim < max(sharded, default=0):
                    continue
                dt = materialize_dtensor(param, mesh, placements)
                case = (name, pname, mesh_shape, placements)
                assert tuple(dt.shape) == tuple(param.shape), case
                assert tuple(dt.placements) == tuple(placements), case
                coord = coord_of(mesh_shape)
                want = expected_local(eager[pname].detach(), mesh_shape, coord, placements)
                assert torch.equal(dt.to_local(), want), case
        assert sum(counts.values()) == 0, (name, mesh_shape, placements, counts)
    assert is_deferred(m)  # materialize_dtensor leaves the module alone
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("name", list(_modules()))
def test_materialized_shards_equal_eager_slices(pool4, name):
    pool4.run(_check_sharded, name)


def _check_module_plan():
    mesh = mesh_of((2, 2))
    plan = {
        "blocks.*.attn.[qkv].*": (mesh, [Replicate(), Shard(0)]),
        "blocks.*.mlp.fc.weight": (mesh, [Shard(1), Shard(0)]),
        "tok.weight": (mesh, [Shard(0), Shard(0)]),
        "head.weight": (mesh, [Shard(1), Replicate()]),
    }
    cfg = gpt.GPTConfig(vocab=61, dim=32)  # 61 rows: uneven on every layout
    torch.manual_seed(5)
    eager = dict(gpt.GPT(cfg).named_parameters())
    torch.manual_seed(5)
    m = deferred_init(gpt.GPT, cfg)
    with count_collectives() as counts:
        materialize_module(m, plan)
    assert sum(counts.values()) == 0, counts
    assert not is_deferred(m)
    for name, p in m.named_parameters():
        layout = next((v for k, v in plan.items() if fnmatch.fnmatchcase(name, k)), None)
        assert isinstance(p, nn.Parameter) and p.requires_grad
        if layout is None:
            assert type(p.data) is torch.Tensor and torch.equal(p.detach(), eager[name]), name
        else:
            assert isinstance(p.data, vescale.DTensor), name
            want = expected_local(eager[name].detach(), (2, 2), coord_of((2, 2)), layout[1])
            assert torch.equal(p.to_local(), want), name


def test_materialize_module_plan(pool4):
    pool4.run(_check_module_plan)


def _check_interleaved():
    torch.manual_seed(2)
    eager = nn.Linear(16, 3 * 8)  # a merged QKV projection
    torch.manual_seed(2)
    m = deferred_init(nn.Linear, 16, 3 * 8)
    for mesh_shape, placements in [
        ((4,), [InterleavedShard(0, 3)]),
        ((2, 2), [Replicate(), InterleavedShard(0, 3)]),
    ]:
        mesh = mesh_of(mesh_shape)
        coord = coord_of(mesh_shape)
        n, c = mesh_shape[-1], coord[-1]
        for got, want in ((m.weight, eager.weight), (m.bias, eager.bias)):
            dt = materialize_dtensor(got, mesh, placements)
            q, k, v = want.detach().chunk(3)
            expected = torch.cat([t.chunk(n)[c] for t in (q, k, v)])  # rank c's rows of Q, K, V
            assert torch.equal(dt.to_local(), expected), (mesh_shape, got.shape)


def test_interleaved_shard(pool4):
    pool4.run(_check_interleaved)


def _check_demo_first_step():
    import train_demo

    from vescale.ddp import DistributedDataParallel

    cfg = gpt.GPTConfig()
    mesh = vescale.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = gpt.build_deferred(cfg)
    assert is_deferred(model)
    with count_collectives() as counts:
        gpt.parallelize(model, mesh)
    assert sum(counts.values()) == 0, counts
    reference = gpt.build(cfg)
    for name, p in model.named_parameters():
        assert torch.equal(*compared(p, reference.get_parameter(name).detach())), name
    sharded = train_demo.train(
        DistributedDataParallel(model), cfg, 1, 0.5, lambda i, t: gpt.shard_batch(mesh, i, t)
    )
    single = train_demo.train(reference, cfg, 1, 0.5, lambda i, t: (i, t))
    assert abs(sharded.losses[0] - single.losses[0]) <= 1e-6, (sharded.losses, single.losses)


def test_demo_gpt_through_deferred_init(pool4):
    """The demo's distributed model: deferred, materialized shard by shard, first-step loss
    equal to single-device init."""
    pool4.run(_check_demo_first_step)


# ---- casts after deferred_init, and a second materialize_module --------------------------

CASTS = {
    "double": lambda m: m.double(),
    "half": lambda m: m.half(),
    "to_bfloat16": lambda m: m.to(torch.bfloat16),
    "to_dtype_kw": lambda m: m.to(dtype=torch.float64),
}


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("name", ["linear", "embedding", "custom"])
def test_casts_after_deferred_init_are_kept(name, cast):
    fn, apply = _modules()[name], CASTS[cast]
    torch.manual_seed(1)
    eager = apply(fn())
    torch.manual_seed(1)
    m = apply(deferred_init(fn))
    assert is_deferred(m)
    materialize_module(m)
    for (key, got), want in zip(m.state_dict().items(), eager.state_dict().values()):
        assert got.dtype == want.dtype and torch.equal(got, want), (key, got.dtype, want.dtype)
    if name == "linear":  # the cast replays on the shard: no full-size temporary
        assert all(_local_ok(p._record) for p in apply(deferred_init(fn)).parameters())


def _check_sharded_casts():
    mesh = mesh_of((4,))
    torch.manual_seed(3)
    eager = nn.Linear(10, 9).to(torch.bfloat16)
    torch.manual_seed(3)
    m = deferred_init(nn.Linear, 10, 9).to(torch.bfloat16)
    materialize_module(m, {"weight": (mesh, [Shard(0)]), "bias": (mesh, [Shard(0)])})
    for pname in ("weight", "bias"):
        got = getattr(m, pname)
        want = expected_local(getattr(eager, pname).detach(), (4,), coord_of((4,)), [Shard(0)])
        assert got.dtype == torch.bfloat16 and torch.equal(got.to_local(), want), pname


def test_sharded_casts_are_kept(pool4):
    pool4.run(_check_sharded_casts)


def test_materialize_module_twice():
    """A second call without a plan keeps the tensors; one whose plan takes a DTensor raises
    naming the module and the tensor."""
    from tests.harness import fake_world

    with fake_world(4):
        mesh = vescale.init_device_mesh("cpu", (4,))
        m = deferred_init(nn.Linear, 8, 8)
        plan = {"*": (mesh, [Shard(0)])}
        materialize_module(m, plan)
        weight = m.weight
        assert materialize_module(m) is m and m.weight is weight
        with pytest.raises(ValueError, match=r"Linear's 'weight' is already a DTensor .*Shard"):
            materialize_module(m, plan)
        assert m.weight is weight
