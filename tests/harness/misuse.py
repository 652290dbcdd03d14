"""Misuse on every rank: the same clear error on every rank, within seconds, never a hang.

``error_everywhere(pool, fn, *args)`` runs the module-level ``fn(*args)`` on every rank of
``pool``; each rank catches what ``fn`` raises and reports its class, text and the seconds it
took. The call fails the test unless every rank raised, all with the same class and text
(after ``normalize``), each within ``within_s``; it returns that one error so the test can
assert on its text. A rank that hangs fails through the pool's own timeout (``timeout_s``).
"""

from __future__ import annotations

import importlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.harness.pool import WorkerPool


@dataclass(frozen=True)
class RankError:
    """What one rank raised: exception class name, message, seconds from call to raise."""

    kind: str
    message: str
    seconds: float


def _resolve(module: str, qualname: str) -> Callable[..., Any]:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _caught(module: str, qualname: str, args: tuple[Any, ...]) -> RankError | None:
    """Run on each rank: ``None`` if ``fn`` returned, else what it raised."""
    start = time.perf_counter()
    try:
        _resolve(module, qualname)(*args)
    except Exception as e:  # the subject of the test: any class, compared across ranks
        return RankError(type(e).__name__, str(e), time.perf_counter() - start)
    return None


def error_everywhere(
    pool: WorkerPool,
    fn: Callable[..., Any],
    *args: Any,
    within_s: float = 30.0,
    timeout_s: float = 90.0,
    normalize: Callable[[str], str] | None = None,
    env: dict[str, str] | None = None,
) -> RankError:
    """The one error ``fn(*args)`` raises on every rank of ``pool`` (see the module doc)."""
    results = pool.run(_caught, fn.__module__, fn.__qualname__, args, timeout_s=timeout_s, env=env)
    fine = [r for r, e in enumerate(results) if e is None]
    assert not fine, f"{fn.__qualname__}: ranks {fine} raised nothing; others: {results}"
    norm = normalize or (lambda s: s)
    texts = {(e.kind, norm(e.message)) for e in results}
    assert len(texts) == 1, f"{fn.__qualname__}: ranks disagree: " + "; ".join(
        f"rank {r}: {e.kind}: {e.message}" for r, e in enumerate(results)
    )
    slow = [(r, round(e.seconds, 1)) for r, e in enumerate(results) if e.seconds > within_s]
    assert not slow, f"{fn.__qualname__}: ranks raised after more than {within_s}s: {slow}"
    return results[0]  # type: ignore[no-any-return]


def without_rank(text: str) -> str:
    """``text`` with "rank N" numbers blanked, for messages that name the reporting rank."""
    return re.sub(r"rank \d+", "rank _", text)
