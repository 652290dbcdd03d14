"""Dispatch hooks at run time: the per-op handlers and patches declared in the op registry
(:mod:`vescale.dtensor.ops._registry`, which also says when to use which), for ops with a
vescale input.

Hooks live in upstream's per-op handler table (``OpDispatcher._custom_op_handlers``), which
the C++ dispatcher consults for every op: an op without a vescale hook keeps upstream's
C++ fast path and pays nothing. A hooked op runs:

    pre_dispatch_patch* -> (bypass_dispatch | dispatch with bypass_sharding_prop) -> post_dispatch_patch*

Each hook's ``when=`` predicate is called with the hook's own arguments; where it is false
the hook does not apply (a patch is skipped; a bypass handler's op runs
:func:`python_dispatch`, DTensor's dispatch steps with the op's sharding-propagation bypass
if any; a sharding-propagation bypass leaves the strategy search to upstream). Handlers thus
hold only the case they handle.

Scope: hooks apply to ops with a ``vescale.DTensor`` input; on upstream DTensors the op runs
as upstream runs it. On ranks outside the op's mesh no handler runs (upstream's rule: empty
local results, no communication, :mod:`vescale.dtensor.off_mesh`) unless it is registered
with ``off_mesh=True``. The decorators are the registry's, re-exported here with veScale's
legacy names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale import _patches
from vescale._torch_compat import (
    DTensorSpec,
    OpSchema,
    OutputSharding,
    TensorMeta,
    compute_global_tensor_info,
    return_and_correct_aliasing,
)
from vescale.dtensor.dtensor import DTensor
from vescale.dtensor.off_mesh import off_mesh_result, op_mesh
from vescale.dtensor.ops._registry import (
    PROPAGATOR,
    bypass_dispatch,
    bypass_sharding_prop,
    hooks_of,
    on_hooks_changed,
    post_dispatch_patch,
    pre_dispatch_patch,
    unregister_bypass_dispatch,
    unregister_bypass_sharding_prop,
    unregister_post_dispatch_patch,
    unregister_pre_dispatch_patch,
)
from vescale.dtensor.placement_types import Placement
from vescale.dtensor.propagation import mark_vescale

__all__ = [
    "_bypass_for_dispatch",
    "_bypass_for_sharding_prop",
    "_post_patch_for_dispatch",
    "_pre_patch_for_dispatch",
    "bypass_dispatch",
    "bypass_sharding_prop",
    "has_vescale_input",
    "output_spec",
    "post_dispatch_patch",
    "pre_dispatch_patch",
    "python_dispatch",
    "unregister_bypass_dispatch",
    "unregister_bypass_sharding_prop",
    "unregister_post_dispatch_patch",
    "unregister_pre_dispatch_patch",
]

OpOverload = torch._ops.OpOverload
Handler = Callable[[OpOverload, tuple[Any, ...], dict[str, Any]], Any]
PropFn = Callable[[OpSchema], Any]

_dispatcher = _UpstreamDTensor._op_dispatcher
_handlers: dict[OpOverload, Any] = _dispatcher._custom_op_handlers
_upstream_handlers: dict[OpOverload, Any] = dict(_handlers)
_HANDLERS = "OpDispatcher._custom_op_handlers"


def _install(op: OpOverload) -> None:
    """Point the upstream handler table (through the seam) at the composition of ``op``'s
    hooks, scoped to ops with a vescale input; upstream's entry where it has none."""
    hooks = hooks_of(op)
    if hooks is None:
        _patches.restore_entry(_handlers, op)
        return
    bypass = hooks.bypass
    alone = bypass is not None and bypass.when is None and not hooks.pre and not hooks.post
    fn = bypass.fn if alone and bypass is not None else _hooked
    why = "vescale hooks (ops with a vescale.DTensor input)"
    _patches.set_entry(_handlers, _HANDLERS, op, _outside_dynamo(_scoped(fn)), why)


