"""``vescale.fsdp``: fully sharded data parallel over one flat buffer per module, each
parameter a ``RaggedShard`` DTensor viewing its rank's share ([fsdp.md](../../docs/fsdp.md))."""

from vescale.fsdp.api import (
    FSDPModule,
    MixedPrecisionPolicy,
    UnshardHandle,
    flat_group,
    fully_shard,
)
from vescale.fsdp.group import FlatGroup
from vescale.fsdp.layout import FlatLayout, Slot, plan_layout

__all__ = [
    "FSDPModule",
    "FlatGroup",
    "FlatLayout",
    "MixedPrecisionPolicy",
    "Slot",
    "UnshardHandle",
    "flat_group",
    "fully_shard",
    "plan_layout",
]
