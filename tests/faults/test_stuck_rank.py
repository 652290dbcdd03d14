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
        assert msg.startswith(
            f"StuckRankError: vescale: rank {rank} waited "
        ), msg
        assert (
            " s in vescale.ddp all-reduce of gradient bucket 0 (2 parameters, torch.float32) "
            "over mesh dims [0], which it misses: rank 2 silent for "
        ) in msg, msg
        assert "(stopped, hung or gone), at its last heartbeat in: vescale.ddp all-reduce of gradient "
            "bucket 0 (2 parameters, torch.float32) over mesh dims [0] (" in msg, msg
        assert seconds < timeout_s + 10, (rank, seconds)
