"""Progress of vescale's long stages: one line per stage, on rank 0 only, to stderr.

    vescale: solve ... 5.4 s (LP relaxation, integral, gap 0.00%)

The stages that can take seconds to minutes on a real model report themselves: the plan
path's ``capture``, ``propagate`` and ``solve`` (:func:`vescale.parallelize`) and every graph
the ``vescale`` backend compiles (``compile graphN.forward``: trace, passes and codegen;
``compile graphN.backward``, at the first backward). A stage writes ``vescale: <stage> ...``
when it starts and its elapsed time when it ends, on the same line unless another stage
wrote in between (then ``vescale: <stage>: 12.3 s``). Only global rank 0 (or a process
without ``torch.distributed``) writes. On by default; ``VESCALE_PROGRESS=0`` (a strict
boolean, :func:`vescale._env.env_flag`) or ``parallelize(..., progress=False)`` turns it off.
When the ``vescale`` logger is enabled for INFO (``TORCH_LOGS=vescale``, or the user's own
logging setup), the lines go to the logger ``vescale._progress`` instead (a record when a
stage starts and one when it ends), so they are not written twice.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from vescale._env import env_flag
from vescale._logs import logger, rank0

__all__ = ["ENV", "Stage", "enabled", "forced", "stage"]

ENV = "VESCALE_PROGRESS"
_forced: ContextVar[bool | None] = ContextVar("vescale_progress", default=None)
_open: list[Stage] = []  # the stage whose line is written up to "..." (at most one)
_log = logger(__name__)


@dataclass
class Stage:
    """A running stage; ``detail`` (set before it ends) is shown in parentheses."""

    name: str
    detail: str = ""


def enabled() -> bool:
    """Whether stages report: as :func:`forced`, else ``VESCALE_PROGRESS`` (default on);
    a value that is not a boolean raises ``ValueError`` naming the variable."""
    on = _forced.get()
    return env_flag(ENV, True) if on is None else on


@contextlib.contextmanager
def forced(on: bool | None) -> Iterator[None]:
    """Within the block, progress is ``on`` whatever the environment says (``None``: as it
    says)."""
    token = _forced.set(on)
    try:
        yield
    finally:
        _forced.reset(token)


def _write(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


@contextlib.contextmanager
def stage(name: str, on: bool | None = None) -> Iterator[Stage]:
    """Report the block as the stage ``name`` (see the module doc) if ``on`` (``None``:
    :func:`enabled`); the yielded :class:`Stage` takes a ``detail``. Every rank reads the
    setting (so a bad value raises everywhere); rank 0 writes."""
    current = Stage(name)
    if not ((enabled() if on is None else on) and rank0()):
        yield current
        return
    if logging.getLogger("vescale").isEnabledFor(logging.INFO):
        with _logged(current):
            yield current
        return
    if _open:  # an enclosing stage's line ends here; it reports on a line of its own
        _write("\n")
        _open.clear()
    _write(f"vescale: {name} ...")
    _open.append(current)
    start = time.perf_counter()
    outcome = "failed after "
    try:
        yield current
        outcome = ""
    finally:
        took = f"{outcome}{time.perf_counter() - start:.1f} s"
        detail = f" ({current.detail})" if current.detail else ""
        if _open and _open[0] is current:
            _write(f" {took}{detail}\n")
            _open.clear()
        else:
            _write(f"vescale: {name}: {took}{detail}\n")


@contextlib.contextmanager
def _logged(current: Stage) -> Iterator[None]:
    """:func:`stage` through the logger: a record at the start and one at the end."""
    _log.info("%s ...", current.name)
    start = time.perf_counter()
    outcome = "failed after "
    try:
        yield
        outcome = ""
    finally:
        detail = f" ({current.detail})" if current.detail else ""
        _log.info("%s: %s%.1f s%s", current.name, outcome, time.perf_counter() - start, detail)
