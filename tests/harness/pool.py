"""A persistent pool of gloo worker processes shared by every test of a pytest session.

``pool.run(fn, *args)`` runs the module-level function ``fn`` on every rank at once and
returns the per-rank results; any rank's exception (with its traceback) fails the test.
After a failure or a timeout the pool is rebuilt so one bad test cannot poison the next.

Workers are forked from one forkserver that imported torch and vescale once (no fresh
interpreter importing them per rank, per pool, per rebuild); nothing else runs in that
server, so each worker starts from a freshly imported state.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

COLLECTIVE_TIMEOUT_S = 60


_POLL_S = 1.0  # how often a waiting run checks that every rank is still alive


def _signal(exitcode: int | None) -> str:
    if exitcode is None or exitcode >= 0:
        return ""
    try:
        return f": {signal.Signals(-exitcode).name}"
    except ValueError:
        return ""


class WorkerError(AssertionError):
    """One or more ranks failed; the message holds each failing rank's traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _resolve(module: str, qualname: str) -> Callable[..., Any]:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


PRELOAD = ["torch", "torch.distributed", "vescale"]
"""Imported once by the forkserver every worker is forked from. Its environment is the pytest
process's when the first pool starts: tests/conftest.py sets ``OMP_NUM_THREADS=1`` and
``TORCHINDUCTOR_COMPILE_THREADS=1`` (Inductor compiles in the rank's process, no pool of
compile subprocesses per rank) before anything imports torch."""


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker_main(
    rank: int, world_size: int, port: int, tasks: Any, results: Any, path: list[str]
) -> None:
    sys.path[:] = path
    import torch
    import torch.distributed as dist

    import vescale  # noqa: F401  (installs the DTensor hooks before any DTensor op)

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    results.put((None, rank, "ready", None))
    while True:  # until the pool kills this process
        task_id, module, qualname, args, env = tasks.get()
        with scoped_environ(env):
            try:
                torch.manual_seed(0)
                out = _resolve(module, qualname)(*args)
                results.put((task_id, rank, "ok", out))
            except BaseException:
                results.put((task_id, rank, "err", traceback.format_exc()))


@contextlib.contextmanager
def scoped_environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``values`` set (``None``: unset) for the block, restored after."""
    saved = {k: os.environ.get(k) for k in values}

    def put(items: Mapping[str, str | None]) -> None:
        for k, v in items.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    put(values)
    try:
        yield
    finally:
        put(saved)


class WorkerPool:
    """``world_size`` gloo ranks kept alive across tests."""

    def __init__(self, world_size: int, start_timeout_s: float = 180) -> None:
        self.world_size = world_size
        self.start_timeout_s = start_timeout_s
        self._task_id = 0
        self._start()

    def _start(self) -> None:
        ctx = _context()
        port = _free_port()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(r, self.world_size, port, self._tasks[r], self._results, list(sys.path)),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        ready = 0
        while ready < self.world_size:
            try:
                _, _, status, _ = self._results.get(timeout=self.start_timeout_s)
            except queue.Empty:
                self._kill()
                raise RuntimeError(f"worker pool of {self.world_size} did not start") from None
            ready += status == "ready"

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float = 2 * COLLECTIVE_TIMEOUT_S,
        env: dict[str, str] | None = None,
    ) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return the results indexed by rank."""
        return self.submit(fn, *args, timeout_s=timeout_s, env=env)()

    def submit(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float = 2 * COLLECTIVE_TIMEOUT_S,
        env: dict[str, str] | None = None,
    ) -> Callable[[], list[Any]]:
        """Start ``fn(*args)`` on every rank and return at once; calling the returned function
        waits for the results as :meth:`run` does (so two pools can work at the same time)."""
        self._task_id += 1
        tid = self._task_id
        for q in self._tasks:
            q.put((tid, fn.__module__, fn.__qualname__, args, dict(env or {})))
        return functools.partial(self._collect, tid, fn.__qualname__, timeout_s)

    def _collect(self, tid: int, name: str, timeout_s: float) -> list[Any]:
        """The ranks' results of task ``tid``; a :class:`WorkerError` when a rank raised, did
        not finish in ``timeout_s``, or died (a crash inside gloo or torch: reported within
        a second with its signal, not after the timeout; the others wait on it forever)."""
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(out) + len(errors) < self.world_size:
            try:
                task_id, rank, status, value = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                dead = self._dead()
                if dead or time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
                    self._restart()
                    why = f"rank {dead} died" if dead else f"did not finish in {timeout_s}s"
                    raise WorkerError(
                        f"{name}: ranks {missing} did not finish: {why}"
                        + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                    ) from None
                continue
            if task_id != tid:
                continue  # a late answer from a task that failed or timed out before
            (out if status == "ok" else errors)[rank] = value
        if errors:
            self._restart()
            raise WorkerError(
                f"{name} failed on ranks {sorted(errors)}"
                + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            )
        return [out[r] for r in range(self.world_size)]

    def _dead(self) -> str:
        """The ranks whose process has exited, with how (``""``: none)."""
        return ", ".join(
            f"{r} (exit code {p.exitcode}{_signal(p.exitcode)})"
            for r, p in enumerate(self._procs)
            if not p.is_alive()
        )

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)

    def _restart(self) -> None:
        self._kill()
        self._start()

    def close(self) -> None:
        """End the workers at once (nothing of theirs outlives the session: no orderly
        process-group teardown and interpreter exit to wait for)."""
        self._kill()
