"""The one registry of op behaviour on DTensors: every way vescale changes what an op does is
declared here, and one query answers what it does, for eager dispatch, the compiler (Dynamo
traces that same dispatch) and the planner (:mod:`vescale.plan.propagate`).

Which declaration to use (first row that fits):

====================================  ==============================  ============================
the op needs                          declare                         the planner sees
====================================  ==============================  ============================
strategies upstream lacks, or others  ``register_strategy(op)``:      every strategy listed
in place of upstream's (all DTensors) ``fn(OpSchema of OpStrategy)``
                                      ``-> OpStrategy``
upstream's strategy, adjusted for     ``wrap_upstream_strategy(op,    the adjusted strategies
vescale DTensors                      wrap, prefix)``
a choice made from the concrete       ``register_rule(op)``:          the rule's answer for each
input specs that no strategy list     ``fn(OpSchema of DTensorSpec)`` combination of input
states (e.g. all-reduce rather than   ``-> OutputSharding``           candidates (bounded)
upstream's reduce-scatter)
output placements only; the local op  ``bypass_sharding_prop(op)``   replicated fallback
runs on the inputs as they are
code of its own instead of dispatch   ``bypass_dispatch(op,           the strategies declared
(collectives inside)                  when=takes_over)``, beside      beside the handler, per
                                      ``declare_handler_strategies``  input layout (its
                                      ``(op, layout_arg=...)``        collectives priced inside)
arguments changed before, or the      ``pre_dispatch_patch(op)``,     the strategies of the
output after, dispatch                ``post_dispatch_patch(op)``     dispatched op
a kernel below DTensor dispatch (an   ``register_kernel(op, keys,     the decomposition's ops
autograd key before a                 fn, why)``
CompositeImplicit decomposition)
====================================  ==============================  ============================

Strategies (rows 1-2) and rules (row 3) are sharding propagation: cached, seen by every
consumer. Rules, wrapped strategies and dispatch hooks apply to ops with a ``vescale.DTensor``
input; upstream DTensors keep upstream's behaviour. Every write into a torch table goes
through the seam (:mod:`vescale._patches`). ``vescale.dtensor.dispatch`` and
:mod:`vescale.dtensor.hooks` re-export the hook decorators under their public and veScale
legacy names.

The query: :func:`propagate` (concrete input specs -> the op's ``OutputSharding``, as eager
dispatch asks) and :func:`strategies` (input candidates -> every strategy, as the planner
asks); :func:`hooks_of` gives an op's dispatch hooks, :func:`rule_ops` the ops with a rule.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor
from torch.distributed.tensor.placement_types import Placement, Shard

from vescale import _patches
from vescale._torch_compat import (
    PROPAGATOR,
    DTensorSpec,
    OpSchema,
    OpSpec,
    OpStrategy,
    OutputSharding,
    PreparedSingleDimStrategy,
    expand_to_full_mesh_op_strategy,
    pytree,
    upstream_strategy_utils,
)
from vescale.dtensor import propagation
from vescale.dtensor.dtensor import vescale_rules, vescale_rules_active
from vescale.dtensor.op_args import bind
from vescale.dtensor.propagation import UnsupportedOpError

__all__ = [
    "MAX_COMBINATIONS",
    "PROPAGATOR",
    "Collective",
    "HandledOp",
    "HandlerStrategy",
    "Hook",
    "OpHooks",
    "bypass_dispatch",
    "bypass_sharding_prop",
    "declare_handler_strategies",
    "handled_op",
    "handler_strategy",
    "hooks_of",
    "on_hooks_changed",
    "op_list",
    "post_dispatch_patch",
    "pre_dispatch_patch",
    "propagate",
    "register_kernel",
    "register_rule",
    "register_strategy",
    "rule_ops",
    "schema_info",
    "strategies",
    "takes_over",
    "unregister_bypass_dispatch",
    "unregister_bypass_sharding_prop",
    "unregister_post_dispatch_patch",
    "unregister_pre_dispatch_patch",
    "upstream_propagate",
    "wrap_upstream_strategy",
]

OpOverload = torch._ops.OpOverload
Ops = OpOverload | Sequence[OpOverload]
Strategy = Callable[[OpSchema], Any]
RuleFn = Callable[[OpSchema], OutputSharding]
Predicate = Callable[..., bool]


MAX_COMBINATIONS = 1024
"""Most input-candidate combinations one strategy query enumerates."""


def op_list(op: Ops) -> list[OpOverload]:
    """``op`` (an ``OpOverload`` or a list of them) as a list; anything else raises."""
    ops: list[Any] = list(op) if isinstance(op, list | tuple) else [op]
    for o in ops:
        if not isinstance(o, OpOverload):
            raise TypeError(
                f"op registry: expected an OpOverload such as torch.ops.aten.mm.default, got {o!r}"
            )
    return ops


# ---- strategies and rules (sharding propagation) -------------------------------------


def register_strategy(op: Ops, schema_info: Any = None) -> Callable[[Strategy], Strategy]:
    """``@register_strategy(op)``: ``fn(op_schema) -> OpStrategy`` is ``op``'s strategy for
    every DTensor (in place of upstream's, if any)."""
    return _patches.register_op_strategy(op_list(op), schema_info)


def wrap_upstream_strategy(op: Any, wrap: Callable[[Strategy], Strategy], prefix: str) -> None:
    """Register ``wrap(upstream's strategy for op)`` in its place, same schema info; it
    applies to ops with a vescale input, upstream's strategy to all others."""
    upstream = PROPAGATOR.op_strategy_funcs[op]
    wrapped = wrap(upstream)

    def strategy(schema: OpSchema) -> Any:
        return (wrapped if vescale_rules_active() else upstream)(schema)

    strategy.__name__ = f"{prefix}_{op.__name__.replace('.', '_')}"
    register_strategy(op, schema_info=PROPAGATOR.op_to_schema_info.get(op))(strategy)


_RULES: dict[OpOverload, RuleFn] = {}


_PLACEMENT_RULES: dict[type[Placement], dict[OpOverload, RuleFn]] = {}


def register_rule(
    op: Ops, *, placement: type[Placement] | None = None
) -> Callable[[RuleFn], RuleFn]:
    """``@register_rule(op)``: ``fn(op_schema) -> OutputSharding`` decides ``op``'s sharding
    for concrete input specs when an input is a vescale DTensor (upstream's strategies decide
    otherwise). Its answer's ``redistribute_schema`` (if any) must be a layout it accepts as
    is: the planner offers each answer as a strategy.

    ``placement=`` (a placement only vescale knows, e.g. ``RaggedShard``): the rule decides
    for every input holding one, before any other; an op with no rule for it raises
    :class:`UnsupportedOpError` naming op, inputs and mesh."""

    table = _RULES if placement is None else _PLACEMENT_RULES.setdefault(placement, {})

    def register(fn: RuleFn) -> RuleFn:
        for o in op_list(op):
            table[o] = fn
        return fn

    return register


def rule_ops() -> list[OpOverload]:
    """The ops with a vescale rule."""
    return list(_RULES)


def register_kernel(op: OpOverload, keys: Sequence[str], fn: Callable[..., Any], why: str) -> None:
    """``fn`` as ``op``'s kernel at dispatch ``keys`` where ``op`` has none of its own (see
    :func:`vescale._patches.register_kernel`: ``fn`` computes the op for every input)."""
    _patches.register_kernel(op, keys, fn, why)


def schema_info(op: OpOverload) -> Any:
    """``op``'s runtime schema info, as upstream's dispatcher looks it up."""
    info = PROPAGATOR.op_to_schema_info.get(op)
    return info or PROPAGATOR.op_to_schema_info_for_single_dim_strategy.get(op)


def upstream_propagate(op_schema: OpSchema) -> OutputSharding:
    """Upstream's propagation over its strategy tables (vescale's strategies included, no
    rule for the op itself): for rules that adjust the schema and let upstream decide."""
    out = type(PROPAGATOR).propagate_op_sharding_non_cached(PROPAGATOR, op_schema)
    return out  # type: ignore[no-any-return]


def propagate(op_schema: OpSchema) -> OutputSharding:
    """What ``op_schema.op`` does on these input specs: its rule while vescale rules are
    active (an op with a vescale input propagates, or the planner asks), else upstream's
    propagation."""
    for placement, rules in _PLACEMENT_RULES.items():
        holding = _specs_holding(op_schema, placement)
        if holding:
            if op_schema.op not in rules:
                raise UnsupportedOpError(_unsupported(op_schema.op, placement, holding))
            return rules[op_schema.op](op_schema)
    rule = _RULES.get(op_schema.op) if vescale_rules_active() else None
    return rule(op_schema) if rule is not None else upstream_propagate(op_schema)


def _specs_holding(schema: OpSchema, placement: type[Placement]) -> list[DTensorSpec]:
    args = [*schema.args_schema, *schema.kwargs_schema.values()]
    flat = [x for a in args for x in (a if isinstance(a, list | tuple) else [a])]
    return [
        s
        for s in flat
        if isinstance(s, DTensorSpec) and any(isinstance(p, placement) for p in s.placements)
    ]


def _unsupported(op: OpOverload, placement: type[Placement], specs: list[DTensorSpec]) -> str:
    inputs = ", ".join(f"{tuple(s.placements)} {list(s.shape)}" for s in specs)
    name = placement.__name__
    return (
        f"{op}: not supported on {name} inputs ({inputs} on {specs[0].mesh}); redistribute "
        f"them to Shard/Replicate first (x.redistribute(mesh, placements)) or register a rule "
        f"(vescale.dtensor.dispatch.register_rule(op, placement={name}))"
    )


propagation.answer_with(propagate)  # eager dispatch's entry point asks this query


def _zero_cost(*_args: Any, **_kwargs: Any) -> float:
    return 0.0


def strategies(
    op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: Any, out_meta: Any
) -> OpStrategy | None:
    """Every strategy of ``op`` with vescale's rules, for tensor inputs given as
    ``OpStrategy`` of their candidate placements (``None``: the registry has none). An op
    with a rule offers the rule's answer (inputs as it takes or redistributes them, outputs)
    for each combination of candidates; past :data:`MAX_COMBINATIONS`, for each layout
    upstream's strategies take. Other ops: upstream's tables, each input's candidates
    expanded. Placements only: upstream's cost estimates are skipped (rules, which choose
    by them, keep them)."""
    with vescale_rules(True):
        with _patches.temporarily(upstream_strategy_utils, "redistribute_cost", _zero_cost):
            found = _table_strategies(op, args, kwargs, mesh, out_meta)
        if op in _RULES:
            found = _rule_strategies(op, args, kwargs, found)
    return found


def _table_strategies(
    op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: Any, out_meta: Any
) -> OpStrategy | None:
    single = PROPAGATOR.op_single_dim_strategy_funcs.get(op)
    func = PROPAGATOR.op_strategy_funcs.get(op)
    if single is not None:
        info = PROPAGATOR.op_to_schema_info_for_single_dim_strategy.get(op)
        return _expand_single_dim(
            OpSchema(op, args, kwargs, schema_info=info), single, mesh, out_meta
        )
    if func is None:
        return None
    schema = OpSchema(op, args, kwargs, schema_info=PROPAGATOR.op_to_schema_info.get(op))
    try:
        found = func(schema)
    except (IndexError, AssertionError):  # a rule that zips its inputs' strategies
        found = _per_combination(func, schema)
    return found if isinstance(found, OpStrategy) else None  # a TupleStrategy: not offered


def _leaves(schema_args: Any) -> tuple[list[Any], Any, list[int]]:
    leaves, spec = pytree.tree_flatten(schema_args, is_leaf=lambda x: isinstance(x, OpStrategy))
    return leaves, spec, [i for i, leaf in enumerate(leaves) if isinstance(leaf, OpStrategy)]


def _combinations(choices: list[list[Any]], op: OpOverload) -> Iterable[tuple[Any, ...]]:
    total = 1
    for c in choices:
        total *= len(c)
    if total > MAX_COMBINATIONS:
        raise NotImplementedError(
            f"{op}: {total} input placement combinations (more than {MAX_COMBINATIONS})"
        )
    return itertools.product(*choices)


def _per_combination(func: Strategy, schema: OpSchema) -> OpStrategy:
    """The union of ``func``'s strategies over every combination of single input candidates,
    for strategies that pair their inputs' candidates index by index."""
    leaves, spec, where = _leaves((schema.args_schema, schema.kwargs_schema))
    found: list[OpSpec] = []
    for combo in _combinations([leaves[i].strategies for i in where], schema.op):
        for i, one in zip(where, combo):
            leaves[i] = OpStrategy([one])
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        found.extend(
            func(OpSchema(schema.op, args, kwargs, schema_info=schema.schema_info)).strategies
        )
    return OpStrategy(found)


def _rule_strategies(
    op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], upstream: OpStrategy | None
) -> OpStrategy:
    """The rule's answer for each combination of input candidates (or, past the bound, for
    each input layout of upstream's strategies), one strategy per distinct answer."""
    leaves, spec, where = _leaves((args, kwargs))
    choices = [[s.output_spec for s in leaves[i].strategies] for i in where]
    total = 1
    for c in choices:
        total *= len(c)
    if total <= MAX_COMBINATIONS or upstream is None:
        combos: Iterable[Sequence[Any]] = _combinations(choices, op)
    else:
        combos = [
            s.input_specs
            for s in upstream.strategies
            if s.input_specs is not None and len(s.input_specs) == len(where)
        ]
    found: dict[Any, OpSpec] = {}
    for combo in combos:
        for i, s in zip(where, combo):
            leaves[i] = s
        a, k = pytree.tree_unflatten(leaves, spec)
        out = propagate(OpSchema(op, a, k, schema_info=schema_info(op)))
        asked = out.redistribute_schema
        inputs = list(combo) if asked is None else _specs_of(asked)
        key = (_placements(out.output_spec), tuple(tuple(s.placements) for s in inputs))
        found.setdefault(key, OpSpec(out.output_spec, input_specs=inputs))
    return OpStrategy(list(found.values()))


