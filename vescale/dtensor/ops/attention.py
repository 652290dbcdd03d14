"""Strategies for CPU ``scaled_dot_product_attention`` (``_scaled_dot_product_flash_attention_for_cpu``
and its backward), registered into upstream's sharding propagator so eager and compiler share them.

Per mesh dim, attention on ``(batch, heads, seq, head_dim)`` inputs runs without
communication when q, k, v (and the output, logsumexp and gradients) are all

* ``Replicate``;
* ``Shard(1)``: tensor parallelism over heads;
* ``Shard(0)``: data parallelism over the batch;
* forward only: ``Partial`` v (q, k replicated) gives a ``Partial`` output, attention being
  linear in v; logsumexp, which does not depend on v, stays replicated.

An ``attn_mask`` follows the sharded dim when it has that dim with size > 1 and is
replicated when it broadcasts over it. Any other input layout is redistributed to the
cheapest of these (or raises in explicit mode). A sharding that would leave some rank an
empty shard (5 heads on 4 ranks: 2, 2, 1, 0) is not offered: the CPU kernel dies of a
floating-point exception on empty inputs.
"""

from __future__ import annotations

from typing import Any

import torch

from vescale._patches import register_op_strategy
from vescale._torch_compat import (
    DTensorSpec,
    OpSchema,
    OpStrategy,
    expand_to_full_mesh_op_strategy,
)
from vescale.dtensor.layout import empty_shard_dims
from vescale.dtensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["no_empty_shard", "sdpa_cpu_backward_strategy", "sdpa_cpu_strategy"]

aten = torch.ops.aten


def _mask_placement(schema: OpSchema, dim: int) -> list[Placement]:
    """Placement of ``attn_mask`` when q/k/v are sharded on ``dim`` of their 4 dims ([] if
    there is no mask)."""
    mask = schema.kwargs_schema.get("attn_mask")
    if not isinstance(mask, OpStrategy):
        return []
    shape = mask.shape
    mask_dim = dim - (4 - len(shape))
    if mask_dim >= 0 and shape[mask_dim] > 1:
        return [Shard(mask_dim)]
    return [Replicate()]


def no_empty_shard(input_specs: list[DTensorSpec], _outputs: object) -> bool:
    """No rank of the mesh holds an empty shard of any input."""
    return not any(s.tensor_meta is not None and empty_shard_dims(s) for s in input_specs)


def _sharded(schema: OpSchema, dim: int, n: int) -> list[Placement | None]:
    """``n`` outputs/inputs sharded on ``dim``, then the mask's placement."""
    return [*[Shard(dim)] * n, *_mask_placement(schema, dim)]


def _replicated(schema: OpSchema, n: int) -> list[Placement | None]:
    return [*[Replicate()] * n, *([Replicate()] if _mask_placement(schema, 0) else [])]


@register_op_strategy(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_cpu_strategy(schema: OpSchema) -> Any:
    """(out, logsumexp) from (q, k, v[, attn_mask])."""
    strategies = [
        _replicated(schema, 5),
        _sharded(schema, 1, 5),
        _sharded(schema, 0, 5),
        [Partial(), Replicate(), Replicate(), Replicate(), Partial(), *_replicated(schema, 0)],
    ]
    return expand_to_full_mesh_op_strategy(
        schema.get_mesh_from_args(),
        schema,
        strategies,
        input_index=2,
        is_valid_strategy_cb=no_empty_shard,
    )


@register_op_strategy(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def sdpa_cpu_backward_strategy(schema: OpSchema) -> Any:
    """(grad_q, grad_k, grad_v) from (grad_out, q, k, v, out, logsumexp[, attn_mask])."""
    strategies = [
        _replicated(schema, 9),
        _sharded(schema, 1, 9),
        _sharded(schema, 0, 9),
    ]
    return expand_to_full_mesh_op_strategy(
        schema.get_mesh_from_args(validate=False),
        schema,
        strategies,
        input_index=3,
        is_valid_strategy_cb=no_empty_shard,
    )
