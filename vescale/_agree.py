"""Agreement across ranks beside the training collectives, with a timeout that names who is
missing.

vescale's checks (the backend's rank check, the plan path's first-step digests, the
non-finite check) run in their own gloo group over the world (:func:`side_group`, made at the
first check), never in the training process group, with :func:`timeout` (``VESCALE_TIMEOUT_S``
seconds, default 600). Before each check a rank writes ``<n> <what>`` (its n-th check) under
its key in the default store; a check that times out (or loses a peer) raises :class:`AgreementError` naming
the ranks that did not reach it and the last check each of them reached, so a rank that is
elsewhere (another graph, a hang, a crash) is an error here, not a hang.

- :func:`all_equal` (``value`` the same on every rank?): one all-reduce of two int64s,
  O(1) bytes per rank whatever the world size, a host value (the checks' payloads are host
  facts: shapes, names, digests already read).
- :func:`gather` (every rank's object): for the error message once a check failed.

Without a real multi-rank default group (one process, the ``fake`` backend) every check
passes at once.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from vescale._torch_compat import default_store
from vescale._watchdog import ENV, active, collective, timeout

__all__ = ["ENV", "AgreementError", "active", "all_equal", "gather", "side_group", "timeout"]

_KEY = "vescale/agree/rank{}"
_groups: dict[int, dist.ProcessGroup] = {}
_count = itertools.count()


class AgreementError(RuntimeError):
    """Some ranks did not reach a check: not within :func:`timeout`, or a peer is gone."""


def side_group() -> dist.ProcessGroup:
    """The gloo group over the world that vescale's checks use (one per default group),
    with :func:`timeout`."""
    world = dist.group.WORLD
    key = id(world)
    if key not in _groups:
        group = dist.new_group(backend="gloo", timeout=timeout())
        assert group is not None
        _groups[key] = group
    return _groups[key]


def _arrive(what: str) -> int:
    n = next(_count)
    default_store().set(_KEY.format(dist.get_rank()), f"{n} {what}")
    return n


def _missing(n: int) -> str:
    """Which ranks had not reached this rank's ``n``-th check, and where each last was."""
    store = default_store()
    lines = []
    for rank in range(dist.get_world_size()):
        key = _KEY.format(rank)
        if not store.check([key]):
            lines.append(f"rank {rank}: no check reached yet")
            continue
        seen, _, last = store.get(key).decode().partition(" ")
        if int(seen) < n:
            lines.append(f"rank {rank}: last at {last}")
    return "; ".join(lines) or "every rank reached it (a rank is slower than the timeout)"


def _run(what: str, n: int, fn: Any) -> Any:
    try:
        with collective(f"check {what!r}", explain=False):
            return fn()
    except RuntimeError as err:
        text = str(err)
        if "imed out" in text:
            why = f"within {timeout().total_seconds():g} s ({ENV})"
        elif "closed by peer" in text or "Connection reset" in text:
            why = "(a peer closed its connection: it exited or crashed)"
        else:
            raise
        raise AgreementError(
            f"vescale: {what}: not every rank reached this check {why}: {_missing(n)}"
        ) from None


def all_equal(what: str, value: int) -> bool:
    """Whether ``value`` (an int, ``|value| < 2**63``) is the same on every rank; ``what`` names the
    check in a timeout's message."""
    if not active():
        return True
    n = _arrive(what)
    pair = torch.tensor([value, -value], dtype=torch.int64)
    _run(what, n, lambda: dist.all_reduce(pair, dist.ReduceOp.MAX, group=side_group()))
    return int(pair[0]) == value and int(pair[1]) == -value


def gather(what: str, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order."""
    if not active():
        return [obj]
    n = _arrive(what)
    everyone: list[Any] = [None] * dist.get_world_size()
    _run(what, n, lambda: dist.all_gather_object(everyone, obj, group=side_group()))
    return everyone
