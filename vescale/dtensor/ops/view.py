"""View ops whose result upstream cannot lay out: redistribute the input instead of failing.

Upstream's view strategy raises when the output of a view cannot keep the input's sharding:
flattening an unevenly sharded dim (``view(3 * 5, ...)`` of a ``(3, 5, ...)`` tensor sharded
on dim 0 over 2 ranks: what the math attention decomposition does on an uneven batch), or
expanding a size-1 dim that is "sharded" (``expand_as`` of a ``(n, 1)`` tensor sharded on
dim 1); and it computes wrong local shapes for a dim sharded over two mesh dims where some
rank's shard is empty (2 rows over a 2x2 mesh), which is treated the same way. Here the strategy is retried with the input replicated on the fewest mesh dims
that make it work (each one alone, innermost first, then all): the dispatcher redistributes
the input to it (or raises in explicit mode), and every view the strategy accepts is
unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vescale.dtensor._torch_compat import (
    DTensorSpec,
    OpSchema,
    OpSpec,
    OpStrategy,
)
from vescale.dtensor.ops._layout import empty_shard_dims
from vescale.dtensor.ops._registry import wrap_upstream_strategy
from vescale.dtensor.placement_types import Placement, Replicate

__all__ = ["RETRIED_VIEW_OPS"]

aten = torch.ops.aten
RETRIED_VIEW_OPS = [
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
]


def _with_input(schema: OpSchema, placements: tuple[Placement, ...]) -> OpSchema:
    first = schema.args_schema[0]
    assert isinstance(first, OpStrategy)
    spec = first.strategies[0].output_spec
    replaced = OpStrategy(
        [OpSpec(DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta))]
    )
    return OpSchema(
        schema.op, (replaced, *schema.args_schema[1:]), schema.kwargs_schema, schema.schema_info
    )


def _candidates(placements: tuple[Placement, ...]) -> list[tuple[Placement, ...]]:
    sharded = [i for i, p in enumerate(placements) if p.is_shard()]
    one = [
        tuple(Replicate() if i == m else p for i, p in enumerate(placements))
        for m in reversed(sharded)
    ]
    return [*one, (Replicate(),) * len(placements)]


def _nested_empty(spec: DTensorSpec) -> bool:
    """A dim sharded over several mesh dims with an empty shard somewhere: upstream computes
    wrong local view shapes for it."""
    return any(sum(p.is_shard(d) for p in spec.placements) > 1 for d in empty_shard_dims(spec))


def _retrying(upstream: Callable[[OpSchema], Any]) -> Callable[[OpSchema], Any]:
    def strategy(schema: OpSchema) -> Any:
        first = schema.args_schema[0]
        spec = (
            first.strategies[0].output_spec
            if isinstance(first, OpStrategy) and len(first.strategies) == 1
            else None
        )
        try:
            if spec is not None and _nested_empty(spec):
                raise ValueError("nested uneven sharding with an empty shard")
            return upstream(schema)
        except (RuntimeError, KeyError, AssertionError, ValueError) as err:
            if spec is None:
                raise
            for candidate in _candidates(tuple(spec.placements)):
                if _nested_empty(DTensorSpec(spec.mesh, candidate, tensor_meta=spec.tensor_meta)):
                    continue
                try:
                    return upstream(_with_input(schema, candidate))
                except (RuntimeError, KeyError, AssertionError, ValueError):
                    continue
            raise err

    return strategy


for _op in RETRIED_VIEW_OPS:
    wrap_upstream_strategy(_op, _retrying, "retrying")
