"""vescale's logs and tlparse artifacts, through the tools torch users already read.

Logs: every module logs to ``logging.getLogger("vescale.<module>")`` (:func:`logger`). torch's
``TORCH_LOGS=vescale`` (INFO: a line per compiled graph, per plan stage) or ``+vescale``
(DEBUG: a line per pass with its time) turns them on with torch's handler and format, as it
does for any module name (``TORCH_LOGS_OUT`` included); :func:`info` and :func:`debug` write
on global rank 0 only.

Artifacts: :func:`artifact` hands a named payload to ``torch._logging.trace_structured``, so
with ``TORCH_TRACE=<dir>`` tlparse lists vescale's graph after each pass, collectives table,
schedule and plan reports beside Dynamo's and Inductor's, under the same compile id. The
payload is built only when a trace is being written.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from vescale._torch_compat import trace_structured

__all__ = ["artifact", "debug", "info", "logger", "rank0"]


def logger(module: str) -> logging.Logger:
    """The logger of vescale module ``module`` (its ``__name__``)."""
    return logging.getLogger(module)


def rank0() -> bool:
    """Whether this process is global rank 0 (or runs without ``torch.distributed``)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def info(log: logging.Logger, msg: str, *args: Any) -> None:
    """``log.info(msg, *args)`` on global rank 0."""
    if rank0() and log.isEnabledFor(logging.INFO):
        log.info(msg, *args, stacklevel=2)


def debug(log: logging.Logger, msg: str, *args: Any) -> None:
    """``log.debug(msg, *args)`` on global rank 0."""
    if rank0() and log.isEnabledFor(logging.DEBUG):
        log.debug(msg, *args, stacklevel=2)


def artifact(name: str, payload: Callable[[], Any], encoding: str = "string") -> None:
    """A ``TORCH_TRACE`` artifact ``name`` (tlparse shows it by name); ``payload()`` is text
    (``encoding="string"``) or a JSON-able object (``"json"``), called only when tracing."""

    def text() -> str:
        value = payload()
        return value if encoding == "string" else json.dumps(value, indent=1)

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": encoding},
        payload_fn=text,
        expect_trace_id=False,
    )
