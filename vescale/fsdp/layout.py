"""Where each parameter of a block lives in its flat buffer, and which rank holds which part.

The full flat buffer has ``world * share`` elements; rank ``r`` holds the contiguous range
``[r * share, (r + 1) * share)`` (every share the same size, so one ``all_gather_into_tensor``
fills the full buffer with no copy in or out). Parameters sit one after another in the
order given; a parameter is moved forward past a few padding elements when a share boundary
would otherwise cut one of its blocks (a row, for ``RaggedShard(dims=(0,))``). So every
parameter is one contiguous view of the full buffer, each rank's part of it is one
contiguous view of that rank's share, and the number of whole blocks on each rank is the
parameter's ``RaggedShard`` ``local_units``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FlatLayout", "Slot", "plan_layout"]


@dataclass(frozen=True)
class Slot:
    """One parameter in the full flat buffer: ``numel`` elements from ``offset``, in blocks of
    ``block`` elements; ``units[r]``: the blocks rank ``r`` holds."""

    offset: int
    numel: int
    block: int
    units: tuple[int, ...]


@dataclass(frozen=True)
class FlatLayout:
    """The layout of one block's flat buffer over ``world`` ranks of ``share`` elements each."""

    world: int
    share: int
    slots: tuple[Slot, ...]

    @property
    def padding(self) -> int:
        """Elements of the full buffer that belong to no parameter."""
        return self.world * self.share - sum(s.numel for s in self.slots)

    def local_range(self, index: int, rank: int) -> tuple[int, int]:
        """``(start, length)`` of parameter ``index``'s part on ``rank``, in that rank's share."""
        slot = self.slots[index]
        lo = max(slot.offset, rank * self.share)
        hi = min(slot.offset + slot.numel, (rank + 1) * self.share)
        return (lo - rank * self.share, hi - lo) if hi > lo else (0, 0)

    def gaps(self) -> list[tuple[int, int]]:
        """``(start, length)`` of every padding range of the full buffer."""
        out, end = [], 0
        for slot in self.slots:
            if slot.offset > end:
                out.append((end, slot.offset - end))
            end = slot.offset + slot.numel
        if self.world * self.share > end:
            out.append((end, self.world * self.share - end))
        return out


def _place(sizes: Sequence[tuple[int, int]], world: int, share: int) -> list[int] | None:
    """Offsets of ``(numel, block)`` parameters packed in order into ``world`` shares of
    ``share`` elements with no share boundary inside a block; ``None`` if they do not fit."""
    offsets, end, capacity = [], 0, world * share
    for numel, block in sizes:
        start = end
        while True:
            if start + numel > capacity:
                return None
            first, last = start // share + 1, (start + numel - 1) // share
            cut = next(
                (k * share for k in range(first, last + 1) if (k * share - start) % block), None
            )
            if cut is None:
                break
            start += (cut - start) % block  # the cut now falls between two blocks
        offsets.append(start)
        end = start + numel
    return offsets


def plan_layout(sizes: Sequence[tuple[int, int]], world: int) -> FlatLayout:
    """The smallest balanced layout of parameters given as ``(numel, block)`` (``block``
    divides ``numel``) over ``world`` ranks: equal shares, no block cut."""
    for numel, block in sizes:
        if block <= 0 or numel % block:
            raise ValueError(f"plan_layout: block {block} does not divide numel {numel}")
    share = max(1, math.ceil(sum(n for n, _ in sizes) / world))
    while (offsets := _place(sizes, world, share)) is None:
        share += 1
    slots = []
    for (numel, block), offset in zip(sizes, offsets):
        units = []
        for r in range(world):
            lo, hi = max(offset, r * share), min(offset + numel, (r + 1) * share)
            units.append(max(0, hi - lo) // block)
        slots.append(Slot(offset, numel, block, tuple(units)))
    return FlatLayout(world, share, tuple(slots))
