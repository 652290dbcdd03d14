"""Sharding propagation as vescale installs it: the op registry's answer
(:func:`vescale.dtensor.ops._registry.propagate`: vescale's rules for ops with a vescale
input, upstream's strategy tables otherwise), ``VescaleSpec`` outputs for ops with a vescale
input, and a missing strategy as :class:`UnsupportedOpError`.

:func:`propagate_op_sharding` replaces upstream's propagator entry point; it is installed by
``vescale._patches``, the one module that changes torch objects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vescale._torch_compat import DTensorSpec, OpSchema, OutputSharding
from vescale.dtensor.dtensor import as_vescale_spec, is_vescale_spec, vescale_rules

__all__ = [
    "UnsupportedOpError",
    "answer_with",
    "mark_vescale",
    "propagate_op_sharding",
]

Query = Callable[[OpSchema], OutputSharding]
_registry_query: list[Query] = []  # the op registry's, set by answer_with when it is imported


def answer_with(query: Query) -> None:
    """The op registry hands its query (``_registry.propagate``) to the entry point here.
    Inverted so that this module, which the seam (:mod:`vescale._patches`) installs, imports
    neither the registry nor, through it, the seam."""
    _registry_query[:] = [query]


class UnsupportedOpError(NotImplementedError):
    """No sharding strategy for an op; names the op, its input placements and the mesh.

    A ``NotImplementedError``, so upstream still decomposes CompositeImplicit ops on it."""


def mark_vescale(spec: Any) -> Any:
    """Output spec(s) marked as vescale's (``None`` entries kept)."""
    if isinstance(spec, DTensorSpec):
        return as_vescale_spec(spec)
    if isinstance(spec, list | tuple):
        return type(spec)(mark_vescale(s) for s in spec)
    return spec


def _describe_inputs(schema: OpSchema) -> str:
    specs = [a for a in schema.args_schema if isinstance(a, DTensorSpec)]
    specs += [v for v in schema.kwargs_schema.values() if isinstance(v, DTensorSpec)]
    inputs = ", ".join(f"{tuple(s.placements)} {list(s.shape)}" for s in specs)
    mesh = specs[0].mesh if specs else None
    return f"inputs {inputs} on {mesh}"


def propagate_op_sharding(op_schema: OpSchema) -> OutputSharding:
    """The registry's propagation (cached by upstream's caches, C++ and Python, keyed by the
    specs), with ``VescaleSpec`` outputs for ops with a vescale input and, for every DTensor,
    a missing strategy as :class:`UnsupportedOpError`."""
    vescale = is_vescale_spec(op_schema.args_schema) or is_vescale_spec(
        op_schema.kwargs_schema.values()
    )
    try:
        with vescale_rules(vescale):
            out = _registry_query[0](op_schema)
    except UnsupportedOpError:
        raise
    except NotImplementedError as err:
        raise UnsupportedOpError(
            f"{op_schema.op}: no sharding strategy for {_describe_inputs(op_schema)} "
            f"({err}); redistribute its inputs and call it on local tensors, or register a "
            f"strategy (vescale.dtensor.dispatch.bypass_sharding_prop)"
        ) from err
    if vescale:
        out.output_spec = mark_vescale(out.output_spec)
        if out.redistribute_schema is not None:
            _mark_suggestion(out.redistribute_schema)
    return out  # type: ignore[no-any-return]


def _marked_arg(arg: Any) -> Any:
    if isinstance(arg, DTensorSpec):
        return as_vescale_spec(arg)
    if type(arg) in (list, tuple):
        return type(arg)(_marked_arg(a) for a in arg)
    return arg


def _mark_suggestion(schema: OpSchema) -> None:
    """The input specs a strategy asks for (a fresh schema), marked as vescale's like the
    inputs they stand for: a ``VescaleSpec`` equals only a ``VescaleSpec``, so unmarked, an
    input already laid out as asked would look redistributed to the dispatcher."""
    schema.args_schema = _marked_arg(schema.args_schema)
    schema.kwargs_schema = {k: _marked_arg(v) for k, v in schema.kwargs_schema.items()}
    schema._recompute_comparison_key()
