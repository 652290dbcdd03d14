"""Ops that are linear in their input keep ``Partial`` (no reduction, no communication).

Upstream registers ``clone`` as a generic pointwise op, whose rule reduces a ``Partial``
input first (an all-reduce, or the explicit-mode error): cloning is the identity on each
rank's value, so the sum of clones is the clone of the sum. ``clone`` goes back to upstream's
single-input rule (output placements = input placements), which ``contiguous``, ``alias`` and
``detach`` already use. Both eager and the compiler see it (one registry).
"""

from __future__ import annotations

import torch

from vescale.dtensor.ops._registry import PROPAGATOR

__all__ = ["PLACEMENT_PRESERVING_OPS"]

aten = torch.ops.aten
PLACEMENT_PRESERVING_OPS = [aten.clone.default]

for _op in PLACEMENT_PRESERVING_OPS:
    assert _op in PROPAGATOR.op_strategy_funcs, f"{_op}: upstream's single-input rule is gone"
    PROPAGATOR.op_single_dim_strategy_funcs.pop(_op, None)
