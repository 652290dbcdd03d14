"""Count every functional collective a block of eager code issues, with the profiler.

Upstream's ``CommDebugMode`` is a dispatch mode: it does not see the collectives DTensor
issues for implicit redistributions *inside* an op's dispatch (e.g. the reduce-scatter a
strategy asks for), so it undercounts. The profiler records every op call wherever it comes
from, so it serves as the independent count.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator

import torch

KINDS = {
    "_c10d_functional::all_reduce": "all_reduce",
    "_c10d_functional::all_gather_into_tensor": "all_gather",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional::all_to_all_single": "all_to_all",
    "_c10d_functional::broadcast": "broadcast",
}


# profiler dtype names -> bytes per element
_ELEMENT_BYTES = {
    "double": 8,
    "float": 4,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
}


class CollectiveCounts(Counter[str]):
    """Collectives per kind; ``.bytes[kind]``: the bytes of their input tensors (one rank's
    contribution: the local shard for an all-gather, the whole buffer for an all-reduce)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """``with count_collectives() as counts:`` -> ``counts[kind]`` and ``counts.bytes[kind]``
    after the block."""
    counts = CollectiveCounts()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
    ) as prof:
        yield counts
    for e in prof.events():
        if e.name in KINDS and not _nested(e):
            counts[KINDS[e.name]] += 1
            shape, dtype = e.input_shapes[0], e.input_dtypes[0]
            counts.bytes[KINDS[e.name]] += math.prod(shape) * _ELEMENT_BYTES[dtype]


def _nested(event) -> bool:  # type: ignore[no-untyped-def]
    """A collective called on an async result re-issues itself on the waited tensor inside
    its own event (through the subclass's dispatch): count the call once."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in KINDS:
            return True
        parent = parent.cpu_parent
    return False
