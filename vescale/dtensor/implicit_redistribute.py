"""The dispatcher's implicit input redistribution, for vescale DTensors through vescale's
planner where upstream's cannot take the step.

:func:`redistribute_for_dispatch` replaces upstream's; it is installed by
``vescale._patches``, the one module that changes torch objects.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from vescale._torch_compat import DTensorSpec, StridedShard, upstream_dispatch_module
from vescale.dtensor.dtensor import VescaleSpec
from vescale.dtensor.placement_types import Placement, is_private_partial
from vescale.dtensor.ragged import RaggedShard
from vescale.dtensor.redistribute import moves_nothing, redistribute_local_tensor

__all__ = ["redistribute_for_dispatch"]

_upstream_dispatch_redistribute = upstream_dispatch_module.redistribute_local_tensor


def redistribute_for_dispatch(
    local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec, **kwargs: Any
) -> torch.Tensor:
    """The dispatcher's input redistribution. For vescale DTensors, steps that *target* a
    ``Partial`` (a linear op's strategy asking for ``Shard -> Partial``, which upstream's
    planner refuses) and any involving an interleaved (strided) or a ragged shard go through
    vescale's planner; everything else, and every step to or from a private partial placement
    such as upstream's ``_MaskPartial`` (whose reduction masks and offsets an index), is
    upstream's. On a meta mesh every step is vescale's: shapes only, no communication; so is
    one that moves nothing (changes only on mesh dims of one rank): the local tensor as it is,
    where upstream would call collectives over groups of one."""
    if type(src) is VescaleSpec and (
        src.mesh.device_type == "meta"
        or _vescale_plans(src.placements, dst.placements)
        or moves_nothing(src, dst)
    ):
        return redistribute_local_tensor(local, src, dst, async_op=kwargs.get("async_op", False))
    return _upstream_dispatch_redistribute(local, src, dst, **kwargs)  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=1024)
def _vescale_plans(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> bool:
    """Whether vescale's planner takes ``src -> dst`` (see ``redistribute_for_dispatch``);
    cached: placements are hashable and the answer depends on them alone."""
    return any(
        (d.is_partial() and s != d)
        or isinstance(s, StridedShard | RaggedShard)
        or isinstance(d, StridedShard | RaggedShard)
        for s, d in zip(src, dst)
    ) and not any(is_private_partial(p) for p in (*src, *dst))
