"""The non-finite check (``vescale.check_finite``, ``VESCALE_CHECK_FINITE``): a NaN/Inf on one
rank is an error on every rank at the optimizer step, the same text naming the rank and the
first op that made it (eager DDP, eager tensor parallel, compiled), with the parameters left
unchanged; off, nothing is installed and training computes what it computed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import vescale
from tests.harness.misuse import error_everywhere
from vescale import Replicate, Shard
from vescale._torch_compat import global_optimizer_pre_hooks
from vescale.ddp import DistributedDataParallel

HERE = Path(__file__).name


class _Mlp(nn.Module):
    def __init__(self, blow_up: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)
        self.blow_up = blow_up  # rank 1 multiplies by exp(100.0 * 10): Inf from finite values

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.blow_up:
            h = h * torch.exp(x.abs().sum() * 1000.0)
        return F.mse_loss(self.fc2(h), target)


def _batch(rank: int, nan: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5 + rank)
    x, t = torch.randn(3, 4, generator=g), torch.randn(3, 3, generator=g)
    if nan and rank == 1:
        x[2, 1] = float("nan")
    return x, t


def _steps(model: nn.Module, net: nn.Module, batches: list[tuple[torch.Tensor, ...]]) -> None:
    """A clean step, then a step on the second batch: its error re-raised once the parameters
    are checked unchanged."""
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    model(*batches[0]).backward()
    opt.step()
    opt.zero_grad()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    model(*batches[1]).backward()
    try:
        opt.step()
    except vescale.NonFiniteError:
        for n, p in net.named_parameters():
            torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0, msg=n)
        raise


def _ddp(nan: bool, blow_up: bool, compiled: bool) -> None:
    mesh = vescale.init_device_mesh("cpu", (2,))
    rank = mesh.get_coordinate()[0]
    batches = [_batch(rank, False), _batch(rank, nan)]  # from a loader: made outside the check
    torch._dynamo.reset()
    try:
        with vescale.check_finite():
            ddp = DistributedDataParallel(_Mlp(blow_up and rank == 1), dp_mesh=mesh)
            model = torch.compile(ddp, backend="vescale") if compiled else ddp
            _steps(model, ddp.module, batches)
    finally:
        torch._dynamo.reset()


def test_nan_in_one_ranks_batch_is_named_on_every_rank(pool2):
    """Rank 1's batch holds a NaN under eager DDP: both ranks raise the same error at the
    second step naming rank 1's first op on it and rank 0's all_reduce; weights unchanged."""
    err = error_everywhere(pool2, _ddp, True, False, False)
    assert err.kind == "NonFiniteError", err
    assert err.message.startswith(
        "vescale: non-finite values at step 2: first produced by aten.addmm.default (forward, "
        f"{HERE}:"
    ), err.message
    assert "on rank 1, from a non-finite input (batch, parameter)" in err.message, err.message
    assert "; rank 0 received them through all_reduce (backward, " in err.message, err.message
    assert err.message.endswith("SGD.step did not run on any rank (parameters unchanged)")


def test_inf_from_finite_inputs_names_the_op(pool2):
    """An exp of a large finite value on rank 1: produced by aten.exp (not an input's NaN)."""
    err = error_everywhere(pool2, _ddp, False, True, False)
    assert "first produced by aten.exp.default (forward, " in err.message, err.message
    assert f"{HERE}:" in err.message and "on rank 1; rank 0 received" in err.message, err.message


def test_compiled_nan_names_the_fx_node(pool2):
    """Compiled (``backend="vescale"``) with the check on: the FX node and its user line."""
    err = error_everywhere(pool2, _ddp, True, False, True, timeout_s=300.0)
    assert err.kind == "NonFiniteError", err
    text = re.sub(r"graph\d+\.", "graph<N>.", err.message)  # N counts graphs per process
    assert "first produced by aten.addmm.default (graph<N>.forward %addmm, " in text, err
    assert f"{HERE}:" in err.message and "on rank 1, from a non-finite input" in err.message
    assert "rank 0 received them through all_reduce (graph<N>.backward %" in text, err


def _tp(nan: bool) -> None:
    """A column- then row-parallel MLP on vescale DTensors (mesh of 2), rank 1's shard of the
    first weight poisoned: the forward's all_reduce of the Partial output carries it to rank 0."""
    mesh = vescale.init_device_mesh("cpu", (2,))
    rank = mesh.get_coordinate()[0]
    torch.manual_seed(0)
    w1 = vescale.distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]).requires_grad_()
    w2 = vescale.distribute_tensor(torch.randn(3, 8), mesh, [Shard(1)]).requires_grad_()
    x = vescale.distribute_tensor(torch.randn(5, 4), mesh, [Replicate()])
    opt = torch.optim.SGD([w1, w2], lr=0.1)
    if nan and rank == 1:
        with torch.no_grad():
            w1.to_local()[0, 0] = float("nan")
    before = [w.to_local().clone() for w in (w1, w2)]
    with vescale.check_finite():
        h = torch.tanh(torch.mm(x, w1.t()))
        out = torch.mm(h, w2.t()).redistribute(mesh, [Replicate()])
        out.to_local().square().sum().backward()
        try:
            opt.step()
        except vescale.NonFiniteError:
            for w, b in zip((w1, w2), before, strict=True):  # the poisoned NaN stays
                torch.testing.assert_close(w.to_local(), b, rtol=0, atol=0, equal_nan=True)
            raise


