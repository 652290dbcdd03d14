"""Fresh ranks for one test: cases that leave a process group unusable (a timeout, a stopped
rank) run here instead of in the long-lived pool.

``run_fresh(world_size, fn, *args, env=..., timeout_s=...)`` starts ``world_size`` new
processes (forkserver, the pool's preload), each joins a new gloo group and runs the
module-level ``fn(*args)`` (``init_group=False``: no group is joined; ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` are set, as torchrun sets them); it returns each rank's outcome in rank order, ``("ok", value)`` or
``("err", "ExcClass: message")``, plus the seconds the rank took, and ``("lost", "")`` for a
rank that reported nothing before ``timeout_s`` (killed then). Every process is gone when it
returns.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from tests.harness.pool import _context, _free_port, _resolve, scoped_environ

Outcome = tuple[str, Any, float]


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    target: tuple[str, str],
    args: tuple[Any, ...],
    env: dict[str, str],
    results: Any,
    path: list[str],
    init_group: bool,
) -> None:
    sys.path[:] = path
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    import torch
    import torch.distributed as dist

    import vescale  # noqa: F401

    torch.set_num_threads(1)
    if init_group:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
        )
    start = time.perf_counter()
    try:
        out: tuple[str, Any] = ("ok", _resolve(*target)(*args))
    except Exception as e:  # the subject of the test
        out = ("err", f"{type(e).__name__}: {e}")
    results.put((rank, *out, time.perf_counter() - start))
    results.close()
    results.join_thread()
    os._exit(0)  # no teardown: a peer may be stopped or gone


def run_fresh(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
    init_group: bool = True,
) -> list[Outcome]:
    """Each rank's outcome of ``fn(*args)`` in fresh processes (see the module doc)."""
    ctx = _context()
    results = ctx.Queue()
    port = _free_port()
    target = (fn.__module__, fn.__qualname__)
    with scoped_environ({"OMP_NUM_THREADS": "1"}):
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    r,
                    world_size,
                    port,
                    target,
                    args,
                    env or {},
                    results,
                    list(sys.path),
                    init_group,
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
    outcomes: dict[int, Outcome] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world_size and time.monotonic() < deadline:
            try:
                rank, kind, value, seconds = results.get(timeout=1)
            except Exception:  # queue.Empty: poll again until the deadline
                continue
            outcomes[rank] = (kind, value, seconds)
    finally:
        for p in procs:
            p.kill()
            p.join()
    return [outcomes.get(r, ("lost", "", timeout_s)) for r in range(world_size)]