def _specs_of(schema: OpSchema) -> list[DTensorSpec]:
    leaves = pytree.tree_leaves((schema.args_schema, schema.kwargs_schema))
    return [leaf for leaf in leaves if isinstance(leaf, DTensorSpec)]


def _placements(spec: Any) -> Any:
    if isinstance(spec, DTensorSpec):
        return tuple(spec.placements)
    if isinstance(spec, list | tuple):
        return tuple(_placements(s) for s in spec)
    return None


def _expand_single_dim(schema: OpSchema, single: Any, mesh: Any, out_meta: Any) -> Any:
    """Upstream's expansion of a single-mesh-dim strategy to every placement combination of
    ``mesh``, with every candidate of each input (upstream's own expansion takes one). The
    sharding kinds that fill placeholders are those the candidates use."""
    op = schema.op
    kinds: dict[Any, Any] = {"shard": Shard(0)}
    for leaf in pytree.tree_leaves(schema.args_schema, is_leaf=lambda x: isinstance(x, OpStrategy)):
        if isinstance(leaf, OpStrategy):
            for s in leaf.strategies:
                for p in s.output_spec.placements:
                    if p.is_shard() and not isinstance(p, Shard):  # _StridedShard(split_factor)
                        kinds.setdefault(getattr(p, "split_factor", None), p)
    if len(kinds) > mesh.ndim:
        raise NotImplementedError(f"{op}: more sharding kinds than mesh dims among candidates")
    representative = tuple((list(kinds.values()) * mesh.ndim)[: mesh.ndim])

    def one(arg: Any) -> Any:
        if isinstance(arg, OpStrategy):
            meta = arg.strategies[0].output_spec.tensor_meta
            return OpStrategy([OpSpec(DTensorSpec(mesh, representative, meta))])
        return arg

    prep_schema = OpSchema(
        op,
        pytree.tree_map(one, schema.args_schema, is_leaf=lambda x: isinstance(x, OpStrategy)),
        {k: one(v) for k, v in schema.kwargs_schema.items()},
        schema_info=schema.schema_info,
    )
    prepared = PreparedSingleDimStrategy(single, prep_schema, out_meta)
    return expand_to_full_mesh_op_strategy(
        mesh,
        schema,
        prepared.expanded_strategies,
        output_tensor_meta=out_meta,
        inplace_op=op.name().split("::")[1].split(".")[0].endswith("_"),
        input_index=prepared.num_outputs,
        allow_unbacked_sharding=prepared.allow_unbacked_sharding,
        allow_uneven_sharding=prepared.allow_uneven_sharding,
        different_mesh_args=prepared.remapped_different_mesh_args,
    )


