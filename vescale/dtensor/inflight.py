"""Results of async functional collectives still in flight.

Upstream's functional collectives (``funcol``) and ``redistribute(..., async_op=True)``
return an ``AsyncCollectiveTensor``: the collective is issued, its result is waited on first
use. Code that reads a local shard's data directly waits it here first.
"""

from __future__ import annotations

import torch

from vescale._torch_compat import AsyncCollectiveTensor

__all__ = ["wait_local"]


def wait_local(t: torch.Tensor) -> torch.Tensor:
    """``t`` waited if it is an in-flight async collective result, else ``t``."""
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t
