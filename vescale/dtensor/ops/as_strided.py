"""``as_strided`` on a vescale DTensor where it is a view of every rank's shard.

AOTAutograd rebuilds a compiled function's outputs that alias its inputs with
``input.as_strided(out.size(), out.stride(), out.storage_offset())``; a DTensor reports its
*global* size and stride and its *local* storage offset. Each output dim of non-zero stride
and size > 1 is matched to the input dim of the same global stride; the view is local when
every sharded input dim appears whole. It then runs on the shard with the matched dims'
local sizes and strides and the given (local) offset, and ``Shard(i)`` becomes ``Shard(j)``
for the output dim ``j`` matched to ``i``; ``Replicate`` and ``Partial`` are kept (a view
is linear). Anything else raises naming the view, the placements and the mesh.
"""

from __future__ import annotations

from typing import Any

import torch

from vescale.dtensor.dtensor import new_dtensor
from vescale.dtensor.hooks import bypass_dispatch
from vescale.dtensor.op_args import bind
from vescale.dtensor.placement_types import Placement, Shard, make_spec

__all__ = ["as_strided_view"]

aten = torch.ops.aten


def _match_dims(base: torch.Tensor, size: list[int], stride: list[int]) -> list[int | None]:
    """Per output dim, the input dim it walks (None: a size-1 or expanded dim)."""
    matched: list[int | None] = []
    for n, st in zip(size, stride):
        if n == 1 or st == 0:
            matched.append(None)
            continue
        found = [
            i
            for i in range(base.ndim)
            if base.stride(i) == st and base.size(i) > 1 and i not in matched
        ]
        if len(found) != 1:
            raise ValueError(f"output stride {st} matches input dims {found}")
        matched.append(found[0])
    return matched


@bypass_dispatch(aten.as_strided.default)
def as_strided_view(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``base.as_strided(size, stride, storage_offset)`` as a view of each shard."""
    a = bind(op, args, kwargs)
    base, size, stride, offset = a["self"], a["size"], a["stride"], a["storage_offset"]
    spec = base._spec
    local: torch.Tensor = base._local_tensor
    size, stride = [int(s) for s in size], [int(s) for s in stride]
    try:
        matched = _match_dims(base, size, stride)
        placements: list[Placement] = []
        for p in spec.placements:
            if type(p) is Shard:
                if p.dim not in matched or size[matched.index(p.dim)] != base.size(p.dim):
                    raise ValueError(f"sharded dim {p.dim} is not kept whole")
                placements.append(Shard(matched.index(p.dim)))
            elif p.is_replicate() or p.is_partial():
                placements.append(p)
            else:
                raise ValueError(f"placement {p!r} is not supported")
    except ValueError as err:
        raise RuntimeError(
            f"aten.as_strided: size {size}, stride {stride}, offset {offset} of a DTensor of "
            f"shape {tuple(base.shape)}, stride {base.stride()}, placements "
            f"{tuple(spec.placements)} on {spec.mesh} is not a view of each shard ({err})"
        ) from None
    sharded = {p.dim for p in spec.placements if type(p) is Shard}
    local_size = [n if i not in sharded else local.size(i) for n, i in zip(size, matched)]
    local_stride = [st if i is None else local.stride(i) for st, i in zip(stride, matched)]
    out = local.as_strided(
        local_size, local_stride, local.storage_offset() if offset is None else offset
    )
    out_spec = make_spec(spec.mesh, placements, size, stride, base.dtype)
    return new_dtensor(out, out_spec, requires_grad=False)
