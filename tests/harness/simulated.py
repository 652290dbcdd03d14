"""Single-process simulators: the ``fake`` process group and ``LocalTensorMode``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A default ``fake`` process group of ``world_size`` ranks in this process.

    Collectives return immediately without moving data: for tracing and shape logic at
    sizes no real cluster here can reach (e.g. 512 ranks).
    """
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def local_world(world_size: int) -> Iterator[LocalTensorMode]:
    """Simulate ``world_size`` ranks in one process: each tensor holds every rank's value
    and collectives compute real results, so numerics can be checked like a real run."""
    with fake_world(world_size), LocalTensorMode(world_size) as mode:
        yield mode
