"""Element-wise losses with ``reduction="mean"`` over a sharded input: the mean of the global
tensor, forward and backward.

Upstream has no strategy for these ops; its fallback runs the local kernel, whose mean
divides by the *local* element count: the backward is then off by the shard factor and the
forward is wrong for uneven shards. Here the op runs with ``reduction="sum"`` (a ``Partial``
sum forward, exact local gradients backward) and the result is scaled by ``1 / numel`` of the
global input: no communication added, exact for uneven shards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale.dtensor.dispatch import bypass_dispatch, python_dispatch

__all__ = ["ELEMENTWISE_LOSSES", "global_mean_loss"]

aten = torch.ops.aten
MEAN, SUM = 1, 2  # torch's reduction enum (none=0)

ELEMENTWISE_LOSSES = [
    aten.mse_loss.default,
    aten.mse_loss_backward.default,
    aten.smooth_l1_loss.default,
    aten.smooth_l1_loss_backward.default,
    aten.huber_loss.default,
    aten.huber_loss_backward.default,
    aten.soft_margin_loss.default,
    aten.soft_margin_loss_backward.default,
    aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_backward.default,
]


def _bind(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """All of ``op``'s arguments, positionally, defaults filled in."""
    out = []
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            out.append(args[i])
        elif a.name in kwargs:
            out.append(kwargs[a.name])
        else:
            out.append(a.default_value)
    return out


def _sharded(t: object) -> bool:
    return isinstance(t, _UpstreamDTensor) and any(
        p.is_shard() and t.device_mesh.size(i) > 1 for i, p in enumerate(t.placements)
    )


@bypass_dispatch(ELEMENTWISE_LOSSES)
def global_mean_loss(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``op`` with its mean taken over the global input (see module docstring)."""
    names = [a.name for a in op._schema.arguments]
    bound = _bind(op, args, kwargs)
    inp = bound[names.index("self")]
    r = names.index("reduction")
    if bound[r] != MEAN or not _sharded(inp):
        return python_dispatch(op, args, kwargs)
    bound[r] = SUM
    return python_dispatch(op, tuple(bound), {}) * (1.0 / inp.numel())
