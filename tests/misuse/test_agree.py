"""vescale._agree: checks beside the training group, and a timeout that names the missing rank."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from tests.harness.fresh import run_fresh
from vescale import _agree


def _equal_and_gather(values: list[int]) -> tuple[bool, list[int]]:
    mine = values[dist.get_rank()]
    return _agree.all_equal("test check", mine), _agree.gather("test gather", mine)


def test_all_equal_and_gather(pool2):
    assert pool2.run(_equal_and_gather, [5, 5]) == [(True, [5, 5])] * 2
    assert pool2.run(_equal_and_gather, [5, -5]) == [(False, [5, -5])] * 2
    assert pool2.run(_equal_and_gather, [0, 7]) == [(False, [0, 7])] * 2


def _rank1_elsewhere(then_exit: bool) -> bool:
    assert _agree.all_equal("first check", 1)
    if dist.get_rank() == 1:  # skips the second check: rank 0 must not hang in it
        if not then_exit:
            time.sleep(6)  # alive, elsewhere
        return True
    return _agree.all_equal("check of graph3.forward", 1)


@pytest.mark.parametrize(
    ("then_exit", "why"),
    [
        (False, "within 3 s (VESCALE_TIMEOUT_S)"),
        (True, "(a peer closed its connection: it exited or crashed)"),
    ],
)
def test_a_missing_rank_is_an_error_naming_it(then_exit, why):
    (kind, msg, seconds), rank1 = run_fresh(
        2, _rank1_elsewhere, then_exit, env={"VESCALE_TIMEOUT_S": "3"}, timeout_s=90
    )
    assert rank1[:2] == ("ok", True)
    assert (kind, msg) == (
        "err",
        "AgreementError: vescale: check of graph3.forward: not every rank reached this check "
        f"{why}: rank 1: last at first check",
    )
    assert seconds < 30


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", ""])
def test_timeout_is_parsed_strictly(monkeypatch, value):
    monkeypatch.setenv("VESCALE_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=f"VESCALE_TIMEOUT_S={value!r} is not a positive number"):
        _agree.timeout()


def test_checks_pass_without_a_group():
    assert _agree.all_equal("alone", 3) and _agree.gather("alone", 3) == [3]
