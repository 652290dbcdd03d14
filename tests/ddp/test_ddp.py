"""``vescale.ddp.DistributedDataParallel`` on a (dp=2, tp=2) mesh: every gradient arrives in
its parameter's placements, equal to the single-device gradient, eagerly and compiled, and
the compiled backward graph holds exactly one reduction per data-parallel gradient. On a
dp=2 mesh: plain-tensor parameters given ``dp_mesh`` train like one device on the whole
batch, and compiled DDP buckets under its own ``bucket_cap_mb`` as eager DDP does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vescale
from tests.ddp.mlp import Mlp
from tests.dtensor.reference import mesh_of
from tests.harness.collectives import count_collectives
from tests.harness.misuse import error_everywhere
from vescale import Replicate, Shard
from vescale.backend import PASSES_OFF
from vescale.ddp import DistributedDataParallel

LAYOUT = {  # (dp, tp)
    "fc1.weight": [Replicate(), Shard(0)],
    "fc1.bias": [Replicate(), Shard(0)],
    "fc2.weight": [Replicate(), Shard(1)],
    "fc2.bias": [Replicate(), Replicate()],
    "scale": [Shard(0), Replicate()],  # ZeRO-style: sharded over dp, gathered in forward
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 6)
        self.scale = nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        y = self.fc2(F.relu(self.fc1(x)))
        scale = self.scale
        if isinstance(y, vescale.DTensor):
            y = y.redistribute(placements=[Shard(0), Replicate()])  # row-parallel output
            scale = scale.redistribute(placements=[Replicate(), Replicate()])
        return F.mse_loss(y * scale, target)


def _inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 8, generator=g), torch.randn(8, 6, generator=g)


def _distributed(mesh, bucket_cap_mb=None):
    net = Net()
    for name, p in list(net.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        dt = vescale.distribute_tensor(p.detach(), mesh, LAYOUT[name])
        net.get_submodule(owner).register_parameter(leaf, nn.Parameter(dt))
    return DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb)


def _check_gradients(ddp, ref):
    expected = dict(ref.named_parameters())
    for name, p in ddp.module.named_parameters():
        assert tuple(p.grad.placements) == tuple(p.placements), (name, p.grad.placements)
        torch.testing.assert_close(
            p.grad.full_tensor(),
            expected[name].grad,
            atol=1e-6,
            rtol=1e-5,
            msg=lambda m, name=name: f"{name}: {m}",
        )


def _reference():
    x, t = _inputs()
    ref = Net()
    ref(x, t).backward()
    return ref


def _sharded_inputs(mesh):
    return [vescale.distribute_tensor(a, mesh, [Shard(0), Replicate()]) for a in _inputs()]


def _compiled_dp_backward_collectives(options):
    """One compiled forward + backward (FX codegen, strict: no eager fallback) with backend
    ``options``: its gradients are checked; returns the data-parallel (mesh dim 0) collectives
    of the backward graph."""
    mesh = mesh_of((2, 2))
    ddp = _distributed(mesh)
    result = vescale.fx.trace(ddp, *_sharded_inputs(mesh), options=options)
    _check_gradients(ddp, _reference())
    dp = [r for r in result.collectives if r["mesh_dim"] == 0 and r["graph"].endswith("backward")]
    return sorted((r["kind"], r["bytes"], r["bucket"]) for r in dp)


def _check_compiled():
    # one all-reduce per parameter replicated over dp, of its local gradient: fc2.bias (6,),
    # fc1.bias (8,), fc2.weight (6, 8), fc1.weight (8, 8) float32; the dp-sharded scale: one
    # reduce-scatter of its (6,) Partial gradient (the backward of its forward all-gather)
    assert _compiled_dp_backward_collectives(PASSES_OFF) == [
        ("all_reduce", 24, None),
        ("all_reduce", 32, None),
        ("all_reduce", 192, None),
        ("all_reduce", 256, None),
        ("reduce_scatter", 24, None),
    ]
    # with the passes (default): the four all-reduces go out as one bucket (DDP's cap not
    # given: the backend's bucket_cap_mb)
    assert _compiled_dp_backward_collectives({}) == [
        ("all_reduce", 24 + 32 + 192 + 256, 0),
        ("reduce_scatter", 24, None),
    ]
    # eager DDP after the compile, on another (equal) mesh: the compile's cached shardings
    # hand fc2.bias's gradient the other mesh object, which went into a bucket of its own
    after = _eager_bucket_counts([("after a compile", 25.0)])["after a compile"]
    assert after == {"all_reduce": 1, "reduce_scatter": 1}, after


def test_compiled_gradients_in_parameter_placements_each_reduced_once(pool4):
    """Compiled with the passes off and on (default): every gradient equals one device's in
    its parameter's placements, and the backward graph holds exactly one reduction per
    data-parallel gradient (bucketed into one all-reduce with the passes); eager DDP after
    it still buckets the four into one."""
    pool4.run(_check_compiled)


def _eager_bucket_counts(cases):
    """Eager forward + backward per ``(case, bucket_cap_mb)`` of ``cases``, each on a new mesh:
    the gradients are checked; returns the backward's collectives per case."""
    counts = {}
    for case, cap_mb in cases:
        mesh = vescale.init_device_mesh("cpu", (2, 2))
        ddp = _distributed(mesh, cap_mb)
        loss = ddp(*_sharded_inputs(mesh))
        with count_collectives() as counted:
            loss.backward()
        _check_gradients(ddp, _reference())
        counts[case] = dict(counted)
    return counts


