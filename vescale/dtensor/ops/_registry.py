"""Upstream's one sharding propagator, and wrapping its registered strategies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._patches import register_op_strategy
from vescale._torch_compat import OpSchema
from vescale.dtensor.dtensor import vescale_rules_active

__all__ = ["PROPAGATOR", "wrap_upstream_strategy"]

PROPAGATOR = _UpstreamDTensor._op_dispatcher.sharding_propagator

Strategy = Callable[[OpSchema], Any]


def wrap_upstream_strategy(op: Any, wrap: Callable[[Strategy], Strategy], prefix: str) -> None:
    """Register ``wrap(upstream's strategy for op)`` in its place, same schema info; it
    applies to ops with a vescale input, upstream's strategy to all others."""
    upstream = PROPAGATOR.op_strategy_funcs[op]
    wrapped = wrap(upstream)

    def strategy(schema: OpSchema) -> Any:
        return (wrapped if vescale_rules_active() else upstream)(schema)

    strategy.__name__ = f"{prefix}_{op.__name__.replace('.', '_')}"
    register_op_strategy(op, schema_info=PROPAGATOR.op_to_schema_info.get(op))(strategy)
