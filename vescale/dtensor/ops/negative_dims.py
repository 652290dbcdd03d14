"""Backward strategies that upstream computes from a raw, possibly negative, ``dim``.

``select_backward`` and ``slice_backward`` (``grad, input_sizes, dim, ...``) compare ``dim``
with shard dims without normalizing it, so ``x.select(-1, 0)`` on a ``Shard(0)`` tensor gets
a gradient laid out as ``Shard(1)`` and a kernel called with the global input size. Here
the strategy sees ``dim % len(input_sizes)``; the kernel still gets the caller's ``dim``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vescale._torch_compat import OpSchema
from vescale.dtensor.ops._registry import wrap_upstream_strategy

__all__ = ["SIZES_DIM_OPS"]

aten = torch.ops.aten
# ops whose args are (grad, input_sizes, dim, ...)
SIZES_DIM_OPS = [aten.select_backward.default, aten.slice_backward.default]


def _normalizing(upstream: Callable[[OpSchema], Any]) -> Callable[[OpSchema], Any]:
    def strategy(schema: OpSchema) -> Any:
        args = schema.args_schema
        dim = args[2]
        if isinstance(dim, int) and dim < 0:
            args = (*args[:2], dim + len(args[1]), *args[3:])  # type: ignore[arg-type]
            schema = OpSchema(schema.op, args, schema.kwargs_schema, schema.schema_info)
        return upstream(schema)

    return strategy


for _op in SIZES_DIM_OPS:
    wrap_upstream_strategy(_op, _normalizing, "normalized_dim")