def test_eager_gradients_in_parameter_placements_and_bucketed(pool4):
    # the four dp-replicated gradients: one all-reduce per gradient without bucketing, one in
    # all with a 25 MB cap; the dp-sharded scale's reduce-scatter is its forward gather's adjoint
    cases = [("unbucketed", 0.0), ("bucketed", 25.0)]
    for counts in pool4.run(_eager_bucket_counts, cases):
        assert counts["unbucketed"] == {"all_reduce": 4, "reduce_scatter": 1}, counts
        assert counts["bucketed"] == {"all_reduce": 1, "reduce_scatter": 1}, counts


# ---- data parallelism alone (dp=2): plain parameters, one bucket policy ----------------------


def _batch():
    g = torch.Generator().manual_seed(5)
    return torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)


def _sgd_step(model, net, *inputs):
    """One SGD step of ``model`` (``net`` or a wrapper of it): ``net``'s weights after it."""
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    model(*inputs).backward()
    opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _plain_step(compiled):
    """One SGD step of a plain-parameter model under DDP (dp_mesh: the dp=2 mesh), each rank
    on its half of the batch: returns the weights after it and the reference: one device, the
    whole batch."""
    mesh = vescale.init_device_mesh("cpu", (2,))
    x, t = _batch()
    rank = mesh.get_coordinate()[0]
    ddp = DistributedDataParallel(Mlp(), dp_mesh=mesh)
    model = torch.compile(ddp, backend="vescale", options={"strict": True}) if compiled else ddp
    got = _sgd_step(model, ddp.module, x.chunk(2)[rank], t.chunk(2)[rank])
    ref = Mlp()
    return got, _sgd_step(ref, ref, x, t)


def test_plain_parameters_train_like_one_device_on_the_whole_batch(pool2):
    """A plain ``nn.Module`` under DDP with ``dp_mesh``: the weights after one step equal one
    device's on the concatenated batch (gradients averaged over dp), eagerly and compiled."""
    for compiled in (False, True):
        for got, want in pool2.run(_plain_step, compiled):
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(got[name], want[name], msg=f"{compiled=} {name}")


def _dp_model(mesh, bucket_cap_mb):
    net = Mlp()
    for name, p in list(net.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        dt = vescale.distribute_tensor(p.detach(), mesh, [Replicate()])
        net.get_submodule(owner).register_parameter(leaf, nn.Parameter(dt))
    return DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb)


def _bucket_sizes(cases):
    """Per ``(case, DDP bucket_cap_mb, backend options or None for eager)``: the all-reduce
    bytes of one backward on a dp=2 mesh (sorted), eager counted by the profiler, compiled
    read from the backward graph."""
    out = {}
    for case, cap_mb, options in cases:
        mesh = vescale.init_device_mesh("cpu", (2,))
        ddp = _dp_model(mesh, cap_mb)
        inputs = [vescale.distribute_tensor(a, mesh, [Shard(0)]) for a in _batch()]
        if options is None:
            loss = ddp(*inputs)
            with count_collectives() as counted:
                loss.backward()
            out[case] = (counted["all_reduce"], counted.bytes["all_reduce"])
        else:
            result = vescale.fx.trace(ddp, *inputs, options=options)
            sizes = [
                r["bytes"]
                for r in result.collectives
                if r["kind"] == "all_reduce" and r["graph"].endswith("backward")
            ]
            out[case] = (len(sizes), sum(sizes))
        ref = Mlp()
        ref(*_batch()).backward()
        for (name, p), want in zip(ddp.module.named_parameters(), ref.parameters()):
            assert tuple(p.grad.placements) == (Replicate(),), (case, name, p.grad.placements)
            torch.testing.assert_close(p.grad.full_tensor(), want.grad, msg=f"{case} {name}")
    return out


