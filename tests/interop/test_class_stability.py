"""The class of an op's output never depends on what ran before (issue 27 item 14).

A ``VescaleSpec`` compared equal to the ``DTensorSpec`` with the same fields while hashing
apart. Upstream's C++ sharding cache compares keys with ``==`` when they share a hash-table
bucket, whatever their full hashes, so by chance (the bucket depends on hashes that change
from process to process and on the table's size, i.e. on what ran before) an op on upstream
DTensors got the cached result of the same op on vescale DTensors, and with it a
``vescale.DTensor`` output (``nn.Parameter`` then refused ``detach()``'s class). Equality is
now class-aware, consistent with the hash; the stress test creates, uses, drops and collects many vescale and upstream DTensors of equal
shapes and placements in alternation, then runs upstream tensor-parallel styles and
``nn.Parameter`` on both classes in the same process.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor as UpstreamDTensor
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import distribute_tensor as upstream_distribute
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import vescale
from tests.harness.simulated import fake_world
from vescale._torch_compat import DTensorSpec, OpSchema, TensorMeta
from vescale.dtensor.dtensor import as_vescale_spec

aten = torch.ops.aten
SHAPE = (8, 8)
LAYOUTS = ([Shard(0)], [Shard(1)], [Replicate()])
OPS = (
    lambda t: t.detach(),
    lambda t: t + t,
    lambda t: t.t(),
    lambda t: t.view(-1),
    lambda t: t * 2,
    lambda t: t.sum(),
    lambda t: t.clone(),
    lambda t: torch.mm(t, t.t()) if t.placements[0].is_replicate() else t.abs(),
)


def test_vescale_spec_equality_is_class_aware_and_hash_consistent():
    """Equal specs hash equal; a vescale spec never equals an upstream one (either side),
    so a sharding cache keyed by an ``OpSchema`` keeps the two apart."""
    with fake_world(2):
        mesh = vescale.init_device_mesh("cpu", (2,))
        meta = TensorMeta(torch.Size(SHAPE), (8, 1), torch.float32)
        up = DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)
        up2 = DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)
        ve, ve2 = as_vescale_spec(up), as_vescale_spec(up2)
        assert up == up2 and hash(up) == hash(up2)
        assert ve == ve2 and hash(ve) == hash(ve2)
        assert ve != up and up != ve  # != inverts ==, from either side
        assert (ve == up) is False and (up == ve) is False
        assert len({up, ve, up2, ve2}) == 2
        s_up = OpSchema(aten.detach.default, (up,), {})
        s_ve = OpSchema(aten.detach.default, (ve,), {})
        assert s_up != s_ve and s_ve != s_up
        assert s_up == OpSchema(aten.detach.default, (up2,), {})
        assert s_ve == OpSchema(aten.detach.default, (ve2,), {})


def _check_same(kind: str, out: object) -> None:
    for t in out if isinstance(out, list | tuple) else (out,):
        if isinstance(t, UpstreamDTensor):
            want = vescale.DTensor if kind == "vescale" else UpstreamDTensor
            assert type(t) is want, (kind, type(t))


def _make(kind: str, mesh, placements, seed: int) -> UpstreamDTensor:
    x = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(seed))
    if kind == "vescale":
        return vescale.distribute_tensor(x, mesh, placements)
    return upstream_distribute(x, mesh, placements)


def _materialized_linear(mesh) -> nn.Linear:
    layer = vescale.deferred_init(nn.Linear, *SHAPE)
    vescale.materialize_module(layer, {"weight": (mesh, [Shard(0)]), "*": (mesh, [Replicate()])})
    return layer


def _churn(mesh, rounds: int) -> None:
    """Vescale and upstream DTensors of equal shapes and placements, made, used, dropped
    and collected in alternation; every op output keeps its input's class."""
    kept: list[object] = []
    for r in range(rounds):
        kinds = ("vescale", "upstream") if r % 2 == 0 else ("upstream", "vescale")
        for i, placements in enumerate(LAYOUTS):
            for kind in kinds:
                t = _make(kind, mesh, placements, seed=r * 10 + i)
                for op in OPS:
                    out = op(t)
                    _check_same(kind, out)
                    if (r + i) % 3 == 0:
                        kept.append(out)  # some results outlive the round, most do not
                p = nn.Parameter(t)
                assert type(p.data) is type(t), (kind, type(p.data))
                del t, p, out
        layer = _materialized_linear(mesh)
        assert type(layer.weight.data) is vescale.DTensor
        x = vescale.distribute_tensor(torch.randn(2, SHAPE[1]), mesh, [Replicate()])
        _check_same("vescale", layer(x))
        del layer, x
        if r % 2:
            kept.clear()
            gc.collect()


def _upstream_tp(mesh) -> None:
    """Upstream TP styles on ``mesh``: upstream parameters and outputs, values of one device."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    model.load_state_dict(ref.state_dict())
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    for name, p in model.named_parameters():
        assert type(p) is UpstreamDTensor and isinstance(p, nn.Parameter), name
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out = model(x)
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    ref(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert type(p.grad) is UpstreamDTensor, name
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


def stress_then_upstream_tp(rounds: int) -> None:
    mesh = vescale.init_device_mesh("cpu", (dist.get_world_size(),))
    for _ in range(2):
        _churn(mesh, rounds)
        _upstream_tp(mesh)
        _upstream_tp(vescale.init_device_mesh("cpu", (dist.get_world_size(),)))
        for kind in ("vescale", "upstream"):
            for placements in LAYOUTS:
                t = _make(kind, mesh, placements, seed=99)
                p = nn.Parameter(t)
                assert type(p.data) is type(t) and type(p.detach()) is type(t), kind


def test_class_stable_under_churn_then_upstream_tp(pool2):
    pool2.run(stress_then_upstream_tp, 6, timeout_s=300)
