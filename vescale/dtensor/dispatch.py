"""Dispatch extension points and the explicit-redistribution mode.

Hooks live in upstream's per-op handler table (``OpDispatcher._custom_op_handlers``), which
the C++ dispatcher consults for every op: an op without a vescale hook keeps upstream's
C++ fast path and pays nothing. A hooked op runs:

    pre_dispatch_patch* -> (bypass_dispatch | dispatch with bypass_sharding_prop) -> post_dispatch_patch*

Scope: hooks apply to ops with a ``vescale.DTensor`` input; on upstream DTensors the op runs
as upstream runs it. On ranks outside the op's mesh no handler runs (upstream's rule: empty
local results, no communication) unless it is registered with ``off_mesh=True``. Likewise vescale-only propagation rules (:func:`vescale_propagation_rule`,
and strategies that consult ``vescale_rules_active()``) apply only while an op with a vescale
input propagates.

Explicit mode (``VESCALE_DISABLE_REDISTRIBUTE``, default ``"1"``, or
:func:`explicit_redistribute`): an op whose vescale inputs would need a redistribution that
communicates raises ``RuntimeError`` naming the op, the input placements and the placements
the strategy wanted (upstream DTensors keep upstream's implicit redistribution). Local steps
(e.g. Replicate -> Shard) stay allowed; explicit ``redistribute()`` calls always are. The
rule covers the forward, the code users write: inside backward (the autograd engine
running, eager or while AOTAutograd traces it) a redistribution is the adjoint of a layout
the forward chose (e.g. the all-reduce of a column-parallel input's ``Partial`` gradient, or
of cross-entropy's total weight) and no user code could annotate it, so it is allowed;
compiled graphs still list it in ``collectives.json`` with its reason.

The replacements of upstream functions defined here (:func:`propagate_op_sharding`,
:func:`observe_redistribution`, :func:`redistribute_for_dispatch`) are installed by
``vescale._patches``, the one module that changes torch objects.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale import _patches
from vescale._torch_compat import (
    DTensorSpec,
    ExplicitRedistributionContext,
    OpSchema,
    OutputSharding,
    StridedShard,
    TensorMeta,
    compute_global_tensor_info,
    get_proxy_mode,
    redistribute_cost,
    return_and_correct_aliasing,
    upstream_dispatch_module,
)
from vescale.dtensor import api
from vescale.dtensor.dtensor import (
    DTensor,
    VescaleSpec,
    as_vescale_spec,
    is_vescale_spec,
    new_dtensor,
    vescale_rules,
)
from vescale.dtensor.placement_types import (
    Placement,
    Replicate,
    is_private_partial,
    spec_placements,
)
from vescale.dtensor.redistribute import redistribute_local_tensor, strided_communicates

__all__ = [
    "ImplicitRedistributionError",
    "UnsupportedOpError",
    "_bypass_for_dispatch",
    "_bypass_for_sharding_prop",
    "_post_patch_for_dispatch",
    "_pre_patch_for_dispatch",
    "bypass_dispatch",
    "bypass_sharding_prop",
    "explicit_redistribute",
    "explicit_redistribute_enabled",
    "observe_redistribution",
    "plugin_op",
    "post_dispatch_patch",
    "pre_dispatch_patch",
    "propagate_op_sharding",
    "redistribute_for_dispatch",
    "unregister_bypass_dispatch",
    "unregister_bypass_sharding_prop",
    "unregister_post_dispatch_patch",
    "unregister_pre_dispatch_patch",
    "vescale_propagation_rule",
]

OpOverload = torch._ops.OpOverload
Handler = Callable[[OpOverload, tuple[Any, ...], dict[str, Any]], Any]
PrePatch = Callable[
    [OpOverload, tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]
]
PostPatch = Callable[[OpOverload, Any], Any]
PropFn = Callable[[OpSchema], Any]

_dispatcher = _UpstreamDTensor._op_dispatcher
_handlers: dict[OpOverload, Any] = _dispatcher._custom_op_handlers
_upstream_handlers: dict[OpOverload, Any] = dict(_handlers)

_bypass: dict[OpOverload, Handler] = {}
_pre: dict[OpOverload, list[PrePatch]] = {}
_post: dict[OpOverload, list[PostPatch]] = {}
_prop: dict[OpOverload, PropFn] = {}
_own_off_mesh: set[OpOverload] = set()  # bypass handlers that also run off the op's mesh
_HANDLERS = "OpDispatcher._custom_op_handlers"


def _ops(op: OpOverload | Sequence[OpOverload]) -> list[OpOverload]:
    ops: list[Any] = list(op) if isinstance(op, list | tuple) else [op]
    for o in ops:
        if not isinstance(o, OpOverload):
            raise TypeError(
                f"dispatch hook: expected an OpOverload such as torch.ops.aten.mm.default, "
                f"got {o!r}"
            )
    return ops


def _reinstall(op: OpOverload) -> None:
    """Point the upstream handler table (through the seam) at the composition of ``op``'s
    hooks, scoped to ops with a vescale input."""
    if not (op in _bypass or op in _pre or op in _post or op in _prop):
        _patches.restore_entry(_handlers, op)
        return
    fn = _bypass[op] if op in _bypass and op not in _pre and op not in _post else _hooked
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


def _op_mesh(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The mesh of the op's first DTensor input (upstream's compute mesh)."""
    for a in pytree.tree_leaves((args, kwargs)):
        if isinstance(a, _UpstreamDTensor):
            return a.device_mesh
    return None


