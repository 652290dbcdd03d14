"""Indexed writes: ``index_add``, ``index_put`` and the in-place ``scatter_`` / ``index_put_`` /
``index_add_`` on any placement.

``index_add(self, dim, index, source)`` (upstream has no strategy; its decomposition gave
wrong values on ``Partial`` sources and failed on sharded ones) runs without communication,
per mesh dim, when

* everything is ``Replicate``;
* ``self`` and ``source`` are ``Shard(d)`` on the same dim ``d != dim`` (their sizes on ``d``
  are equal, so the chunks align), ``index`` replicated: the output is ``Shard(d)``;
* ``self`` and ``source`` are ``Partial`` (sum), ``index`` replicated: the sum is linear;
* ``self`` is ``Partial``, ``index`` is ``Shard(0)`` and ``source`` ``Shard(dim)``: each rank adds
  its own entries, the output is ``Partial`` (the gradient of a sharded gather).

``index_put``: autograd's backward passes its zero values as a plain tensor, and users index
with plain tensors; plain tensors among its indices and values are taken as replicated.

In-place ops for which sharding propagation finds no layout (their strategies must keep
``self``'s placements) while it lays out their out-of-place twin other than ``self`` run out
of place, and the result is redistributed back into ``self``'s local shard (a local slice
when the result is replicated over ``self``'s sharded dims; explicit mode applies).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._torch_compat import (
    OpSchema,
    OpStrategy,
    expand_to_full_mesh_op_strategy,
)
from vescale.dtensor.dtensor import from_local
from vescale.dtensor.explicit import redistribute_for
from vescale.dtensor.hooks import (
    bypass_dispatch,
    output_spec,
    pre_dispatch_patch,
    python_dispatch,
)
from vescale.dtensor.inflight import wait_local
from vescale.dtensor.op_args import bind, unbind
from vescale.dtensor.ops._registry import register_strategy
from vescale.dtensor.placement_types import Partial, Placement, Replicate, Shard
from vescale.dtensor.propagation import UnsupportedOpError

__all__ = [
    "in_place_via_out_of_place",
    "index_add_strategy",
    "moves_self",
    "replicate_plain_tensors",
]

aten = torch.ops.aten

# in-place op -> its out-of-place twin
OUT_OF_PLACE = {
    aten.scatter_.src: aten.scatter.src,
    aten.scatter_.value: aten.scatter.value,
    aten.scatter_.reduce: aten.scatter.reduce,
    aten.scatter_.value_reduce: aten.scatter.value_reduce,
    aten.scatter_add_.default: aten.scatter_add.default,
    aten.index_put_.default: aten.index_put.default,
    aten.index_add_.default: aten.index_add.default,
}


@register_strategy([aten.index_add.default, aten.index_add_.default])
def index_add_strategy(schema: OpSchema) -> Any:
    """out from (self, index, source); see module docstring."""
    self_strategy = schema.args_schema[0]
    assert isinstance(self_strategy, OpStrategy)
    ndim = self_strategy.ndim
    dim = int(schema.args_schema[1]) % max(ndim, 1)  # type: ignore[call-overload]
    strategies: list[list[Placement | None]] = [
        [Replicate()] * 4,
        [Partial()] * 2 + [Replicate(), Partial()],
    ]
    strategies += [[Shard(d), Shard(d), Replicate(), Shard(d)] for d in range(ndim) if d != dim]
    strategies.append([Partial(), Partial(), Shard(0), Shard(dim)])
    return expand_to_full_mesh_op_strategy(
        schema.get_mesh_from_args(),
        schema,
        strategies,
        input_index=1,
        inplace_op=schema.is_inplace_op(),
    )


def _replicated(t: Any, mesh: Any) -> Any:
    if isinstance(t, torch.Tensor) and not isinstance(t, _UpstreamDTensor):
        return from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False, support_uneven=False)
    return t


@pre_dispatch_patch(
    [aten.index_put.default, aten.index_put_.default],
    when=lambda op, a, kw: isinstance(bind(op, a, kw)["self"], _UpstreamDTensor),
)
def replicate_plain_tensors(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Plain tensors among ``index_put``'s indices and values become Replicate DTensors."""
    a = bind(op, args, kwargs)
    mesh = a["self"].device_mesh
    a["indices"] = [_replicated(i, mesh) for i in a["indices"]]
    a["values"] = _replicated(a["values"], mesh)
    return unbind(op, a)


def moves_self(op: torch._ops.OpOverload, args: Any, kwargs: Any) -> bool:
    """Whether ``op`` must run out of place: sharding propagation lays its result out other
    than ``self``, or finds no layout for it (its strategies must keep ``self``'s placements)
    and lays out its out-of-place twin other than ``self``. Anything else (``op`` keeps
    ``self``'s layout, has no strategy at all, or its twin fails too) leaves ``op`` to run, and
    report, as it is."""
    self = bind(op, args, kwargs)["self"]
    if not isinstance(self, _UpstreamDTensor):
        return False
    try:
        # upstream propagates some in-place ops through their decomposition, laying the result
        # out other than ``self`` while the kernel writes ``self``'s local tensor
        return tuple(output_spec(op, args, kwargs).placements) != tuple(self.placements)
    except UnsupportedOpError:
        return False
    except RuntimeError:
        pass
    try:
        out = output_spec(OUT_OF_PLACE[op], args, kwargs)
    except RuntimeError:
        return False
    return tuple(out.placements) != tuple(self.placements)


@bypass_dispatch(list(OUT_OF_PLACE), when=moves_self)
def in_place_via_out_of_place(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The out-of-place twin of ``op``, redistributed back into ``self`` (module docstring)."""
    self = bind(op, args, kwargs)["self"]
    out = python_dispatch(OUT_OF_PLACE[op], args, kwargs)
    out = redistribute_for(op, out, self.placements)
    self._local_tensor.copy_(wait_local(out._local_tensor))
    return self
