"""Ops on ``RaggedShard`` inputs (:mod:`vescale.dtensor.ragged`): element-wise ops, the
optimizers' foreach ops, and reductions to a value (sum, mean, vector norms).

A RaggedShard's local tensor is the rank's 1-D slice of the flattened storage, so

* element-wise ops (upstream's ``pointwise``-tagged ops and their in-place variants,
  ``_foreach_*`` element-wise ops, ``*_like`` factories, ``copy_``, ``fill_``, ``zero_``,
  ``_to_copy``, the fused Adam(W) kernels) run on the slices as they are, for inputs laid
  out alike: per position (per list entry of a foreach op) every tensor has the same
  placements and shape, or is a 0-d scalar (broadcast; a pending one, e.g. a norm in its
  backward, is reduced first: one all-reduce), or is a ``Replicate`` tensor of the same
  shape (sliced locally, no communication). The output has the input's placements; in-place
  ops write the slices. A position with no RaggedShard (a foreach list mixing layouts)
  follows the same rule with its own layout.
* ``sum``/``mean``/``linalg_vector_norm``/``_foreach_norm`` over every dim reduce each slice
  and leave the cross-rank reduction pending: ``Partial("sum")`` (a mean divides by the
  global numel), upstream's ``_NormPartial(p)`` (finite ``p > 0``) or
  :class:`ExtremumNormPartial` (``±inf``; an empty slice contributes the identity) on every
  sharded mesh dim, so ``full_tensor()`` or the next op needing the value all-reduces once.
  Over trailing dims only (never a flattened dim) with no other sharded mesh dim, the result
  keeps a RaggedShard with the same units (rows stay on their ranks, no communication).

Every other op, and any other layout, raises ``UnsupportedOpError`` naming the op, the
placements and the mesh, and saying to redistribute first: ops without a rule at the sharding
rule's gate (the registry's rules for inputs holding a RaggedShard, :func:`vescale.dtensor.ops._registry.register_rule`), ops with a dispatch handler
of their own (random ops, ``topk``, ...) before that handler runs (a pre-dispatch patch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor
from torch.distributed.tensor._ops._math_ops import _NormPartial

from vescale._torch_compat import DTensorSpec, OpSchema, OutputSharding, TensorMeta
from vescale.dtensor.dtensor import new_dtensor
from vescale.dtensor.op_args import bind, unbind
from vescale.dtensor.ops import norm as _norm
from vescale.dtensor.ops._registry import (
    PROPAGATOR,
    bypass_dispatch,
    hooks_of,
    on_hooks_changed,
    pre_dispatch_patch,
    register_rule,
    unregister_pre_dispatch_patch,
)
from vescale.dtensor.placement_types import ExtremumNormPartial, Partial, Placement, Replicate
from vescale.dtensor.propagation import UnsupportedOpError
from vescale.dtensor.ragged import RaggedShard, find_ragged
from vescale.dtensor.random import INPLACE_RANDOM_OPS

__all__ = ["ELEMENTWISE_OPS", "REDUCTION_OPS", "ragged_reduction"]

aten = torch.ops.aten

_NOT_ELEMENTWISE = {"_foreach_norm", "_foreach_max", "_foreach_mm", "_foreach_powsum"}
_EXTRA = [
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.copy_.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    aten._to_copy.default,
    aten._fused_adam_.default,
    aten._fused_adam_.tensor_lr,
    aten._fused_adamw_.default,
    aten._fused_adamw_.tensor_lr,
]


def _elementwise_ops() -> list[torch._ops.OpOverload]:
    ops = [*PROPAGATOR.op_strategy_funcs, *PROPAGATOR.op_single_dim_strategy_funcs]
    found = [
        op
        for op in ops
        if torch.Tag.nondeterministic_seeded not in op.tags
        and (
            torch.Tag.pointwise in op.tags
            or (
                op.__name__.startswith("_foreach_")
                and op.__name__.split(".")[0].rstrip("_") not in _NOT_ELEMENTWISE
            )
        )
    ]
    return list(dict.fromkeys([*found, *filter(None, map(_in_place, found)), *_EXTRA]))


def _in_place(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The in-place variant of a pointwise op (``masked_fill_`` of ``masked_fill``)."""
    name, overload = op.__name__.split(".")
    packet = getattr(aten, f"{name}_", None) if not name.endswith("_") else None
    return getattr(packet, overload, None) if packet is not None else None


