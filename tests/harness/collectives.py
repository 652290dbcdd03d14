"""Count every functional collective a block of eager code issues, with the profiler.

Upstream's ``CommDebugMode`` is a dispatch mode: it does not see the collectives DTensor
issues for implicit redistributions *inside* an op's dispatch (e.g. the reduce-scatter a
strategy asks for), so it undercounts. The profiler records every op call wherever it comes
from, so it serves as the independent count.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """``with count_collectives() as counts:`` -> ``counts[kind]`` after the block."""
    counts: Counter[str] = Counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield counts
    counts.update(KINDS[e.name] for e in prof.events() if e.name in KINDS and not _nested(e))


def _nested(event) -> bool:  # type: ignore[no-untyped-def]
    """A collective called on an async result re-issues itself on the waited tensor inside
    its own event (through the subclass's dispatch): count the call once."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in KINDS:
            return True
        parent = parent.cpu_parent
    return False
