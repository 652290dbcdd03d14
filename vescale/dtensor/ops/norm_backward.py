"""Layer-norm backward keeps the input's layout.

Upstream prices each op alone: a ``Partial`` gradient into ``native_layer_norm_backward``
is reduce-scattered to a batch-dim shard (cheaper than an all-reduce), so the input
gradient comes out sharded; where it flows back into a replicated residual stream it is
all-gathered right after: two latency-bound collectives for the work of one all-reduce (the
Megatron GPT backward pays this pair once per layer norm). For vescale DTensors the rule lays
the gradient and the saved statistics out as the forward input (its batch-dim shards, else
``Replicate``) and lets upstream's strategy propagate from there: a ``Partial`` gradient is
all-reduced once and the input gradient has the input's placements. An input sharded over a
normalized dim, ``Partial`` or strided keeps upstream's choice, as do upstream DTensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from vescale._torch_compat import DTensorSpec, OpSchema, OutputSharding
from vescale.dtensor.ops._registry import register_rule, upstream_propagate

__all__ = ["NORM_BACKWARD_OPS", "input_layout"]

aten = torch.ops.aten
# op -> positions of its saved statistics (grad_out, input, normalized_shape come first);
# aten._fused_rms_norm_backward would fit too, but has no CPU kernel to test it with
_STATS: dict[torch._ops.OpOverload, tuple[int, ...]] = {
    aten.native_layer_norm_backward.default: (3, 4),  # mean, rstd
}
NORM_BACKWARD_OPS = list(_STATS)


def input_layout(input_spec: DTensorSpec, normalized_ndim: int) -> tuple | None:
    """The input's placements if every one is ``Replicate`` or a plain ``Shard`` of a
    batch dim (a layout grad_out and the statistics can take), else ``None``."""
    axis = input_spec.ndim - normalized_ndim
    ok = all(
        isinstance(p, Replicate) or (type(p) is Shard and p.dim < axis)
        for p in input_spec.placements
    )
    return tuple(input_spec.placements) if ok else None


@register_rule(NORM_BACKWARD_OPS)
def _follow_input(op_schema: OpSchema) -> OutputSharding:
    """Upstream's propagation with grad_out and the statistics laid out as the input."""
    args: list[Any] = list(op_schema.args_schema)
    inp, normalized = args[1], args[2]
    if not isinstance(args[0], DTensorSpec) or not isinstance(inp, DTensorSpec):
        return upstream_propagate(op_schema)
    target = input_layout(inp, len(normalized))
    moved = [
        i
        for i in (0, *_STATS[op_schema.op])
        if isinstance(args[i], DTensorSpec) and tuple(args[i].placements) != target
    ]
    if target is None or not moved:
        return upstream_propagate(op_schema)
    for i in moved:
        args[i] = DTensorSpec(args[i].mesh, target, tensor_meta=args[i].tensor_meta)
    laid_out = OpSchema(
        op_schema.op, tuple(args), op_schema.kwargs_schema, schema_info=op_schema.schema_info
    )
    out = upstream_propagate(laid_out)
    if out.redistribute_schema is None:
        out.redistribute_schema = laid_out
        out.needs_redistribute = True
    return out