ELEMENTWISE_OPS = _elementwise_ops()
"""The element-wise ops a RaggedShard input may take."""


# ---- element-wise ops (a sharding rule: cached, the local op runs on the slices) ----------


def _describe(specs: Sequence[DTensorSpec]) -> str:
    return ", ".join(f"{tuple(s.placements)} {list(s.shape)}" for s in specs)


def _unsupported(op: Any, specs: Sequence[DTensorSpec], why: str) -> UnsupportedOpError:
    return UnsupportedOpError(
        f"{op}: {why} (inputs {_describe(specs)} on {specs[0].mesh}); redistribute the inputs "
        f"to one layout first (x.redistribute(mesh, placements))"
    )


def _is_scalar(spec: DTensorSpec) -> bool:
    return spec.ndim == 0 and all(p.is_replicate() for p in spec.placements)


def _positions(schema: OpSchema) -> int:
    """The number of list entries of a foreach op (1 for other ops)."""
    lists = [a for a in schema.args_schema if isinstance(a, list | tuple) and a]
    lists = [a for a in lists if any(isinstance(x, DTensorSpec) for x in a)]
    return len(lists[0]) if lists else 1


def _at(arg: Any, i: int) -> Any:
    return arg[i] if isinstance(arg, list | tuple) and arg else arg


def _layout(schema: OpSchema, i: int) -> DTensorSpec:
    """The layout of position ``i``: self's if it is a tensor, else the first RaggedShard
    input's, else the first tensor's that is no 0-d scalar."""
    specs = [s for a in schema.args_schema if isinstance(s := _at(a, i), DTensorSpec)] + [
        v for v in schema.kwargs_schema.values() if isinstance(v, DTensorSpec)
    ]
    first = _at(schema.args_schema[0], i)
    if isinstance(first, DTensorSpec) and (schema.is_inplace_op() or find_ragged(first.placements)):
        return first
    ragged = [s for s in specs if find_ragged(s.placements)]
    full = [s for s in specs if not _is_scalar(s)]
    return (ragged or full or specs)[0]


def _fit(
    op: Any, spec: DTensorSpec, layout: DTensorSpec, all_specs: list[DTensorSpec]
) -> DTensorSpec:
    """The spec ``spec`` must take to join ``layout`` (itself when it already fits)."""
    if spec.placements == layout.placements and spec.shape == layout.shape:
        if any(p.is_partial() for p in spec.placements):
            raise _unsupported(op, all_specs, "Partial inputs are not element-wise here")
        return spec
    if _is_scalar(spec):
        return spec
    if spec.ndim == 0:  # a pending 0-d value (a norm, a sum): reduced first
        return DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, tensor_meta=spec.tensor_meta)
    if spec.shape == layout.shape and all(p.is_replicate() for p in spec.placements):
        return DTensorSpec(spec.mesh, layout.placements, tensor_meta=spec.tensor_meta)
    raise _unsupported(
        op,
        all_specs,
        f"an input laid out as {tuple(spec.placements)} {list(spec.shape)} does not match "
        f"{tuple(layout.placements)} {list(layout.shape)}: element-wise ops on RaggedShard "
        f"take equal layouts, 0-d Replicate scalars or Replicate tensors of the same shape",
    )


def _replace(arg: Any, i: int, n: int, new: DTensorSpec) -> Any:
    if isinstance(arg, list | tuple) and len(arg) == n and n and isinstance(arg[i], DTensorSpec):
        out = list(arg)
        out[i] = new
        return type(arg)(out)
    return new


