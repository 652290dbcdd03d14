"""``gather`` on multi-dim meshes: keep upstream's masked strategy where it is right.

Upstream's gather strategy lets the input be sharded on the gather dim by moving the index to
``_MaskPartial`` (each rank masks and offsets the index into its own slice; the output is
reduced by summing). Its mask is computed for the index as one mesh dim sees it, so on a
multi-dim mesh it is wrong when any other mesh dim shards the output or an input (the mask is
materialized on a differently shaped local index: an ``IndexError``), or when two mesh dims
both mask ("MaskBuffer has been materialized with conflicting data"); upstream fails on those
layouts too. For vescale DTensors those strategies are dropped, so the strategy search picks
a correct one (the others replicate the gather dim or shard a non-gather dim): a masked
strategy stays only where its one masked mesh dim is the only mesh dim on which the output
or any input, as it is now, is not ``Replicate``.

A ``_MaskPartial`` output (gather; embedding's row-wise path) holds unmasked values and a mask that its first reduction releases,
so upstream's DTensors fail on a second one (``full_tensor()`` twice). vescale masks the
local values at once (no communication) and lays the output out ``Partial``: the same sum,
reducible any number of times.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._torch_compat import DTensorSpec, MaskPartial, OpSchema, OpStrategy
from vescale.dtensor.dtensor import new_dtensor
from vescale.dtensor.hooks import post_dispatch_patch
from vescale.dtensor.ops._registry import wrap_upstream_strategy
from vescale.dtensor.placement_types import Partial, is_private_partial

__all__ = ["MASKED_OPS", "settle_mask"]

aten = torch.ops.aten
MASKED_OPS = [aten.gather.default]


def _masked_alone(output: Sequence[Any], inputs: Sequence[Sequence[Any]]) -> bool:
    masked = [i for i, p in enumerate(output) if is_private_partial(p)]
    if not masked:
        return True
    others = [i for i in range(len(output)) if i != masked[0]]
    return len(masked) == 1 and all(
        pl[i].is_replicate() for pl in (output, *inputs) for i in others
    )


def _correct_only(upstream: Callable[[OpSchema], Any]) -> Callable[[OpSchema], Any]:
    def strategy(schema: OpSchema) -> Any:
        out = upstream(schema)
        if not isinstance(out, OpStrategy):
            return out
        current = [
            tuple(a.strategies[0].output_spec.placements)
            for a in schema.args_schema
            if isinstance(a, OpStrategy)
        ]
        kept = [s for s in out.strategies if _masked_alone(s.output_spec.placements, current)]
        return OpStrategy(kept) if kept else out

    return strategy


for _op in MASKED_OPS:
    wrap_upstream_strategy(_op, _correct_only, "unmasked")


def _holds_mask(op: torch._ops.OpOverload, out: Any) -> bool:
    return isinstance(out, _UpstreamDTensor) and any(
        isinstance(p, MaskPartial) and p.mask_buffer.data is not None for p in out.placements
    )


@post_dispatch_patch([*MASKED_OPS, aten.embedding.default], when=_holds_mask)
def settle_mask(op: torch._ops.OpOverload, out: _UpstreamDTensor) -> _UpstreamDTensor:
    """``out``'s ``_MaskPartial`` mesh dims become ``Partial`` of the masked local values."""
    local, placements = out._local_tensor, list(out.placements)
    for i, p in enumerate(placements):
        if isinstance(p, MaskPartial) and p.mask_buffer.data is not None:
            mask = p.mask_buffer.data  # the index's shape: embedding rows add a trailing dim
            local = local.masked_fill(mask.view(*mask.shape, *[1] * (local.ndim - mask.ndim)), 0)
            p.mask_buffer.release_mask()
            placements[i] = Partial(p.reduce_op)
    spec = DTensorSpec(out.device_mesh, tuple(placements), tensor_meta=out._spec.tensor_meta)
    return new_dtensor(local, spec, requires_grad=False)
