"""Data-dependent ops (``nonzero``, ``unique``) on Replicate inputs.

Their output shapes depend on values, so fake propagation cannot know them; on Replicate
inputs every rank computes the same result, whose tensor meta is taken from the local result.
"""

from __future__ import annotations

import torch

from vescale.dtensor._torch_compat import DTensorSpec, OpSchema
from vescale.dtensor.dispatch import bypass_sharding_prop
from vescale.dtensor.placement_types import Placement, Replicate

aten = torch.ops.aten

# op -> number of tensor outputs
DATA_DEPENDENT_OPS = {aten.nonzero.default: 1, aten._unique2.default: 3}


@bypass_sharding_prop(list(DATA_DEPENDENT_OPS))
def replicate_only(schema: OpSchema) -> tuple[Placement, ...] | tuple[tuple[Placement, ...], ...]:
    """Replicate outputs for Replicate inputs; anything else raises naming op and placements."""
    specs = [a for a in schema.args_schema if isinstance(a, DTensorSpec)]
    mesh = specs[0].mesh
    for spec in specs:
        if not all(p.is_replicate() for p in spec.placements):
            raise RuntimeError(
                f"{schema.op}: supported on Replicate inputs only, got {tuple(spec.placements)} "
                f"on {mesh}; redistribute the input to Replicate first"
            )
    out = (Replicate(),) * mesh.ndim
    n = DATA_DEPENDENT_OPS[schema.op]
    return out if n == 1 else (out,) * n