def _off_mesh(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``op`` on a rank outside its mesh, by upstream's rule (no communication, empty local
    results) without running a handler: the results are Replicate, with the global shapes and
    dtypes of ``op`` on meta tensors of the inputs' global shapes (for ops with a propagation
    bypass, whose output shapes depend on values: of ``op`` on empty inputs); in-place and
    ``out=`` ops return their DTensor."""
    mesh = _op_mesh(args, kwargs)
    empty = op in _prop
    leaves, tree = pytree.tree_flatten((args, kwargs))
    own: dict[int, Any] = {}
    fakes = []
    for a in leaves:
        if isinstance(a, torch.Tensor):
            fake = (
                torch.empty((0,) * a.ndim, dtype=a.dtype)
                if empty
                else torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
            )
            own[id(fake)] = a
            a = fake
        fakes.append(a)
    f_args, f_kwargs = pytree.tree_unflatten(fakes, tree)
    out = op(*f_args, **f_kwargs)

    def wrap(o: Any) -> Any:
        if not isinstance(o, torch.Tensor):
            return o
        if id(o) in own:
            return own[id(o)]
        meta = TensorMeta(o.shape, o.stride(), o.dtype)
        spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=meta)
        local = torch.zeros((), dtype=o.dtype) if o.ndim == 0 else torch.tensor([], dtype=o.dtype)
        return new_dtensor(local, spec, requires_grad=False)

    return pytree.tree_map(wrap, out)


def _scoped(fn: Handler) -> Handler:
    """``fn`` for ops with a vescale input on ranks of the op's mesh (and elsewhere for
    handlers registered with ``off_mesh=True``); upstream's behaviour for all others."""

    def scoped(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not has_vescale_input(args, kwargs):
            return _upstream_op(op, args, kwargs)
        if op not in _own_off_mesh and not _op_mesh(args, kwargs)._is_current_rank_part_of_mesh():
            return _off_mesh(op, args, kwargs)
        return fn(op, args, kwargs)

    return scoped


def _outside_dynamo(fn: Handler) -> Handler:
    """``fn`` run as plain Python even while a compiled function executes: Dynamo would
    otherwise compile a handler's own frames (vescale is not on its skip list) when an op
    runs eagerly inside a ``torch.compile`` call, e.g. around a graph break."""
    return torch.compiler.disable(fn, recursive=True)  # type: ignore[no-any-return]


@torch.compiler.disable(recursive=True)
def _hooked(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for pre in _pre.get(op, ()):
        args, kwargs = pre(op, args, kwargs)
    if op in _bypass:
        out = _bypass[op](op, args, kwargs)
    elif op in _prop or op not in _upstream_handlers:
        out = python_dispatch(op, args, kwargs, _prop.get(op))
    else:
        out = _upstream_handlers[op](op, args, kwargs)
    for post in _post.get(op, ()):
        out = post(op, out)
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


def _mark_vescale(spec: Any) -> Any:
    """Output spec(s) marked as vescale's (``None`` entries kept)."""
    if isinstance(spec, DTensorSpec):
        return as_vescale_spec(spec)
    if isinstance(spec, list | tuple):
        return type(spec)(_mark_vescale(s) for s in spec)
    return spec


def python_dispatch(
    op: OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    propagate: PropFn | None = None,
) -> Any:
    """Upstream's dispatch steps in Python; ``propagate(op_schema)`` replaces the strategy
    search when given (its specs may omit tensor meta: it is then taken from the local result,
    assuming even shards)."""
    op_info = _dispatcher.unwrap_to_op_info(op, args, kwargs)
    mesh, schema = op_info.compute_mesh, op_info.schema
    assert schema is not None  # unwrap_to_op_info always builds the schema
    if propagate is None:
        _dispatcher.sharding_propagator.propagate(op_info)
    else:
        out_spec = _as_output_spec(propagate(schema), mesh)
        if has_vescale_input(args, kwargs):
            out_spec = _mark_vescale(out_spec)
        op_info.output_sharding = OutputSharding(out_spec)
    local: Any = _dispatcher._dispatch_get_local_results_slow_path(op, args, op_info)
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


def _register(table: dict[OpOverload, Any], op: Any, fn: Any, *, stack: bool) -> Any:
    for o in _ops(op):
        if stack:
            table.setdefault(o, []).append(fn)
        else:
            table[o] = fn
        _reinstall(o)
    return fn


def _unregister(table: dict[OpOverload, Any], op: Any) -> None:
    for o in _ops(op):
        table.pop(o, None)
        _reinstall(o)


def bypass_dispatch(
    op: OpOverload | Sequence[OpOverload], *, off_mesh: bool = False
) -> Callable[[Handler], Handler]:
    """``@bypass_dispatch(op)``: ``handler(op, args, kwargs) -> result`` replaces DTensor
    dispatch. Ranks outside the op's mesh do not run it (they get empty local results and
    communicate nothing), unless ``off_mesh=True``: the handler then runs there too and must
    not communicate (e.g. random ops, which advance the generator on every rank)."""

    def register(fn: Handler) -> Handler:
        _own_off_mesh.difference_update(_ops(op))
        if off_mesh:
            _own_off_mesh.update(_ops(op))
        return _register(_bypass, op, fn, stack=False)  # type: ignore[no-any-return]

    return register


def pre_dispatch_patch(op: OpOverload | Sequence[OpOverload]) -> Callable[[PrePatch], PrePatch]:
    """``@pre_dispatch_patch(op)``: ``fn(op, args, kwargs) -> (args, kwargs)`` runs before dispatch."""
    return lambda fn: _register(_pre, op, fn, stack=True)


def post_dispatch_patch(op: OpOverload | Sequence[OpOverload]) -> Callable[[PostPatch], PostPatch]:
    """``@post_dispatch_patch(op)``: ``fn(op, out) -> out`` runs after dispatch."""
    return lambda fn: _register(_post, op, fn, stack=True)


def bypass_sharding_prop(op: OpOverload | Sequence[OpOverload]) -> Callable[[PropFn], PropFn]:
    """``@bypass_sharding_prop(op)``: ``fn(op_schema) -> output placements or spec(s)``
    replaces the strategy search; the local op still runs on the inputs as they are."""
    return lambda fn: _register(_prop, op, fn, stack=False)


def unregister_bypass_dispatch(op: OpOverload | Sequence[OpOverload]) -> None:
    """Remove ``op``'s bypass handler (upstream behaviour returns)."""
    _own_off_mesh.difference_update(_ops(op))
    _unregister(_bypass, op)


def unregister_pre_dispatch_patch(op: OpOverload | Sequence[OpOverload]) -> None:
    """Remove all of ``op``'s pre-dispatch patches."""
    _unregister(_pre, op)


def unregister_post_dispatch_patch(op: OpOverload | Sequence[OpOverload]) -> None:
    """Remove all of ``op``'s post-dispatch patches."""
    _unregister(_post, op)


def unregister_bypass_sharding_prop(op: OpOverload | Sequence[OpOverload]) -> None:
    """Remove ``op``'s sharding-propagation bypass."""
    _unregister(_prop, op)


def plugin_op(
    kernel: Callable[..., Any],
    out_placements: Sequence[Placement] | Sequence[Sequence[Placement]],
    in_placements: Sequence[Sequence[Placement] | None] | None = None,
    *,
    grad_placements: Sequence[Sequence[Placement] | None] | None = None,
) -> Callable[..., Any]:
    """Run a plain-tensor kernel (APEX-style fused op, C++ extension) on DTensors.

    The kernel receives waited local shards (never ``AsyncCollectiveTensor``), so raw
    pointers (``data_ptr()``) are valid; DTensor positional inputs are first redistributed
    to ``in_placements[i]`` where given. Tensor outputs become DTensors with
    ``out_placements`` (one placement list, or one per output), assumed evenly sharded.
    Autograd flows through the kernel's own autograd; ``grad_placements[i]`` declares the
    layout of input ``i``'s local gradient (default: its placements, Partial -> Replicate).
    """
    multi = bool(out_placements) and not isinstance(out_placements[0], Placement)

    @functools.wraps(kernel)
    def run(*args: Any, **kwargs: Any) -> Any:
        mesh = next((a.device_mesh for a in args if isinstance(a, _UpstreamDTensor)), None)
        if mesh is None:
            return kernel(*args, **kwargs)
        local_args = []
        for i, a in enumerate(args):
            if isinstance(a, _UpstreamDTensor):
                want = in_placements[i] if in_placements is not None else None
                if want is not None and tuple(want) != tuple(a.placements):
                    a = api.redistribute_dtensor(a, mesh, want)
                gp = grad_placements[i] if grad_placements is not None else None
                if isinstance(a, DTensor):  # the method form traces in one graph
                    a = a.to_local(grad_placements=gp, async_output=False)
                else:
                    a = api.to_local(a, grad_placements=gp, async_output=False)
            local_args.append(a)
        out = kernel(*local_args, **kwargs)
        outs = out if multi else (out,)
        layouts = out_placements if multi else (out_placements,)
        wrapped = tuple(
            api.from_local(o, mesh, p, run_check=False, support_uneven=False)  # type: ignore[arg-type]
            if isinstance(o, torch.Tensor)
            else o
            for o, p in zip(outs, layouts)
        )
        return wrapped if multi else wrapped[0]

    return run


# veScale's legacy names.
_bypass_for_dispatch = bypass_dispatch
_pre_patch_for_dispatch = pre_dispatch_patch
_post_patch_for_dispatch = post_dispatch_patch
_bypass_for_sharding_prop = bypass_sharding_prop


# ---- unsupported ops ----------------------------------------------------------------------


class UnsupportedOpError(NotImplementedError):
    """No sharding strategy for an op; names the op, its input placements and the mesh.

    A ``NotImplementedError``, so upstream still decomposes CompositeImplicit ops on it."""


def _describe_inputs(schema: OpSchema) -> str:
    specs = [a for a in schema.args_schema if isinstance(a, DTensorSpec)]
    specs += [v for v in schema.kwargs_schema.values() if isinstance(v, DTensorSpec)]
    inputs = ", ".join(f"{tuple(s.placements)} {list(s.shape)}" for s in specs)
    mesh = specs[0].mesh if specs else None
    return f"inputs {inputs} on {mesh}"


_propagator = _dispatcher.sharding_propagator
_upstream_propagate = _propagator.propagate_op_sharding_non_cached
RuleFn = Callable[[OpSchema], OutputSharding]
_vescale_rules: dict[OpOverload, RuleFn] = {}


def vescale_propagation_rule(op: OpOverload | Sequence[OpOverload]) -> Callable[[RuleFn], RuleFn]:
    """``@vescale_propagation_rule(op)``: ``fn(op_schema) -> OutputSharding`` decides ``op``'s
    sharding when an input is a vescale DTensor (upstream's strategies decide otherwise)."""

    def register(fn: RuleFn) -> RuleFn:
        for o in _ops(op):
            _vescale_rules[o] = fn
        return fn

    return register


def propagate_op_sharding(op_schema: OpSchema) -> OutputSharding:
    """Upstream's sharding propagation (cached by upstream's caches, C++ and Python, keyed
    by the specs), with: vescale's rules and ``VescaleSpec`` outputs for ops with a vescale
    input; and, for every DTensor, a missing strategy as :class:`UnsupportedOpError`."""
    vescale = is_vescale_spec(op_schema.args_schema) or is_vescale_spec(
        op_schema.kwargs_schema.values()
    )
    try:
        with vescale_rules(vescale):
            rule = _vescale_rules.get(op_schema.op) if vescale else None
            out = rule(op_schema) if rule is not None else _upstream_propagate(op_schema)
    except UnsupportedOpError:
        raise
    except NotImplementedError as err:
        raise UnsupportedOpError(
            f"{op_schema.op}: no sharding strategy for {_describe_inputs(op_schema)} "
            f"({err}); redistribute its inputs and call it on local tensors, or register a "
            f"strategy (vescale.dtensor.dispatch.bypass_sharding_prop)"
        ) from err
    if vescale:
        out.output_spec = _mark_vescale(out.output_spec)
    return out  # type: ignore[no-any-return]


# ---- explicit redistribution ------------------------------------------------------------

_explicit = threading.local()


def explicit_redistribute_enabled() -> bool:
    """Whether implicit redistribution is forbidden here (context manager, else env var)."""
    value = getattr(_explicit, "enabled", None)
    if value is None:
        return os.environ.get("VESCALE_DISABLE_REDISTRIBUTE", "1") != "0"
    return bool(value)


@contextlib.contextmanager
def explicit_redistribute(enabled: bool = True) -> Iterator[None]:
    """Forbid (``True``) or allow (``False``) implicit redistribution in this scope and thread,
    overriding ``VESCALE_DISABLE_REDISTRIBUTE``."""
    prev = getattr(_explicit, "enabled", None)
    _explicit.enabled = enabled
    try:
        yield
    finally:
        _explicit.enabled = prev


def _op_of(msg: Any) -> str:
    """The op named by upstream's lazy message (an OpSchema, or the op on the C++ fast path)."""
    subject = getattr(msg, "args", (None,))[0]
    return str(subject if isinstance(subject, OpOverload) else getattr(subject, "op", subject))


class ImplicitRedistributionError(RuntimeError):
    """An op needed a communicating redistribution while explicit mode was on."""


def _traced_user_line() -> str:
    """`` at file.py:line`` of the user code whose graph node AOTAutograd is tracing, if any
    (the check is deferred past Dynamo's own pass, see ``_dynamo_propagating``)."""
    from vescale.fx.collectives import user_line_of_stack

    meta = torch.fx.traceback.get_current_meta() or {}
    line = user_line_of_stack(meta.get("stack_trace") or "")
    return f" at {line}" if line else ""


def _dynamo_propagating() -> bool:
    """Dynamo's fake-tensor pass over the user frame (compiling, no proxy tracer yet).

    The check is deferred from it to the pass that follows with the same dispatch: the
    vescale backend's AOT trace, where its ``explicit`` option is in effect (other backends:
    AOT tracing, or eager dispatch at run time)."""
    return torch.compiler.is_compiling() and get_proxy_mode() is None


_upstream_observe = ExplicitRedistributionContext.observe_redistribution


def observe_redistribution(
    cls: type, src_spec: DTensorSpec, dst_spec: DTensorSpec, redistribution_msg: Any
) -> None:
    """Upstream's observer of implicit redistributions, plus explicit mode for vescale DTensors."""
    if (
        type(src_spec) is VescaleSpec
        # first: cheap for local slices; upstream prices strided-shard steps at 0
        and (redistribute_cost(src_spec, dst_spec) > 0 or strided_communicates(src_spec, dst_spec))
        and explicit_redistribute_enabled()
        and torch._C._current_graph_task_id() == -1  # not inside backward: see module docstring
        and not _dynamo_propagating()
    ):
        op = _op_of(redistribution_msg)
        raise ImplicitRedistributionError(
            f"{op}{_traced_user_line()}: implicit redistribution of an input from {tuple(src_spec.placements)} to "
            f"{tuple(dst_spec.placements)} on {src_spec.mesh} (global shape "
            f"{tuple(src_spec.shape)}) is forbidden: explicit mode is on "
            f"(VESCALE_DISABLE_REDISTRIBUTE=1). Call .redistribute(placements="
            f"{list(dst_spec.placements)}) on it first, or allow it with "
            f"vescale.dtensor.explicit_redistribute(False)."
        )
    _upstream_observe(src_spec, dst_spec, redistribution_msg)


def redistribute_for(op: OpOverload, t: _UpstreamDTensor, placements: Sequence[Placement]) -> Any:
    """``t`` redistributed to ``placements`` on behalf of ``op`` (an op handler's implicit
    redistribution): explicit mode checks it exactly like the strategies' own."""
    placements = tuple(placements)
    if tuple(t.placements) == placements:
        return t
    dst = DTensorSpec(t.device_mesh, spec_placements(placements), tensor_meta=t._spec.tensor_meta)
    ExplicitRedistributionContext.observe_redistribution(t._spec, dst, _OpMessage(op))  # type: ignore[arg-type]
    return api.redistribute_dtensor(t, t.device_mesh, placements, async_op=False)


class _OpMessage:
    """The lazy redistribution message upstream's observer expects: names ``op``."""

    def __init__(self, op: OpOverload) -> None:
        self.args = (op,)

    def __str__(self) -> str:
        return f"{self.args[0]}: redistribution of an input"


# ---- implicit redistribution to Partial ---------------------------------------------------


def redistribute_for_dispatch(
    local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec, **kwargs: Any
) -> torch.Tensor:
    """The dispatcher's input redistribution. For vescale DTensors, steps that *target* a
    ``Partial`` (a linear op's strategy asking for ``Shard -> Partial``, which upstream's
    planner refuses) and any involving an interleaved (strided) shard go through vescale's
    planner; everything else, and every step to or from a private partial placement such
    as upstream's ``_MaskPartial`` (whose reduction masks and offsets an index), is
    upstream's. On a meta mesh every step is vescale's: shapes only, no communication."""
    if type(src) is VescaleSpec and (
        src.mesh.device_type == "meta" or _vescale_plans(src.placements, dst.placements)
    ):
        return redistribute_local_tensor(local, src, dst, async_op=kwargs.get("async_op", False))
    return _upstream_dispatch_redistribute(local, src, dst, **kwargs)  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=1024)
def _vescale_plans(src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> bool:
    """Whether vescale's planner takes ``src -> dst`` (see ``redistribute_for_dispatch``);
    cached: placements are hashable and the answer depends on them alone."""
    return any(
        (d.is_partial() and s != d) or isinstance(s, StridedShard) or isinstance(d, StridedShard)
        for s, d in zip(src, dst)
    ) and not any(is_private_partial(p) for p in (*src, *dst))


_upstream_dispatch_redistribute = upstream_dispatch_module.redistribute_local_tensor
