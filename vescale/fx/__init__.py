"""Capture and graph IR: what the compiler knows about a captured DTensor program."""

from vescale.fx.collectives import COLLECTIVE_KINDS, CollectiveRecord, collective_table

__all__ = ["COLLECTIVE_KINDS", "CollectiveRecord", "collective_table"]
