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
# In-place c10d collectives into caller-owned buffers (``dist.all_gather_single`` and
# ``dist.reduce_scatter_single``, as vescale.fsdp issues them): ``count_collectives(C10D_KINDS)``.
C10D_KINDS = {
    "c10d::_allgather_base_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
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
def count_collectives(kinds: dict[str, str] = KINDS) -> Iterator[CollectiveCounts]:
    """``with count_collectives() as counts:`` -> ``counts[kind]`` and ``counts.bytes[kind]``
    after the block; ``kinds``: the profiler op names counted, and their kind."""
    counts = CollectiveCounts()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
    ) as prof:
        yield counts
    # The raw events: building the profiler's FunctionEvent tree (prof.events()) costs tens of
    # milliseconds per block, more than most blocks themselves.
    raw = prof.profiler.kineto_results.events() if prof.profiler.kineto_results else []
    events = sorted(
        (e for e in raw if e.name() in kinds), key=lambda e: (e.start_ns(), -e.end_ns())
    )
    for i, e in enumerate(events):
        if not _nested(e, events[:i]):
            counts[kinds[e.name()]] += 1
            shape, dtype = e.shapes()[0], e.dtypes()[0]
            counts.bytes[kinds[e.name()]] += math.prod(shape) * _ELEMENT_BYTES[dtype]


def _nested(event, earlier) -> bool:  # type: ignore[no-untyped-def]
    """A collective called on an async result re-issues itself on the waited tensor inside
    its own event (through the subclass's dispatch): count the call once (the outer event,
    which starts first and ends last on the same thread)."""
    tid = event.start_thread_id()
    return any(
        o.start_thread_id() == tid
        and o.start_ns() <= event.start_ns()
        and event.end_ns() <= o.end_ns()
        for o in earlier
    )
