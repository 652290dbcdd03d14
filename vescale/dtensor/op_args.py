"""One argument binder for op handlers and strategies: an op's arguments by the names of its
schema (``op._schema``), defaults filled in, and back."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["bind", "unbind"]

OpOverload = torch._ops.OpOverload
_REQUIRED = object()


@functools.cache
def _parameters(op: OpOverload) -> tuple[tuple[str, bool, Any], ...]:
    """``(name, kwarg_only, default or _REQUIRED)`` per schema argument, out= arguments too."""
    return tuple(
        (a.name, a.kwarg_only, a.default_value if a.has_default_value() else _REQUIRED)
        for a in op._schema.arguments
    )


def bind(op: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``op``'s arguments (an op's ``args``/``kwargs``, or an ``OpSchema``'s ``args_schema``/
    ``kwargs_schema``) as ``{schema name: value}``, in schema order, defaults filled in.
    Too many positional arguments, unknown names or missing required ones raise ``TypeError``
    naming the op."""
    params = _parameters(op)
    positional = [name for name, kwarg_only, _ in params if not kwarg_only]
    if len(args) > len(positional):
        raise TypeError(f"{op}: {len(args)} positional arguments, the schema takes {positional}")
    unknown = set(kwargs) - {name for name, _, _ in params}
    if unknown:
        raise TypeError(f"{op}: no arguments named {sorted(unknown)} in {op._schema}")
    given = dict(zip(positional, args)) | dict(kwargs)
    bound = {name: given.get(name, default) for name, _, default in params}
    missing = [name for name, value in bound.items() if value is _REQUIRED]
    if missing:
        raise TypeError(f"{op}: missing required arguments {missing} of {op._schema}")
    return bound


def unbind(op: OpOverload, bound: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` to call ``op`` with ``bound`` (from :func:`bind`): positional
    arguments in schema order, keyword-only ones as keywords."""
    params = _parameters(op)
    args = tuple(bound[name] for name, kwarg_only, _ in params if not kwarg_only)
    kwargs = {name: bound[name] for name, kwarg_only, _ in params if kwarg_only}
    return args, kwargs
