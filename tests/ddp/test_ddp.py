"""``vescale.ddp.DistributedDataParallel`` on a (dp=2, tp=2) mesh: every gradient arrives in
its parameter's placements, equal to the single-device gradient, eagerly and compiled, and
the compiled backward graph holds exactly one reduction per data-parallel gradient."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import vescale
from tests.dtensor.reference import mesh_of
from tests.harness.collectives import count_collectives
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


def _distributed(mesh, bucket_cap_mb=25.0):
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
    # with the passes (default): the four all-reduces go out as one bucket
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
