"""The shared worker pool reports a rank that dies (a crash inside gloo or torch kills the
process: no exception to send back) within seconds, naming the rank and the signal, instead
of leaving the others waiting in a collective until the test's timeout; the rebuilt pool
runs the next task."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness.pool import WorkerError


def _rank_1_crashes_in_a_collective() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that is gone


def _world_sum() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t.item())


def test_a_dead_rank_is_reported_at_once(pool2):
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 \(exit code -11: SIGSEGV\) died"):
        pool2.run(_rank_1_crashes_in_a_collective, timeout_s=600)
    assert time.monotonic() - start < 30  # not the 600 s timeout, nor gloo's 60 s one
    assert pool2.run(_world_sum) == [2.0, 2.0]