# fc2.bias (3,), fc2.weight (3, 8), fc1.bias (8,), fc1.weight (8, 4) float32: 12 + 96 + 32 + 128
_TOTAL = 268
# eager buckets also carry two float32 flags per parameter (no gradient here, base-16 rank)
_EAGER = _TOTAL + 4 * 2 * 4
_CAP_TWO = 128 / 2**20  # MiB: fits fc2.bias + fc2.weight (108 B), then fc1.bias alone, fc1.weight


def test_compiled_ddp_buckets_under_its_own_cap_as_eager(pool2):
    """DDP's ``bucket_cap_mb`` decides the compiled buckets of its reductions, whatever the
    backend's option, with eager DDP's sizing rule: the same all-reduce count either way."""
    cases = [
        ("compiled, DDP 0", 0.0, {}),
        ("compiled, DDP 0, backend 25", 0.0, {"bucket_cap_mb": 25}),
        ("compiled, DDP default", None, {}),
        ("compiled, DDP default, backend 0", None, {"bucket_cap_mb": 0}),
        ("compiled, DDP 25, backend 0", 25.0, {"bucket_cap_mb": 0}),
        ("compiled, DDP 128 B", _CAP_TWO, {}),
        ("eager, DDP 0", 0.0, None),
        ("eager, DDP default", None, None),
        ("eager, DDP 128 B", _CAP_TWO, None),
    ]
    for counts in pool2.run(_bucket_sizes, cases):
        assert counts == {
            "compiled, DDP 0": (4, _TOTAL),
            "compiled, DDP 0, backend 25": (4, _TOTAL),
            "compiled, DDP default": (1, _TOTAL),
            "compiled, DDP default, backend 0": (4, _TOTAL),
            "compiled, DDP 25, backend 0": (1, _TOTAL),
            "compiled, DDP 128 B": (3, _TOTAL),
            "eager, DDP 0": (4, _EAGER),
            "eager, DDP default": (1, _EAGER),
            "eager, DDP 128 B": (3, _EAGER),
        }, counts


# ---- rank-dependent control flow, broadcast at construction, torch's signature ----------


class _Branchy(nn.Module):
    def __init__(self, wide: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.b1 = nn.Linear(4, 3)
        self.b2 = nn.Linear(4, 5 if wide else 3)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return (self.b1(h) if rank == 0 else self.b2(h)).pow(2).mean()


def _branch_steps(wide: bool) -> None:
    mesh = vescale.init_device_mesh("cpu", (2,))
    ddp = DistributedDataParallel(_Branchy(wide), device_mesh=mesh)
    rank = mesh.get_coordinate()[0]
    for _ in range(2):
        ddp(torch.randn(2, 4), rank).backward()


def test_rank_dependent_branch_same_shape_is_an_error_everywhere(pool2):
    """Rank 0 uses b1, rank 1 b2 of the same shape (b1.grad silently took rank 1's b2)."""
    err = error_everywhere(pool2, _branch_steps, False)
    assert err.kind == "UnusedParameterError", err
    assert "'b1.weight' on rank 1" in err.message and "'b2.weight' on rank 0" in err.message
    assert "find_unused_parameters=True" in err.message, err.message


def test_rank_dependent_branch_other_shape_is_an_error_everywhere(pool2):
    """Different shapes (a gloo abort: "Received data size doesn't match")."""
    err = error_everywhere(pool2, _branch_steps, True)
    assert "'b2.bias' on rank 0" in err.message and "'b1.bias' on rank 1" in err.message, err


def _unused_found(wide: bool, compiled: bool = False):
    mesh = vescale.init_device_mesh("cpu", (2,))
    rank = mesh.get_coordinate()[0]
    ddp = DistributedDataParallel(
        _Branchy(wide), [0], device_mesh=mesh, find_unused_parameters=True
    )
    model = _compiled(ddp) if compiled else ddp
    xs = torch.randn(2, 2, 4)
    model(xs[rank], rank).backward()
    ref = _Branchy(wide)  # one device: the average of the two ranks' gradients
    for r in range(2):
        (ref(xs[r], r) / 2).backward()
    return {n: p.grad for n, p in ddp.module.named_parameters()}, {
        n: p.grad for n, p in ref.named_parameters()
    }


def _compiled(ddp: DistributedDataParallel) -> nn.Module:
    torch._dynamo.reset()
    return torch.compile(ddp, backend="vescale")


@pytest.mark.parametrize("compiled", [False, True])
def test_find_unused_parameters_equals_one_device(pool2, compiled):
    """Rank 0 uses b1, rank 1 b2: each unused gradient reduced as zero, eager and compiled."""
    for got, want in pool2.run(_unused_found, True, compiled):
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=name)


