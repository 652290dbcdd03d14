"""Misuse of ``vescale.parallelize`` (the plan path) and its progress output (issues 26, 27):
a placement given as a string is refused by validation; a failure of the solve on rank 0
(which solves for every rank) reaches every rank as the same ``PlanError`` within seconds;
inputs of other shapes than ``example_inputs`` are refused naming the input and both shapes;
progress lines come from rank 0 only, and ``VESCALE_PROGRESS`` is a strict boolean."""

from __future__ import annotations

import contextlib
import functools
import io
import re
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import vescale
from tests.harness.misuse import error_everywhere
from vescale import _progress
from vescale.plan import PlanError, PlannedModule


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc = nn.Linear(8, 6)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(6, 8, generator=g))
            self.fc.bias.copy_(torch.randn(6, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).sum()


@functools.cache
def _tp_mesh() -> vescale.DeviceMesh:
    return vescale.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))


def _parallelize(plan: dict, **kwargs) -> PlannedModule:
    mesh = kwargs.pop("mesh", None) or _tp_mesh()
    return vescale.parallelize(
        Tiny(),
        mesh,
        plan,
        inputs=[{"tp": vescale.Replicate()}],
        example_inputs=[torch.randn(4, 8)],
        **{"compile": False, **kwargs},
    )


# string placements ---------------------------------------------------------------------------


def _string_placement() -> None:
    _parallelize({"fc.weight": {"tp": "Shard(0)"}})


def test_string_placement_is_the_same_plan_error_on_every_rank(pool2):
    err = error_everywhere(pool2, _string_placement)
    assert err.kind == "PlanError", err
    for piece in ["plan['fc.weight']['tp']", "'Shard(0)'", "(str)", "Shard(dim)", "Replicate()"]:
        assert piece in err.message, (piece, err.message)


@pytest.mark.parametrize(
    ("value", "pieces"),
    [
        ("Shard(0)", ["plan['fc.weight']", "'Shard(0)' (str) is not placements", "mesh(tp=2)"]),
        (("Shard(0)",), ["plan['fc.weight'][0]", "'Shard(0)' (str) is not a placement"]),
        ({"tp": 0}, ["plan['fc.weight']['tp']", "0 (int) is not a placement", "Shard(dim)"]),
    ],
)
def test_non_placement_values_are_refused_naming_key_value_and_types(value, pieces):
    mesh = vescale.DeviceMesh("meta", torch.arange(2), mesh_dim_names=("tp",))
    with pytest.raises(PlanError) as err:
        _parallelize({"fc.weight": value}, mesh=mesh)
    for piece in pieces:
        assert piece in str(err.value), (piece, str(err.value))


# a failure of the solve on rank 0 -------------------------------------------------------------


def _scipy_missing_on_rank0() -> None:
    """The solver's ``import scipy.optimize`` fails on rank 0 only (a broken scipy install)."""
    saved = sys.modules.get("scipy.optimize")
    if dist.get_rank() == 0:
        sys.modules["scipy.optimize"] = None  # type: ignore[assignment]  # import raises
    try:
        _parallelize({"fc.weight": {"tp": vescale.Shard(0)}})
    finally:
        if saved is None:
            sys.modules.pop("scipy.optimize", None)
        else:
            sys.modules["scipy.optimize"] = saved


def test_solver_failure_on_rank0_is_the_same_error_on_every_rank_within_seconds(pool2):
    err = error_everywhere(pool2, _scipy_missing_on_rank0, within_s=20)
    assert err.kind == "PlanError", err
    for piece in ["the solve", "failed on rank 0", "ModuleNotFoundError", "scipy.optimize"]:
        assert piece in err.message, (piece, err.message)


# inputs unlike example_inputs -----------------------------------------------------------------


def _wrong_batch(rank_given: int | None) -> None:
    """Every rank (``None``) or only ``rank_given`` calls the model on a batch of 5, planned
    for 4; the first call compares the ranks' inputs."""
    model = _parallelize({"fc.weight": {"tp": vescale.Shard(0)}})
    rows = 5 if rank_given in (None, dist.get_rank()) else 4
    model(torch.randn(rows, 8))


