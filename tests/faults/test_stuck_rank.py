"""A stuck rank (``SIGSTOP``) is an error on the ranks waiting for it, naming it and the
collective, within ``VESCALE_TIMEOUT_S`` plus a few seconds; the timeout reaches the groups
vescale creates; the knobs are parsed strictly."""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import vescale
from tests.harness.fresh import run_fresh
from vescale import _watchdog
from vescale._torch_compat import group_timeout
from vescale.ddp import DistributedDataParallel


def _ddp_step_one_rank_stops(stopped: int) -> str:
    mesh = vescale.init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    torch.manual_seed(0)
    net = DistributedDataParallel(nn.Linear(4, 4), dp_mesh=mesh)
    net(torch.randn(2, 4)).sum().backward()  # a first step on every rank
    time.sleep(2 * _watchdog.BEAT_S)  # a beat after it: rank 2's last collective is known
    loss = net(torch.randn(2, 4)).sum()
    if dist.get_rank() == stopped:
        os.kill(os.getpid(), signal.SIGSTOP)
    loss.backward()
    return "no error"


def test_a_stopped_rank_is_named_on_the_others():
    timeout_s = 4
    *waiting, stopped = run_fresh(
        3,
        _ddp_step_one_rank_stops,
        2,
        env={"VESCALE_TIMEOUT_S": str(timeout_s)},
        init_group=False,
        timeout_s=45,
    )
    assert stopped[0] == "lost"
    for rank, (kind, msg, seconds) in enumerate(waiting):
        assert kind == "err", (rank, msg)
        assert msg.startswith(f"StuckRankError: vescale: rank {rank} waited "), msg
        assert (
            " s in vescale.ddp all-reduce of gradient bucket 0 (2 parameters, torch.float32) "
            "over mesh dims [0], which it misses: rank 2 silent for "
        ) in msg, msg
        assert (
            "(stopped, hung or gone), at its last heartbeat in: vescale.ddp all-reduce of "
            "gradient bucket 0 (2 parameters, torch.float32) over mesh dims [0] ("
        ) in msg, msg
        assert seconds < timeout_s + 10, (rank, seconds)


def _timeouts(given: float | None) -> list[float]:
    mesh = vescale.init_device_mesh("cpu", (1, 2), timeout=given)
    groups = [mesh.get_group(0), mesh.get_group(1), dist.group.WORLD]
    dist.barrier()  # rank 0 hosts the store: no rank leaves before the others are done with it
    return [group_timeout(g).total_seconds() for g in groups]


def test_init_device_mesh_timeout_reaches_the_groups_it_creates():
    # the harness's default group (120 s) is the user's: kept; the size-1 dim's groups are new
    assert [out[:2] for out in run_fresh(2, _timeouts, 77.0, timeout_s=60)] == [
        ("ok", [77.0, 120.0, 120.0])
    ] * 2
    # no default group yet: vescale initializes it, with VESCALE_TIMEOUT_S
    env = {"VESCALE_TIMEOUT_S": "33"}
    assert [
        out[:2] for out in run_fresh(2, _timeouts, None, env=env, init_group=False, timeout_s=60)
    ] == [("ok", [33.0, 33.0, 33.0])] * 2


@pytest.mark.parametrize("value", ["-2", "soon", ""])
def test_a_wrong_timeout_is_an_error_naming_it(monkeypatch, value):
    monkeypatch.setenv("VESCALE_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=f"VESCALE_TIMEOUT_S={value!r} is not a positive number"):
        vescale.init_device_mesh("meta", (2,))


@pytest.mark.parametrize("value", [0, -1.0, "600", True])
def test_a_wrong_timeout_argument_is_an_error(value):
    with pytest.raises(ValueError, match=f"init_device_mesh: timeout={value!r} is not a positive"):
        vescale.init_device_mesh("meta", (2,), timeout=value)


def test_a_timedelta_timeout_is_accepted():
    assert vescale.init_device_mesh("meta", (2,), timeout=datetime.timedelta(seconds=5)).ndim == 1


@pytest.mark.parametrize("value", ["maybe", "", "2"])
def test_a_wrong_watchdog_switch_is_an_error_naming_it(monkeypatch, value):
    monkeypatch.setenv("VESCALE_WATCHDOG", value)
    with pytest.raises(ValueError, match=f"VESCALE_WATCHDOG={value!r} is not a boolean"):
        _watchdog.start()


def test_a_rank_that_gave_up_is_named_apart_from_the_silent_one(monkeypatch):
    # rank 0 raised StuckRankError and exited: rank 1 names rank 2 as the one it misses
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    what = "vescale.ddp all-reduce of gradient bucket 0"
    quiet = {0: (9.0, _watchdog._GAVE_UP + what), 2: (13.0, what)}
    assert _watchdog._message(what, quiet, 4.0) == (
        f"vescale: rank 1 waited 4.0 s in {what}, which it misses: rank 2 silent for 13.0 s "
        f"(stopped, hung or gone), at its last heartbeat in: {what}; "
        f"rank 0 raised StuckRankError 9.0 s ago in: {what}"
    )


class _SlowStore:
    """A store whose ``set`` blocks (a peer's host under load), counting the calls."""

    def __init__(self) -> None:
        self.sets = 0

    def set(self, key: str, value: str) -> None:
        self.sets += 1
        time.sleep(0.5)


def test_stop_ends_the_heartbeat_before_the_interpreter_finalizes(monkeypatch):
    # a daemon thread still inside a store call at finalization aborts the process ("terminate
    # called without an active exception"): stop(), registered with atexit, waits for it
    store = _SlowStore()
    monkeypatch.setattr(_watchdog, "active", lambda: True)
    monkeypatch.setattr(_watchdog, "_store", lambda: store)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(_watchdog, "_world", object())  # not the (absent) default group
    _watchdog.start()
    thread = _watchdog._thread
    try:
        assert thread is not None and thread.is_alive()
        deadline = time.monotonic() + 10
        while store.sets == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.sets >= 1
    finally:
        _watchdog.stop()
        monkeypatch.setattr(_watchdog, "_world", None)
    assert not thread.is_alive()
    assert _watchdog._thread is None
