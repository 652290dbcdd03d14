"""vescale's collective timeout and the heartbeat that names a stuck rank.

- :func:`timeout`: ``VESCALE_TIMEOUT_S`` (seconds, default 600), the one timeout of the process
  groups vescale creates (its mesh dim and flattened groups, the default group when vescale's
  ``init_device_mesh`` initializes it, the checks' side group); groups a user created keep
  their own.
- A heartbeat: with the first vescale mesh on a real multi-rank default group (unless
  ``VESCALE_WATCHDOG=0``) a daemon thread writes ``<time> <collective>`` under this rank's key
  in the default group's store every :data:`BEAT_S` seconds; ``<collective>`` is the vescale
  collective this rank is in or last left, set by :class:`collective` (a module-global string:
  no store write on the hot path). A stopped rank (``SIGSTOP`` stops every thread) or a dead
  one stops beating.
- :class:`collective` (``with collective("ddp all-reduce of bucket 0 over ..."):``) around a
  vescale collective site: a timeout or a lost peer there raises :class:`StuckRankError`
  naming every rank silent for over :data:`STALE_S` seconds, how long, and the collective it
  was last in. While this rank waits in one collective for longer than :func:`timeout` and a
  peer is silent, the thread prints that diagnosis to stderr once (under NCCL the process may
  then be ended by NCCL's own watchdog with no Python error).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import sys
import threading
import time
from types import TracebackType
from typing import Any

import torch.distributed as dist

from vescale._env import env_flag, env_seconds
from vescale._torch_compat import default_store

__all__ = [
    "ENV",
    "WATCHDOG_ENV",
    "StuckRankError",
    "active",
    "collective",
    "diagnosis",
    "enabled",
    "start",
    "stop",
    "timeout",
]

ENV = "VESCALE_TIMEOUT_S"
WATCHDOG_ENV = "VESCALE_WATCHDOG"
DEFAULT_S = 600.0
BEAT_S = 1.0
STALE_S = 3.0
"""A rank whose heartbeat is older than this is named as silent (three missed beats)."""
_KEY = "vescale/heartbeat/rank{}"
_GAVE_UP = "StuckRankError in: "
"""The heartbeat of a rank that raised :class:`StuckRankError` (it may then exit: its peers
name it as having given up, not as stuck)."""
_PEER_LOSS = ("imed out", "closed by peer", "Connection reset", "Broken pipe")

_activity = "no vescale collective yet"
_depth = 0  # nesting of ``collective`` blocks on the main thread
_entered = 0.0  # time.monotonic() when the outermost block began
_world: Any = None  # the default group the running heartbeat belongs to
_thread: threading.Thread | None = None
_stop = threading.Event()
_seen: tuple[float, dict[int, tuple[float, str]]] | None = None  # peers as last read, when


class StuckRankError(RuntimeError):
    """A collective failed (timed out, lost a peer) and the heartbeats name who is stuck."""


def timeout() -> datetime.timedelta:
    """``VESCALE_TIMEOUT_S`` (a positive number of seconds; default 600)."""
    return datetime.timedelta(seconds=env_seconds(ENV, DEFAULT_S))


def enabled() -> bool:
    """``VESCALE_WATCHDOG`` (strict boolean, default on)."""
    return env_flag(WATCHDOG_ENV, True)


def active() -> bool:
    """Whether ranks communicate: a real default group of more than one rank."""
    return dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"


class collective:
    """Marks this rank as in the collective ``what`` for the heartbeat; a peer-loss or timeout
    ``RuntimeError`` inside becomes a :class:`StuckRankError` naming the silent ranks (unless
    ``explain=False``: the caller explains it itself)."""

    __slots__ = ("explain", "what")

    def __init__(self, what: str, *, explain: bool = True) -> None:
        self.what = what
        self.explain = explain

    def __enter__(self) -> None:
        global _activity, _depth, _entered
        if _depth == 0:
            _entered = time.monotonic()
            _activity = self.what
        _depth += 1

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        global _depth
        _depth -= 1
        if not self.explain or not isinstance(err, RuntimeError) or isinstance(err, StuckRankError):
            return
        text = str(err)
        if _world is None or not any(s in text for s in _PEER_LOSS):
            return
        first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
        message = diagnosis(self.what, wait=True)
        _gave_up(self.what)
        raise StuckRankError(f"{message} ({first})") from err


def start() -> None:
    """Start this process's heartbeat for the current default group (once per group; nothing
    without a real multi-rank group or with ``VESCALE_WATCHDOG=0``)."""
    global _world, _thread
    on = enabled()  # parsed first: a wrong value is an error even on one rank
    if not on or not active() or _world is dist.group.WORLD:
        return
    stop()
    _stop.clear()
    _world = dist.group.WORLD
    _thread = threading.Thread(
        target=_run,
        args=(_world, dist.get_rank(), dist.get_world_size()),
        name="vescale-heartbeat",
        daemon=True,
    )
    _thread.start()


@atexit.register
def stop() -> None:
    """End the heartbeat and wait for it (at exit too: a daemon thread still inside a store call
    when the interpreter finalizes is killed there, and the process aborts with ``terminate
    called without an active exception``)."""
    global _thread
    _stop.set()
    if _thread is not None:
        _thread.join(timeout=2 * STALE_S + BEAT_S)  # a store call waits at most 2 * STALE_S
    _thread = None


def _store() -> Any:
    """A client of the default group's TCP store with a short timeout of its own (a stopped
    store host must not block the heartbeat for the group's timeout), else the default store."""
    store = default_store()
    inner = store
    while hasattr(inner, "underlying_store"):
        inner = inner.underlying_store
    if not isinstance(inner, dist.TCPStore):
        return store
    return dist.TCPStore(
        inner.host,
        inner.port,
        is_master=False,
        timeout=datetime.timedelta(seconds=2 * STALE_S),
        wait_for_workers=False,
    )


