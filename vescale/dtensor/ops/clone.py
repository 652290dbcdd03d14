"""``clone`` keeps ``Partial``: it is linear in its input (no reduction, no communication).

Upstream registers ``clone`` as a generic pointwise op, whose rule reduces a ``Partial``
input first (an all-reduce, or the explicit-mode error): cloning is the identity on each
rank's value, so the sum of clones is the clone of the sum. For vescale DTensors ``clone``
keeps its input's placements, as ``contiguous``, ``alias`` and ``detach`` already do
upstream; upstream DTensors keep upstream's rule. Eager, the compiler and the planner all
see it (a rule of the one op registry, :mod:`vescale.dtensor.ops._registry`).
"""

from __future__ import annotations

import torch

from vescale._torch_compat import DTensorSpec, OpSchema, OutputSharding, TensorMeta
from vescale.dtensor.ops._registry import PROPAGATOR, register_rule

__all__ = ["PLACEMENT_PRESERVING_OPS"]

aten = torch.ops.aten
PLACEMENT_PRESERVING_OPS = [aten.clone.default]


@register_rule(PLACEMENT_PRESERVING_OPS)
def _keep_placements(op_schema: OpSchema) -> OutputSharding:
    """Output placements = input placements, no redistribution."""
    spec = op_schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    meta = PROPAGATOR._propagate_tensor_meta_non_cached(op_schema)
    assert meta is None or isinstance(meta, TensorMeta)
    return OutputSharding(DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta))
