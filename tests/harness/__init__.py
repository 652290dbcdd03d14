"""Test harnesses: a persistent gloo worker pool, the fake process group, LocalTensorMode."""

from tests.harness.pool import WorkerError, WorkerPool
from tests.harness.simulated import fake_world, local_world

__all__ = ["WorkerError", "WorkerPool", "fake_world", "local_world"]
