"""Capture and graph IR: what the compiler knows about a captured DTensor program."""

from vescale.fx.collectives import COLLECTIVE_KINDS, CollectiveRecord, collective_table
from vescale.fx.trace import TraceResult, trace

__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveRecord",
    "TraceResult",
    "collective_table",
    "trace",
]
