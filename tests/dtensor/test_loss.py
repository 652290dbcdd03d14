"""Element-wise losses (mean reduction) on sharded inputs, uneven shards included: the global
mean forward and backward, equal to single-device float64, with no communication."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

import vescale
from tests.dtensor.reference import compared, local_dtensor
from tests.harness.collectives import count_collectives
from vescale import InterleavedShard, Partial, Replicate, Shard

LOSSES = {
    "mse": F.mse_loss,
    "smooth_l1": lambda a, b: F.smooth_l1_loss(a, b, beta=0.5),
    "huber": lambda a, b: F.huber_loss(a, b, delta=0.7),
    "soft_margin": lambda a, b: F.soft_margin_loss(a, b.sign()),
    "bce": lambda a, b: F.binary_cross_entropy(a.sigmoid(), b.sigmoid()),
}
LAYOUTS = [
    ((4,), [Shard(0)]),
    ((4,), [Shard(1)]),
    ((4,), [Replicate()]),
    ((2, 2), [Shard(0), Shard(1)]),
    ((2, 2), [Shard(1), Replicate()]),
]


def _check_loss(name, shape):
    fn = LOSSES[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    t = torch.randn(*shape, generator=g, dtype=torch.float64)
    ref_x = x.clone().requires_grad_(True)
    ref = fn(ref_x, t)
    ref.backward()
    for mesh_shape, placements in LAYOUTS:
        dx = local_dtensor(x, mesh_shape, placements).requires_grad_(True)
        dt = local_dtensor(t, mesh_shape, placements)
        with CommDebugMode() as comm:
            loss = fn(dx, dt)
            loss.backward()
        assert comm.get_total_counts() == 0, (name, placements, comm.get_comm_counts())
        assert tuple(dx.grad.placements) == tuple(dx.placements)
        torch.testing.assert_close(*compared(loss, ref.detach()), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(*compared(dx.grad, ref_x.grad), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_mean_losses_on_sharded_inputs(pool4, name):
    pool4.run(_check_loss, name, (8, 6))  # even
    pool4.run(_check_loss, name, (7, 5))  # uneven on both dims


# (input, target, communicates) layouts that differ on 4 ranks; a Replicate input takes the target's shard
# locally (upstream's own DTensors get the gradient wrong there)
MIXED = [
    ([Replicate()], [Shard(0)], False),
    ([Shard(0)], [Replicate()], False),
    ([Shard(0)], [Shard(1)], True),
    ([Replicate()], [Partial()], True),
]


def _check_mixed_layouts(shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    t = torch.randn(*shape, generator=g, dtype=torch.float64)
    for name, fn in LOSSES.items():
        ref_x = x.clone().requires_grad_(True)
        ref = fn(ref_x, t)
        ref.backward()
        for x_pl, t_pl, communicates in MIXED:
            dx = local_dtensor(x, (4,), x_pl).requires_grad_(True)
            dt = local_dtensor(t, (4,), t_pl)
            with vescale.dtensor.explicit_redistribute(False), count_collectives() as counts:
                loss = fn(dx, dt)
            assert (sum(counts.values()) > 0) is communicates, (name, x_pl, t_pl)
            loss.backward()
            torch.testing.assert_close(*compared(loss, ref.detach()), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(*compared(dx.grad, ref_x.grad), rtol=1e-12, atol=1e-12)


def test_losses_on_inputs_of_different_layouts(pool4):
    pool4.run(_check_mixed_layouts, (5, 7))  # uneven, one empty shard of dim 0


def _check_nll_on_average_partial():
    """``nll_loss`` on a ``Partial("avg")`` input: the mean of the ranks' values is the input
    (the vocabulary-parallel handler takes sum-partials only; an average must be reduced
    first, or the loss is the sum of the ranks' losses)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64).log_softmax(-1)
    noise = torch.randn(6, 5, generator=g, dtype=torch.float64)
    t = torch.randint(0, 5, (6,), generator=g)
    rank = torch.distributed.get_rank()
    mesh = vescale.init_device_mesh("cpu", (4,))
    local = x + (rank - 1.5) * noise  # the four ranks' values average to x
    dx = vescale.from_local(local, mesh, [Partial("avg")], run_check=False)
    dt = vescale.from_local(t, mesh, [Replicate()], run_check=False)
    with pytest.raises(vescale.dtensor.explicit.ImplicitRedistributionError, match="avg"):
        F.nll_loss(dx, dt)  # explicit mode: the reduction is the user's to ask for
    for reduction in ("mean", "sum"):
        with vescale.dtensor.explicit_redistribute(False):
            loss = F.nll_loss(dx, dt, reduction=reduction)
        want = F.nll_loss(x, t, reduction=reduction)
        torch.testing.assert_close(loss.full_tensor(), want, rtol=1e-12, atol=1e-12)


def test_nll_loss_on_an_average_partial_is_the_loss_of_the_average(pool4):
    pool4.run(_check_nll_on_average_partial)


def _check_nll_whole_target():
    """``nll_loss`` on batch-sharded input (uneven rows, over both mesh dims, with ignored
    targets) and a replicated target: the rows are sliced locally and the total weight is
    counted from the whole target, so mean and sum need no collective; forward and backward
    equal one device's (float64). The batch-sharded target still all-reduces its count."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, 5, generator=g, dtype=torch.float64).log_softmax(-1)
    t = torch.randint(0, 5, (11,), generator=g)
    t[[1, 6]] = -100  # ignored: the mean divides by the 9 counted targets
    w = torch.rand(5, generator=g, dtype=torch.float64)
    mesh = vescale.init_device_mesh("cpu", (2, 2))
    dx0 = vescale.distribute_tensor(x, mesh, [Shard(0), Shard(0)])
    dt = vescale.distribute_tensor(t, mesh, [Replicate(), Replicate()])
    dw = vescale.distribute_tensor(w, mesh, [Replicate(), Replicate()])
    for reduction in ("mean", "sum"):
        for weight, dweight in ((None, None), (w, dw)):
            ref_x = x.clone().requires_grad_(True)
            ref = F.nll_loss(ref_x, t, weight=weight, reduction=reduction)
            ref.backward()
            dx = dx0.detach().requires_grad_(True)
            with count_collectives() as counts:
                loss = F.nll_loss(dx, dt, weight=dweight, reduction=reduction)
                loss.backward(torch.ones_like(loss))
            assert sum(counts.values()) == 0, (reduction, dict(counts))
            assert all(p.is_partial() for p in loss.placements), loss.placements
            torch.testing.assert_close(loss.full_tensor(), ref, rtol=1e-12, atol=1e-12)
            assert dx.grad.placements == dx.placements, dx.grad.placements
            torch.testing.assert_close(dx.grad.full_tensor(), ref_x.grad, rtol=1e-12, atol=1e-12)
    sharded = vescale.distribute_tensor(t, mesh, [Shard(0), Shard(0)])
    with count_collectives() as counts:
        loss = F.nll_loss(dx0, sharded)
    assert counts["all_reduce"] == 2, dict(counts)  # the count, over each batch mesh dim
    torch.testing.assert_close(loss.full_tensor(), F.nll_loss(x, t), rtol=1e-12, atol=1e-12)


def test_nll_loss_with_the_whole_target_needs_no_collective(pool4):
    pool4.run(_check_nll_whole_target)


def _check_cross_entropy_of_flattened_logits():
    """The training loop's ``cross_entropy(logits.view(-1, V), labels.view(-1))`` with the
    batch over dp and the sequence over tp, ignored labels unevenly spread: the flattened
    rows are ``(Shard(0), Shard(0))`` (one sequence per dp rank; upstream says
    ``_StridedShard(0, split_factor=1)``) or interleaved (two per dp rank). Both take the
    global-mean handler (upstream's ``Partial("avg")`` of local means was wrong here, ``nan``
    where a rank held only ignored labels); loss and gradient equal one device's."""
    g = torch.Generator().manual_seed(4)
    mesh = vescale.init_device_mesh("cpu", (2, 2))
    for batch, flat in ((2, (Shard(0), Shard(0))), (4, (Shard(0), InterleavedShard(0, 2)))):
        logits = torch.randn(batch, 8, 16, generator=g, dtype=torch.float64)
        labels = torch.randint(0, 16, (batch, 8), generator=g)
        labels[0, :6], labels[-1, 5:] = -100, -100
        ref_x = logits.clone().requires_grad_(True)
        ref = F.cross_entropy(ref_x.view(-1, 16), labels.view(-1))
        ref.backward()
        dx = vescale.distribute_tensor(logits, mesh, [Shard(0), Shard(1)]).requires_grad_(True)
        dt = vescale.distribute_tensor(labels, mesh, [Shard(0), Shard(1)])
        rows = dx.view(-1, 16)
        assert tuple(rows.placements) == flat, rows.placements
        loss = F.cross_entropy(rows, dt.view(-1))
        loss.backward()
        torch.testing.assert_close(loss.full_tensor(), ref.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dx.grad.full_tensor(), ref_x.grad, rtol=1e-12, atol=1e-12)


def test_cross_entropy_of_flattened_batch_and_sequence_shards(pool4):
    pool4.run(_check_cross_entropy_of_flattened_logits)
