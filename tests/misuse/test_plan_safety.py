"""The plan path's step (``vescale.parallelize``) on every device: ``loss.backward()``
hands the step's gradients over unscaled and without a host sync (issue 38 item 5)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

import vescale
from tests.harness.host_sync import count_host_syncs
from tests.harness.misuse import error_everywhere


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc = nn.Linear(8, 6)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(6, 8, generator=g))
            self.fc.bias.copy_(torch.randn(6, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).square().mean()


@functools.cache
def _tp_mesh() -> vescale.DeviceMesh:
    return vescale.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))


def _batch() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (p.grad.full_tensor() if isinstance(p.grad, vescale.DTensor) else p.grad).clone()
        for k, p in model.module.named_parameters()
    }


def _step_without_host_sync(plan: dict) -> None:
    """Steps after the first: no host read in forward or backward; the implicit 1 leaves the
    gradients as one device computes them; an explicit gradient scales them (also retained)."""
    x = _batch()
    ref = Tiny().double()
    ref(x.double()).backward()
    want = {k: p.grad.float() for k, p in ref.named_parameters()}
    model = vescale.parallelize(
        Tiny(), _tp_mesh(), plan, inputs=[{"tp": vescale.Replicate()}], example_inputs=[x],
        compile=False, progress=False,
    )  # fmt: skip
    model(x).backward()  # the first step: its checks across ranks read to the host
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with count_host_syncs() as syncs:
            model(x).backward()
        assert syncs.calls == [], syncs.calls
        for k, g in _grads(model).items():
            torch.testing.assert_close(g, want[k], rtol=1e-5, atol=1e-6, msg=k)
    model.zero_grad(set_to_none=True)
    loss = model(x)
    three = torch.tensor(3.0)
    if isinstance(loss, vescale.DTensor):
        three = vescale.DTensor.from_local(three, loss.device_mesh, loss.placements)
    loss.backward(three, retain_graph=True)
    loss.backward(three)
    for k, g in _grads(model).items():
        torch.testing.assert_close(g, 6 * want[k], rtol=1e-5, atol=1e-5, msg=k)


def test_step_reads_nothing_to_the_host_sharded_plan(pool2):
    pool2.run(_step_without_host_sync, {"fc.weight": {"tp": vescale.Shard(0)}})


def test_step_reads_nothing_to_the_host_plain_parameters(pool2):
    pool2.run(_step_without_host_sync, {})


# the ranks agree at the first step (issue 40 item 3) ----------------------------------------


def _parallelized(plan: dict, model: nn.Module | None = None) -> nn.Module:
    return vescale.parallelize(
        model or Tiny(), _tp_mesh(), plan, inputs=[{"tp": vescale.Replicate()}],
        example_inputs=[_batch()], compile=False, progress=False,
    )  # fmt: skip


def _seed_differs_on_rank_1(plan: dict) -> None:
    """Rank 1 built its model from another seed: its replicated bias (and, under the empty
    plan, every parameter) differs."""
    model = Tiny()
    if dist.get_rank() == 1:
        with torch.no_grad():
            model.fc.bias.add_(1e-3)
    _parallelized(plan, model)(_batch())


def _batch_differs_on_rank_1() -> None:
    x = _batch()
    if dist.get_rank() == 1:
        x = x.flip(0)  # the same rows, in another order
    _parallelized({"fc.weight": {"tp": vescale.Shard(0)}})(x)


def test_replicated_parameter_differing_across_ranks_names_it_on_every_rank(pool2):
    plan = {"fc.weight": {"tp": vescale.Shard(0)}, "fc.bias": {"tp": vescale.Replicate()}}
    err = error_everywhere(pool2, _seed_differs_on_rank_1, plan)
    assert err.kind == "PlanError", err
    assert "parameter 'fc.bias' differs across ranks (ranks [0] vs [1]" in err.message, err
    assert "torch.manual_seed" in err.message and "VESCALE_CHECK_RANKS=0" in err.message, err


def test_plain_parameters_differing_across_ranks_are_refused(pool2):
    err = error_everywhere(pool2, _seed_differs_on_rank_1, {})
    assert "parameter 'fc.bias' differs across ranks" in err.message, err


def test_batch_differing_across_ranks_names_the_input_on_every_rank(pool2):
    err = error_everywhere(pool2, _batch_differs_on_rank_1)
    assert err.kind == "PlanError", err
    assert "input 0 (x) differs across ranks (ranks [0] vs [1]" in err.message, err
    assert "same whole batch" in err.message, err


def test_the_check_can_be_skipped_and_is_parsed_strictly(pool2):
    pool2.run(_batch_differs_on_rank_1, env={"VESCALE_CHECK_RANKS": "0"})
    err = error_everywhere(pool2, _batch_differs_on_rank_1, env={"VESCALE_CHECK_RANKS": "maybe"})
    assert err.kind == "ValueError" and "VESCALE_CHECK_RANKS='maybe'" in err.message, err


# an optimizer built before parallelize (issue 40 item 3) --------------------------------------


def _optimizer_built_before(plan: dict) -> list[float]:
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    planned = _parallelized(plan, model)
    planned(_batch()).backward()
    opt.step()
    return [float(p.detach().sum()) for p in model.parameters()]


def test_optimizer_over_replaced_parameters_is_refused_at_its_step(pool2):
    err = error_everywhere(pool2, _optimizer_built_before, {"fc.weight": {"tp": vescale.Shard(0)}})
    assert err.kind == "StaleOptimizerError", err
    assert "SGD.step" in err.message and "'fc.weight'" in err.message, err
    assert "build the optimizer after vescale.parallelize" in err.message, err


def test_optimizer_over_kept_parameters_trains(pool2):
    """The empty plan keeps the plain parameter objects: the optimizer built before steps them."""
    ref = Tiny()
    before = [float(p.detach().sum()) for p in ref.parameters()]
    for after in pool2.run(_optimizer_built_before, {}):
        assert all(abs(a - b) > 1e-6 for a, b in zip(after, before)), (after, before)