# ---- dispatch hooks (run by vescale.dtensor.hooks) -------------------------------------


@dataclass(frozen=True)
class Hook:
    """A registered hook and the predicate (``None``: always) on its own arguments."""

    fn: Callable[..., Any]
    when: Predicate | None

    def applies(self, *args: Any) -> bool:
        return self.when is None or bool(self.when(*args))


@dataclass
class OpHooks:
    """One op's dispatch hooks: ``pre`` patches, a ``bypass`` handler (or dispatch with the
    ``prop`` sharding-propagation bypass), ``post`` patches; ``off_mesh``: the bypass handler
    also runs on ranks outside the op's mesh."""

    bypass: Hook | None = None
    pre: list[Hook] = field(default_factory=list)
    post: list[Hook] = field(default_factory=list)
    prop: Hook | None = None
    off_mesh: bool = False

    def empty(self) -> bool:
        return self.bypass is None and not self.pre and not self.post and self.prop is None


_HOOKS: dict[OpOverload, OpHooks] = {}
_installers: list[Callable[[OpOverload], None]] = []


def hooks_of(op: OpOverload) -> OpHooks | None:
    """``op``'s dispatch hooks, if any."""
    return _HOOKS.get(op)


def on_hooks_changed(install: Callable[[OpOverload], None]) -> None:
    """Call ``install(op)`` for every op with hooks now and whenever an op's hooks change
    (:mod:`vescale.dtensor.hooks` installs them in upstream's handler table)."""
    _installers.append(install)
    for op in list(_HOOKS):
        install(op)