def has_vescale_input(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether an op's arguments include a ``vescale.DTensor`` (directly or in a list)."""
    for a in args:
        if isinstance(a, DTensor):
            return True
        if isinstance(a, list | tuple) and any(isinstance(x, DTensor) for x in a):
            return True
    return any(isinstance(v, DTensor) for v in kwargs.values())


def _upstream_op(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``op`` as upstream runs it: its own handler, else its dispatch steps."""
    handler = _upstream_handlers.get(op)
    return handler(op, args, kwargs) if handler else python_dispatch(op, args, kwargs)


def _scoped(fn: Handler) -> Handler:
    """``fn`` for ops with a vescale input on ranks of the op's mesh (and elsewhere for
    handlers registered with ``off_mesh=True``); upstream's behaviour for all others."""

    def scoped(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not has_vescale_input(args, kwargs):
            return _upstream_op(op, args, kwargs)
        hooks = hooks_of(op)
        own_off_mesh = hooks is not None and hooks.off_mesh
        if not own_off_mesh and not op_mesh(args, kwargs)._is_current_rank_part_of_mesh():
            data_dependent = hooks is not None and hooks.prop is not None
            return off_mesh_result(op, args, kwargs, data_dependent=data_dependent)
        return fn(op, args, kwargs)

    return scoped


def _outside_dynamo(fn: Handler) -> Handler:
    """``fn`` run as plain Python even while a compiled function executes: Dynamo would
    otherwise compile a handler's own frames (vescale is not on its skip list) when an op
    runs eagerly inside a ``torch.compile`` call, e.g. around a graph break."""
    return torch.compiler.disable(fn, recursive=True)  # type: ignore[no-any-return]


def _propagate(op: OpOverload) -> PropFn | None:
    """``op``'s sharding-propagation bypass (``NotImplemented`` where its ``when`` is false)."""
    hooks = hooks_of(op)
    hook = hooks.prop if hooks is not None else None
    if hook is None:
        return None
    return lambda schema: hook.fn(schema) if hook.applies(schema) else NotImplemented


@torch.compiler.disable(recursive=True)
def _hooked(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    hooks = hooks_of(op)
    assert hooks is not None  # installed only while the op has hooks
    for pre in hooks.pre:
        if pre.applies(op, args, kwargs):
            args, kwargs = pre.fn(op, args, kwargs)
    bypass = hooks.bypass
    if bypass is not None and bypass.applies(op, args, kwargs):
        out = bypass.fn(op, args, kwargs)
    elif bypass is not None or hooks.prop is not None or op not in _upstream_handlers:
        out = python_dispatch(op, args, kwargs, _propagate(op))
    else:
        out = _upstream_handlers[op](op, args, kwargs)
    for post in hooks.post:
        if post.applies(op, out):
            out = post.fn(op, out)
    return out


def _meta_from_local(local: Any, spec: DTensorSpec) -> DTensorSpec:
    if spec.tensor_meta is not None or not isinstance(local, torch.Tensor):
        return spec
    shape, stride = compute_global_tensor_info(local, spec.mesh, spec.placements)
    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta)


def _as_output_spec(out: Any, mesh: Any) -> Any:
    if out is None or isinstance(out, DTensorSpec):
        return out
    if isinstance(out, list | tuple) and out and all(isinstance(p, Placement) for p in out):
        return DTensorSpec(mesh, tuple(out))
    if isinstance(out, list | tuple):
        return tuple(_as_output_spec(o, mesh) for o in out)
    raise TypeError(f"bypass_sharding_prop: expected placements or DTensorSpec(s), got {out!r}")


def python_dispatch(
    op: OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    propagate: PropFn | None = None,
    *,
    local_op: Callable[..., Any] | None = None,
) -> Any:
    """Upstream's dispatch steps in Python; ``propagate(op_schema)`` replaces the strategy
    search when given and not returning ``NotImplemented`` (its specs may omit tensor meta: it
    is then taken from the local result, assuming even shards); ``local_op`` replaces ``op``
    on the local tensors (e.g. run at per-shard random offsets)."""
    op_info = _dispatcher.unwrap_to_op_info(op, args, kwargs)
    mesh, schema = op_info.compute_mesh, op_info.schema
    assert schema is not None  # unwrap_to_op_info always builds the schema
    proposed = NotImplemented if propagate is None else propagate(schema)
    if proposed is NotImplemented:
        propagate = None
        PROPAGATOR.propagate(op_info)
    else:
        out_spec = _as_output_spec(proposed, mesh)
        if has_vescale_input(args, kwargs):
            out_spec = mark_vescale(out_spec)
        op_info.output_sharding = OutputSharding(out_spec)
    call: Any = local_op or op  # upstream calls it on the local tensors (and hashes it)
    local: Any = _dispatcher._dispatch_get_local_results_slow_path(call, args, op_info)
    sharding = op_info.output_sharding
    assert sharding is not None
    if propagate is not None:
        spec = sharding.output_spec
        if isinstance(spec, DTensorSpec):
            sharding.output_spec = _meta_from_local(local, spec)
        elif isinstance(spec, tuple):
            sharding.output_spec = tuple(
                _meta_from_local(r, s) if isinstance(s, DTensorSpec) else s
                for r, s in zip(local, spec)
            )
    participating = mesh._is_current_rank_part_of_mesh()
    inplace, out_variant = schema.is_inplace_op(), schema.is_out_variant_op()
    if sharding.output_spec is None or inplace or out_variant:
        return _dispatcher._dispatch_fast_path_python_tail(
            op, args, kwargs, mesh, sharding, local, participating, inplace, out_variant
        )
    out = _dispatcher.wrap(local, sharding.output_spec)
    if participating and op._schema._is_view_op():
        return return_and_correct_aliasing(op, args, kwargs, out)
    return out


def output_spec(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Sharding propagation's output spec(s) for ``op`` on these arguments (nothing runs)."""
    op_info = _dispatcher.unwrap_to_op_info(op, args, kwargs)
    PROPAGATOR.propagate(op_info)
    assert op_info.output_sharding is not None
    return op_info.output_sharding.output_spec


on_hooks_changed(_install)

# veScale's legacy names.
_bypass_for_dispatch = bypass_dispatch
_pre_patch_for_dispatch = pre_dispatch_patch
_post_patch_for_dispatch = post_dispatch_patch
_bypass_for_sharding_prop = bypass_sharding_prop