def test_tensor_parallel_nan_is_named(pool2):
    err = error_everywhere(pool2, _tp, True)
    assert err.message.startswith(
        f"vescale: non-finite values at step 1: first produced by aten.mm.default (forward, {HERE}:"
    ), err.message
    assert "on rank 1, from a non-finite input (batch, parameter); " in err.message, err.message
    assert "rank 0 received them through all_reduce (forward, " in err.message, err.message


def _weights_off_and_on() -> tuple[bool, list[dict[str, torch.Tensor]]]:
    """The weights after DDP steps with the check off and on (no NaN), and whether anything
    was installed while off."""
    mesh = vescale.init_device_mesh("cpu", (2,))
    rank = mesh.get_coordinate()[0]
    installed = False
    results = []
    for on in (False, True):
        with vescale.check_finite(on):
            installed |= not on and (
                torch._C._len_torch_dispatch_stack() > 0
                or vescale.finite._HOOK in global_optimizer_pre_hooks
            )
            ddp = DistributedDataParallel(_Mlp(), dp_mesh=mesh)
            _steps(ddp, ddp.module, [_batch(rank, False), _batch(rank, False)])
            results.append({n: p.detach().clone() for n, p in ddp.module.named_parameters()})
    return installed, results


def test_off_installs_nothing_and_on_changes_no_result(pool2):
    assert not vescale.finite.enabled() and torch._C._len_torch_dispatch_stack() == 0
    for installed, (off, on) in pool2.run(_weights_off_and_on):
        assert not installed
        assert off.keys() == on.keys()
        for n in off:
            assert torch.equal(off[n], on[n]), n
    assert vescale.finite._HOOK not in global_optimizer_pre_hooks


_ENV_PROGRAM = """
import torch, vescale
lin = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(lin.parameters(), lr=0.1)
x = torch.tensor([[1.0, 1000.0]])
lin(x.exp()).sum().backward()
try:
    opt.step()
except vescale.NonFiniteError as e:
    print(e)
"""


def _python(code: str, value: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VESCALE_CHECK_FINITE": value, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def test_env_var_turns_it_on_and_is_parsed_strictly():
    on = _python(_ENV_PROGRAM, "1")
    assert on.returncode == 0, on.stderr
    assert "first produced by aten.exp.default (forward, <string>:6) on rank 0. SGD.step " in (
        on.stdout
    ), on.stdout
    bad = _python("import vescale", "bad")
    assert bad.returncode != 0
    assert "ValueError: VESCALE_CHECK_FINITE='bad' is not a boolean" in bad.stderr, bad.stderr