def _accumulated(compiled: bool = False):
    """Two accumulation windows (one ``no_sync`` backward, then a synced one), each followed
    by a synced backward alone: the gradients after each, and one device's."""
    mesh = vescale.init_device_mesh("cpu", (2,))
    rank = mesh.get_coordinate()[0]
    ddp = DistributedDataParallel(Mlp(), dp_mesh=mesh)
    model = _compiled(ddp) if compiled else ddp
    x, t = _batch()
    xs, ts = x.chunk(2), t.chunk(2)
    halves = [(xs[rank][:1], ts[rank][:1]), (xs[rank][1:], ts[rank][1:])]
    ref = Mlp()
    got, want = [], []
    for _ in range(2):
        with ddp.no_sync():
            model(*halves[0]).backward()
        model(*halves[1]).backward()
        for r in range(2):
            for sl in (slice(0, 1), slice(1, None)):
                (ref(xs[r][sl], ts[r][sl]) / 2).backward()
        got.append({n: p.grad.clone() for n, p in ddp.module.named_parameters()})
        want.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        ddp.module.zero_grad()
        ref.zero_grad()
        model(*halves[0]).backward()  # synced alone
        for r in range(2):
            (ref(xs[r][:1], ts[r][:1]) / 2).backward()
        got.append({n: p.grad.clone() for n, p in ddp.module.named_parameters()})
        want.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        ddp.module.zero_grad()
        ref.zero_grad()
    return got, want


@pytest.mark.parametrize("compiled", [False, True])
def test_no_sync_accumulation_equals_one_device(pool2, compiled):
    """``no_sync`` accumulates locally, the next synced backward reduces the sums, the one
    after reduces only its own (upstream's semantics), eager and compiled."""
    for got, want in pool2.run(_accumulated, compiled):
        for i, (g, w) in enumerate(zip(got, want)):
            for name in w:
                torch.testing.assert_close(g[name], w[name], msg=f"backward {i} {name}")


def _broadcast_at_construction():
    torch.manual_seed(torch.distributed.get_rank())  # different weights per rank
    model = nn.Linear(3, 2)
    DistributedDataParallel(model, [0])  # torch's call on CPU: the default group
    return model.weight.detach().clone()


def test_construction_broadcasts_rank_zero_weights(pool2):
    w0, w1 = pool2.run(_broadcast_at_construction)
    torch.manual_seed(0)
    torch.testing.assert_close(w0, nn.Linear(3, 2).weight.detach())
    assert torch.equal(w0, w1)


def _steady_step():
    """Three steps of plain DDP (dp=2, cap 128 B: three buckets); the third's host reads and
    collectives, the fourth's profiler ranges."""
    from tests.harness.host_sync import count_host_syncs

    mesh = vescale.init_device_mesh("cpu", (2,))
    ddp = DistributedDataParallel(Mlp(), dp_mesh=mesh, bucket_cap_mb=_CAP_TWO)
    x, t = _batch()
    for _ in range(2):
        ddp(x, t).backward()
    with count_host_syncs() as syncs, count_collectives() as counted:
        ddp(x, t).backward()
    with torch.profiler.profile() as prof:
        ddp(x, t).backward()
    ranges = sorted(e.name for e in prof.events() if e.name.startswith("vescale.ddp::"))
    return syncs.calls, dict(counted), ranges


def test_steady_step_has_no_host_read_and_one_range_per_bucket(pool2):
    for calls, counted, ranges in pool2.run(_steady_step):
        assert calls == [], calls
        assert counted == {"all_reduce": 3}, counted
        assert ranges == ["vescale.ddp::bucket0", "vescale.ddp::bucket1", "vescale.ddp::bucket2"]