def _output_spec(
    op: Any, meta: Any, layout: DTensorSpec, specs: list[DTensorSpec]
) -> DTensorSpec | None:
    if meta is None:
        return None
    if tuple(meta.shape) != tuple(layout.shape):
        raise _unsupported(
            op, specs, f"the output shape {list(meta.shape)} is not the inputs' (a broadcast)"
        )
    return DTensorSpec(layout.mesh, layout.placements, tensor_meta=meta)


@register_rule(ELEMENTWISE_OPS, placement=RaggedShard)
def _elementwise(schema: OpSchema) -> OutputSharding:
    """Element-wise ops on equally laid out inputs (see the module doc)."""
    n = _positions(schema)
    args = list(schema.args_schema)
    kwargs = dict(schema.kwargs_schema)
    every = [
        s
        for a in [*args, *kwargs.values()]
        for s in (a if isinstance(a, list | tuple) else [a])
        if isinstance(s, DTensorSpec)
    ]
    moved = False
    layouts = []
    for i in range(n):
        layout = _layout(schema, i)
        layouts.append(layout)
        for k, a in enumerate(args):
            spec = _at(a, i)
            if isinstance(spec, DTensorSpec):
                fit = _fit(schema.op, spec, layout, every)
                if fit is not spec:
                    if k == 0 and schema.is_inplace_op():
                        raise _unsupported(
                            schema.op, every, "an in-place op's self must hold the layout"
                        )
                    args[k] = _replace(args[k], i, n, fit)
                    moved = True
        for name, v in kwargs.items():
            if isinstance(v, DTensorSpec):
                fit = _fit(schema.op, v, layout, every)
                moved, kwargs[name] = moved or fit is not v, fit
    meta = PROPAGATOR._propagate_tensor_meta_non_cached(schema)
    out: Any
    if schema.op.__name__.startswith("_foreach_"):
        out = (
            None
            if meta is None
            else [_output_spec(schema.op, m, layouts[i], every) for i, m in enumerate(meta)]
        )
    elif isinstance(meta, list | tuple) and not isinstance(meta, TensorMeta):
        out = tuple(_output_spec(schema.op, m, layouts[0], every) for m in meta)
    else:
        out = _output_spec(schema.op, meta, layouts[0], every)
    if not moved:
        return OutputSharding(out)
    suggestion = OpSchema(schema.op, tuple(args), kwargs, schema_info=schema.schema_info)
    return OutputSharding(out, redistribute_schema=suggestion, needs_redistribute=True)


# ---- reductions to a value (a dispatch handler: the local kernel differs) ---------------

REDUCTION_OPS = [
    aten.sum.default,
    aten.sum.dim_IntList,
    aten.mean.default,
    aten.mean.dim,
    aten.linalg_vector_norm.default,
    aten._foreach_norm.Scalar,
]
"""The reductions a RaggedShard input may take (every dim, or trailing dims only)."""


def _ragged_tensor(x: Any) -> bool:
    return isinstance(x, _UpstreamDTensor) and find_ragged(x._spec.placements) is not None


