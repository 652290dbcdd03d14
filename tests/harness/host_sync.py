"""Count host reads of tensor values in a block: ``with count_host_syncs() as n: ...``.

Counts calls of ``Tensor.item``, ``tolist``, ``numpy``, ``cpu``, ``__bool__``, ``__int__``,
``__float__`` (on any tensor: on a CPU-only test every tensor stands for a device one; on an
accelerator each is a device-to-host sync) and ``torch.cuda.synchronize``. ``n.calls``: the
names counted, in order; ``len(n.calls)`` the count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__")


@dataclass
class HostSyncs:
    calls: list[str] = field(default_factory=list)


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    counted = HostSyncs()
    saved = {name: getattr(torch.Tensor, name) for name in READS}
    sync = torch.cuda.synchronize

    def counting(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counted.calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in saved.items():
        setattr(torch.Tensor, name, counting(name, fn))
    torch.cuda.synchronize = counting("cuda.synchronize", sync)
    try:
        yield counted
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.cuda.synchronize = sync