def _beat(store: Any, rank: int) -> None:
    store.set(_KEY.format(rank), f"{time.time():.3f} {_activity}")


def _gave_up(what: str) -> None:
    """Beat once now with :data:`_GAVE_UP` (best effort: the store may be gone)."""
    global _activity
    _activity = f"{_GAVE_UP}{what}"
    with contextlib.suppress(Exception):
        _beat(_store(), dist.get_rank())


def _run(world: Any, rank: int, size: int) -> None:
    global _seen
    reported = -1.0
    store = None
    while _world is world and not _stop.is_set():
        try:
            store = _store() if store is None else store
            _beat(store, rank)
            waited = time.monotonic() - _entered
            if _depth and waited > STALE_S:  # blocked: read the peers (kept should the store go)
                _seen = (time.time(), _peers(store, rank, size))
                silent = {r: v for r, v in _seen[1].items() if v[0] > STALE_S}
                if silent and waited > timeout().total_seconds() and reported != _entered:
                    reported = _entered
                    print(_message(_activity, silent, waited), file=sys.stderr, flush=True)
        except Exception:  # the store is gone (the group was destroyed) or slow: beat again
            pass
        _stop.wait(BEAT_S)


def _peers(store: Any, rank: int, size: int) -> dict[int, tuple[float, str]]:
    """Each other rank's last heartbeat: (seconds since, its collective)."""
    now = time.time()
    out = {}
    for r in range(size):
        if r == rank:
            continue
        key = _KEY.format(r)
        if not store.check([key]):
            out[r] = (float("inf"), "no heartbeat yet")
            continue
        stamp, _, what = store.get(key).decode().partition(" ")
        out[r] = (now - float(stamp), what)
    return out


def _silent(store: Any, rank: int, size: int) -> dict[int, tuple[float, str]]:
    return {r: v for r, v in _peers(store, rank, size).items() if v[0] > STALE_S}


def _message(what: str, quiet: dict[int, tuple[float, str]], waited: float) -> str:
    """The diagnosis: ranks that gave up (raised :class:`StuckRankError`) are named apart from
    the silent ones, whom they waited for too."""
    head = f"vescale: rank {dist.get_rank()} waited {waited:.1f} s in {what}"
    silent = {r: v for r, v in quiet.items() if not v[1].startswith(_GAVE_UP)}
    gave_up = "".join(
        f"; rank {r} raised StuckRankError {age:.1f} s ago in: {last[len(_GAVE_UP) :]}"
        for r, (age, last) in sorted(quiet.items())
        if r not in silent
    )
    if not silent:
        return (
            f"{head}; every rank's heartbeat is fresh: a rank is alive but elsewhere, or the "
            f"collective is slower than {ENV}={timeout().total_seconds():g}{gave_up}"
        )
    shown = "; ".join(
        f"rank {r} silent for {'ever' if age == float('inf') else f'{age:.1f} s'} "
        f"(stopped, hung or gone), at its last heartbeat in: {last}"
        for r, (age, last) in sorted(silent.items())
    )
    return f"{head}, which {'they miss' if len(silent) > 1 else 'it misses'}: {shown}{gave_up}"


def diagnosis(what: str, *, wait: bool = False) -> str:
    """Which ranks are silent while this rank is in ``what``. ``wait``: up to ``STALE_S`` + 1 s
    for a peer to go stale (a failure seen just before the heartbeats show it)."""
    waited = time.monotonic() - _entered
    if _world is None:
        return f"vescale: {what} failed (no heartbeat: {WATCHDOG_ENV}=0 or not started)"
    rank, size = dist.get_rank(), dist.get_world_size()
    deadline = time.monotonic() + (STALE_S + BEAT_S if wait else 0.0)
    try:
        store = _store()
        silent = _silent(store, rank, size)
        while not silent and time.monotonic() < deadline:
            time.sleep(BEAT_S / 2)
            silent = _silent(store, rank, size)
    except Exception as err:  # the store's host is stopped or gone: the peers as last read
        if _seen is None:
            return (
                f"vescale: {what} failed and the store of the default group did not answer "
                f"({type(err).__name__}): its host (rank 0, or torchrun's agent) is stopped "
                f"or gone"
            )
        late = time.time() - _seen[0]
        peers = {r: (age + late, last) for r, (age, last) in _seen[1].items()}
        silent = {r: v for r, v in peers.items() if v[0] > STALE_S}
    return _message(what, silent, waited)