def _ragged_input(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    first = args[0] if args else kwargs.get("self")
    items = first if isinstance(first, list | tuple) else [first]
    return any(_ragged_tensor(x) for x in items)


def _pending(ord_: float | None) -> Placement:
    """The cross-rank reduction a local result leaves pending."""
    if ord_ is None:
        return Partial("sum")
    if math.isinf(ord_):
        return ExtremumNormPartial(ord_)
    return _NormPartial(ord_)


def _local_full(op: Any, local: torch.Tensor, a: dict[str, Any], numel: int) -> torch.Tensor:
    """This rank's part of the reduction over every dim, a 0-d tensor."""
    dtype = a.get("dtype")
    if op in (aten.sum.default, aten.sum.dim_IntList):
        return local.sum(dtype=dtype)
    if op in (aten.mean.default, aten.mean.dim):
        return local.sum(dtype=dtype) / numel
    order = float(a["ord"])
    if local.numel() == 0 and math.isinf(order):  # the identity of max (min) of norms
        value = 0.0 if order > 0 else math.inf
        return torch.full((), value, dtype=dtype or local.abs().dtype, device=local.device)
    return torch.linalg.vector_norm(local, order, dtype=dtype)


def _check_order(op: Any, x: _UpstreamDTensor, order: float) -> None:
    if not (order > 0 or order == -math.inf):
        raise UnsupportedOpError(
            f"{op}: ord={order} on a RaggedShard input ({tuple(x.placements)} "
            f"{list(x.shape)} on {x.device_mesh}) is not supported (ord > 0 or ±inf are); "
            f"redistribute it to Shard/Replicate first"
        )


def _meta_result(op: Any, x: _UpstreamDTensor, a: dict[str, Any]) -> torch.Tensor:
    """The op on a meta tensor of the global shape: torch's own argument errors (the same on
    every rank), and the output's shape and dtype."""
    meta = torch.empty(x.shape, dtype=x.dtype, device="meta")
    if op is aten._foreach_norm.Scalar:
        return torch.linalg.vector_norm(meta, a["ord"], dtype=a["dtype"])
    args, kwargs = unbind(op, dict(a, self=meta))
    return op(*args, **kwargs)  # type: ignore[no-any-return]


def _reduce_one(op: Any, x: _UpstreamDTensor, a: dict[str, Any]) -> _UpstreamDTensor:
    expected = _meta_result(op, x, a)
    spec, ndim = x._spec, x.ndim
    if any(p.is_partial() for p in spec.placements):
        raise _reduction_error(op, x, "a Partial input")
    dims = a.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    reduced = sorted({d % ndim for d in dims}) if dims else list(range(ndim))
    order = float(a["ord"]) if "ord" in a else None
    if order is not None:
        _check_order(op, x, order)
    if reduced == list(range(ndim)):  # a pending reduction of this rank's part
        local = _local_full(op, x._local_tensor, a, x.numel()).reshape(expected.shape)
        placements = tuple(p if p.is_replicate() else _pending(order) for p in spec.placements)
    else:  # each rank's rows reduced: the result keeps the RaggedShard
        local = _local_trailing(op, x, a, reduced).reshape(-1)
        placements = spec.placements
    return _wrap(local.to(expected.dtype), spec, placements, expected.shape)


def _reduction_error(op: Any, x: _UpstreamDTensor, what: str) -> UnsupportedOpError:
    return UnsupportedOpError(
        f"{op}: {what} is not supported on a RaggedShard input ({tuple(x.placements)} "
        f"{list(x.shape)} on {x.device_mesh}): reduce every dim, or trailing dims with no "
        f"other sharded mesh dim; redistribute it to Shard/Replicate first"
    )


def _local_trailing(
    op: Any, x: _UpstreamDTensor, a: dict[str, Any], reduced: list[int]
) -> torch.Tensor:
    """Reduce dims after the flattened ones: each rank reduces its own rows."""
    found = find_ragged(x._spec.placements)
    assert found is not None
    dims = len(found[1].dims)
    others = [q for q in x._spec.placements if not isinstance(q, RaggedShard)]
    if any(not q.is_replicate() for q in others) or min(reduced) < dims:
        raise _reduction_error(op, x, f"reducing dims {reduced}")
    rows = x._local_tensor.reshape(-1, *x.shape[dims:])
    local_dims = [d - dims + 1 for d in reduced]
    if op in (aten.sum.dim_IntList, aten.mean.dim):
        value = torch.sum(rows, local_dims, dtype=a["dtype"])
        return value / math.prod(x.shape[d] for d in reduced) if op is aten.mean.dim else value
    return torch.linalg.vector_norm(rows, float(a["ord"]), local_dims, dtype=a["dtype"])


def _wrap(
    local: torch.Tensor, spec: DTensorSpec, placements: Sequence[Placement], shape: Sequence[int]
) -> _UpstreamDTensor:
    stride = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    out_spec = DTensorSpec(spec.mesh, tuple(placements), tensor_meta=meta)
    return new_dtensor(local, out_spec, requires_grad=local.requires_grad)


def ragged_reduction(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``sum``/``mean``/``linalg_vector_norm``/``_foreach_norm`` with a RaggedShard input
    (see the module doc); a foreach list's other tensors are reduced by the op as usual."""
    a = bind(op, args, kwargs)
    if op is not aten._foreach_norm.Scalar:
        return _reduce_one(op, a["self"], a)
    tensors = list(a["self"])
    rest = [i for i, t in enumerate(tensors) if not _ragged_tensor(t)]
    others = op([tensors[i] for i in rest], a["ord"], a["dtype"]) if rest else []
    out = [None if i in rest else _reduce_one(op, t, a) for i, t in enumerate(tensors)]
    for i, r in zip(rest, others):
        out[i] = r
    return out


@bypass_dispatch(REDUCTION_OPS[:4], when=_ragged_input)
def _sums(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return ragged_reduction(op, args, kwargs)


def _norm_applies(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return _ragged_input(op, args, kwargs) or _norm._infinite(op, args, kwargs)


@bypass_dispatch(_norm.INF_NORMS, when=_norm_applies)
def _norms(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Norms with a RaggedShard input here; other infinity norms as
    :func:`vescale.dtensor.ops.norm.inf_norm_without_empty_shards` handles them (one bypass
    handler per op: this one replaces and composes norm.py's)."""
    if _ragged_input(op, args, kwargs):
        return ragged_reduction(op, args, kwargs)
    return _norm.inf_norm_without_empty_shards(op, args, kwargs)


# ---- ops whose own dispatch handler would see a RaggedShard input ---------------------

_RAGGED_AWARE = {*REDUCTION_OPS, *INPLACE_RANDOM_OPS}
_guarded: set[Any] = set()


def _any_ragged(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    items = [*args, *kwargs.values()]
    return any(
        _ragged_tensor(x) for a in items for x in (a if isinstance(a, list | tuple) else [a])
    )


def _reject(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors = [
        x
        for a in [*args, *kwargs.values()]
        for x in (a if isinstance(a, list | tuple) else [a])
        if isinstance(x, _UpstreamDTensor)
    ]
    inputs = ", ".join(f"{tuple(t.placements)} {list(t.shape)}" for t in tensors)
    raise UnsupportedOpError(
        f"{op}: not supported on RaggedShard inputs ({inputs} on {tensors[0].device_mesh}); "
        f"redistribute them to Shard/Replicate first (x.redistribute(mesh, placements))"
    )


def _guard(op: Any) -> None:
    """A handler of ``op``'s own (not RaggedShard-aware) is preceded by :func:`_reject`, for
    as long as the handler is there."""
    hooks = hooks_of(op)
    if op in _RAGGED_AWARE:
        return
    handled = hooks is not None and (hooks.bypass is not None or hooks.prop is not None)
    if handled and op not in _guarded:
        _guarded.add(op)
        pre_dispatch_patch(op, when=_any_ragged)(_reject)
    elif not handled and op in _guarded:
        _guarded.discard(op)
        unregister_pre_dispatch_patch(op, _reject)


on_hooks_changed(_guard)


@register_rule([aten.detach.default, aten.alias.default], placement=RaggedShard)
def _same_layout(schema: OpSchema) -> OutputSharding:
    """Ops whose output is their input's data as laid out (``nn.Parameter`` detaches)."""
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    return OutputSharding(DTensorSpec(spec.mesh, spec.placements, tensor_meta=spec.tensor_meta))