def _update(op: Ops, change: Callable[[OpHooks], None]) -> None:
    for o in op_list(op):
        hooks = _HOOKS.setdefault(o, OpHooks())
        change(hooks)
        if hooks.empty():
            del _HOOKS[o]
        for install in _installers:
            install(o)


def bypass_dispatch(
    op: Ops, *, when: Predicate | None = None, off_mesh: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@bypass_dispatch(op)``: ``handler(op, args, kwargs) -> result`` replaces DTensor
    dispatch where ``when(op, args, kwargs)`` holds (default: always; elsewhere the op runs
    DTensor's dispatch steps). Ranks outside the op's mesh do not run it (they get empty
    local results and communicate nothing), unless ``off_mesh=True``: the handler then runs
    there too and must not communicate (e.g. random ops, which advance the generator on
    every rank)."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        def change(h: OpHooks) -> None:
            h.bypass, h.off_mesh = Hook(fn, when), off_mesh

        _update(op, change)
        return fn

    return register


def pre_dispatch_patch(
    op: Ops, *, when: Predicate | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@pre_dispatch_patch(op)``: ``fn(op, args, kwargs) -> (args, kwargs)`` runs before
    dispatch where ``when(op, args, kwargs)`` holds (default: always); stackable."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _update(op, lambda h: h.pre.append(Hook(fn, when)))
        return fn

    return register


def post_dispatch_patch(
    op: Ops, *, when: Predicate | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@post_dispatch_patch(op)``: ``fn(op, out) -> out`` runs after dispatch where
    ``when(op, out)`` holds (default: always); stackable."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _update(op, lambda h: h.post.append(Hook(fn, when)))
        return fn

    return register


def bypass_sharding_prop(
    op: Ops, *, when: Predicate | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@bypass_sharding_prop(op)``: ``fn(op_schema) -> output placements or spec(s)``
    replaces the strategy search where ``when(op_schema)`` holds (default: always); the local
    op runs on the inputs as they are."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        def change(h: OpHooks) -> None:
            h.prop = Hook(fn, when)

        _update(op, change)
        return fn

    return register


def unregister_bypass_dispatch(op: Ops) -> None:
    """Remove ``op``'s bypass handler (upstream behaviour returns)."""

    def change(h: OpHooks) -> None:
        h.bypass, h.off_mesh = None, False

    _update(op, change)


def unregister_pre_dispatch_patch(op: Ops, fn: Callable[..., Any] | None = None) -> None:
    """Remove ``op``'s pre-dispatch patch ``fn`` (default: all of them)."""
    _update(op, lambda h: h.pre.clear() if fn is None else _drop(h.pre, fn))


def _drop(hooks: list[Hook], fn: Callable[..., Any]) -> None:
    hooks[:] = [h for h in hooks if h.fn is not fn]


def unregister_post_dispatch_patch(op: Ops) -> None:
    """Remove all of ``op``'s post-dispatch patches."""
    _update(op, lambda h: h.post.clear())


def unregister_bypass_sharding_prop(op: Ops) -> None:
    """Remove ``op``'s sharding-propagation bypass."""

    def change(h: OpHooks) -> None:
        h.prop = None

    _update(op, change)


# ---- handler strategies: what a bypass_dispatch handler does, for the planner ------------
#
# A handler that runs instead of an op's dispatch declares, beside itself, the strategy it
# implements for each input layout it takes over (``@declare_handler_strategies``): the
# placements it lays each tensor argument out in, the placements of its outputs and the
# collectives it issues inside the op. Its ``when`` is :func:`takes_over` (the handler runs
# exactly where a strategy is declared); the planner offers the declared strategy for those
# layouts in place of the registry's, the collectives priced inside the op.


@dataclass(frozen=True)
class Collective:
    """A collective issued inside an op: ``kind`` (``"all_reduce"``, ...) over mesh dim
    ``mesh_dim``, ``bytes`` of input on the rank that holds the most."""

    kind: str
    mesh_dim: int
    bytes: int


@dataclass(frozen=True)
class HandlerStrategy:
    """What a handler does for one input layout. ``inputs``: per tensor argument (schema
    name) the placements the handler lays it out in, ``None`` where it takes it as it comes;
    ``outputs``: the placements of each tensor output; ``collectives``: those it issues
    inside the op, in order."""

    inputs: dict[str, tuple[Placement, ...] | None]
    outputs: tuple[tuple[Placement, ...], ...]
    collectives: tuple[Collective, ...] = ()


Declaration = Callable[
    [OpOverload, dict[str, Any]], HandlerStrategy | tuple[HandlerStrategy, ...] | None
]
"""``fn(op, bound arguments with each DTensor as its DTensorSpec) -> HandlerStrategy``, or a
tuple of alternatives (the same layout of ``layout_arg``, other layouts of the other
arguments: eager runs the first whose declared inputs the arguments already have, else the
first; the planner offers each), or ``None`` where the handler does not take these
arguments."""


@dataclass(frozen=True)
class HandledOp:
    """An op's declared handler strategies; they depend on the placements of argument
    ``layout_arg`` only (the handler lays the other tensor arguments out as declared)."""

    declare: Declaration
    layout_arg: str


_HANDLED: dict[OpOverload, HandledOp] = {}


def declare_handler_strategies(op: Ops, *, layout_arg: str) -> Callable[[Declaration], Declaration]:
    """``@declare_handler_strategies(op, layout_arg=name)``: the strategies ``op``'s bypass
    handler implements (see :class:`HandledOp`)."""

    def register(fn: Declaration) -> Declaration:
        for o in op_list(op):
            _HANDLED[o] = HandledOp(fn, layout_arg)
        return fn

    return register


def handled_op(op: Any) -> HandledOp | None:
    """``op``'s declared handler strategies, if a handler runs it."""
    return _HANDLED.get(op)


def declared_strategies(
    handled: HandledOp, op: OpOverload, bound: dict[str, Any]
) -> tuple[HandlerStrategy, ...]:
    """Every alternative ``handled`` declares for ``bound`` (DTensors as their specs)."""
    declared = handled.declare(op, bound)
    if declared is None:
        return ()
    return declared if isinstance(declared, tuple) else (declared,)


def handler_strategy(
    op: OpOverload, args: Sequence[Any], kwargs: dict[str, Any]
) -> HandlerStrategy | None:
    """The strategy ``op``'s handler runs for these (eager) arguments: of the alternatives it
    declares, the first whose declared inputs they already have, else the first; ``None``: no
    handler takes them."""
    handled = _HANDLED.get(op)
    if handled is None:
        return None
    bound = {
        name: a._spec if isinstance(a, _UpstreamDTensor) else a
        for name, a in bind(op, args, kwargs).items()
    }
    alternatives = declared_strategies(handled, op, bound)
    for s in alternatives:
        if all(
            p is None or tuple(bound[n].placements) == p
            for n, p in s.inputs.items()
            if isinstance(bound.get(n), DTensorSpec)
        ):
            return s
    return alternatives[0] if alternatives else None


def takes_over(op: OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """A handler's ``when``: it declares a strategy for these arguments."""
    return handler_strategy(op, args, kwargs) is not None