def _wrong_batch_later() -> None:
    """A right first call, then every rank gives a batch of 5: each rank's own check."""
    model = _parallelize({"fc.weight": {"tp": vescale.Shard(0)}})
    x = torch.randn(4, 8)
    ref = Tiny()(x)
    out = model(x)
    torch.testing.assert_close(out.full_tensor(), ref)
    model(torch.randn(5, 8))


PLANNED = "example_inputs[0] of shape (4, 8) torch.float32"


def test_wrong_batch_on_every_rank_names_input_and_shapes(pool2):
    err = error_everywhere(pool2, _wrong_batch, None)
    assert err.kind == "PlanError", err
    assert "input 0 (x) on rank 0 has shape (5, 8) torch.float32" in err.message, err.message
    assert PLANNED in err.message, err.message


def test_wrong_batch_on_one_rank_is_the_same_error_on_every_rank(pool2):
    err = error_everywhere(pool2, _wrong_batch, 1)
    assert "input 0 (x) on rank 1 has shape (5, 8) torch.float32" in err.message, err.message
    assert PLANNED in err.message, err.message


def test_wrong_batch_after_the_first_call_is_refused(pool2):
    err = error_everywhere(pool2, _wrong_batch_later)
    assert err.kind == "PlanError", err
    assert "input 0 (x) has shape (5, 8) torch.float32" in err.message, err.message
    assert PLANNED in err.message, err.message


def test_wrong_dtype_is_refused():
    mesh = vescale.DeviceMesh("meta", torch.arange(2), mesh_dim_names=("tp",))
    model = _parallelize({}, mesh=mesh, cost="h100")  # a meta mesh is priced by name
    with pytest.raises(PlanError, match=r"input 0 \(x\) has shape \(4, 8\) torch.float64"):
        model(torch.randn(4, 8, dtype=torch.float64))


# progress --------------------------------------------------------------------------------------


def _stderr_of_parallelize(progress: bool | None) -> str:
    """What ``parallelize`` and the compiled step's first call write to stderr here."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        model = _parallelize(
            {"fc.weight": {"tp": vescale.Shard(0)}},
            compile=True,
            options={"codegen": "fx"},
            progress=progress,
        )
        model(torch.randn(4, 8))
    return err.getvalue()


STAGE = r"vescale: {} \.\.\. \d+\.\d s{}\n"


def test_progress_lines_on_rank0_only(pool2):
    rank0, rank1 = pool2.run(_stderr_of_parallelize, None, timeout_s=300)
    assert rank1 == "", rank1
    lines = [
        STAGE.format("capture", r" \(\d+ nodes\)"),
        STAGE.format("propagate", r" \(\d+ nodes\)"),
        STAGE.format("solve", r" \(optimal \(the LP relaxation is integral\), gap \d+\.\d\d%\)"),
        STAGE.format("materialize", r" \(2 parameters and buffers\)"),
        STAGE.format(r"compile graph\d+\.forward", ""),
    ]
    assert re.fullmatch("".join(lines), rank0), rank0


def test_progress_off_by_env_or_option(pool2):
    off = pool2.run(_stderr_of_parallelize, None, env={"VESCALE_PROGRESS": "0"}, timeout_s=300)
    assert off == ["", ""], off
    assert pool2.run(_stderr_of_parallelize, False, timeout_s=300) == ["", ""]


def test_bad_progress_value_raises_on_every_rank(pool2):
    err = error_everywhere(pool2, _stderr_of_parallelize, None, env={"VESCALE_PROGRESS": "maybe"})
    assert err.kind == "ValueError", err
    assert "VESCALE_PROGRESS='maybe' is not a boolean" in err.message, err.message


def test_nested_stage_ends_on_a_line_of_its_own(monkeypatch):
    monkeypatch.delenv(_progress.ENV, raising=False)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), _progress.stage("outer") as outer:
        with _progress.stage("inner"):
            pass
        outer.detail = "3 parts"
    assert re.fullmatch(
        r"vescale: outer \.\.\.\nvescale: inner \.\.\. \d+\.\d s\n"
        r"vescale: outer: \d+\.\d s \(3 parts\)\n",
        err.getvalue(),
    ), err.getvalue()
