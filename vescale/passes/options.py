"""``BackendOptions``: every option of the ``vescale`` backend, its default and its meaning.

The one home of the defaults: the backend resolves ``torch.compile(..., options={...})`` into
this object and every pass reads it from ``PassContext.options``. Each field's
``metadata["doc"]`` says what it does and ``metadata["env"]`` names the environment variable
read when the option is not given (``None``: none), so a docs table can be generated from or
checked against ``dataclasses.fields(BackendOptions)``.

Values are checked against each field's type (:meth:`BackendOptions.resolve`): a ``bool``
option takes ``True``/``False`` only (never a string such as ``"false"``), a ``float`` option
a number ``>= 0`` (int or float, not bool), a ``Literal`` one its listed values, ``None`` only
where the type allows it, a path a ``str`` or ``os.PathLike``, ``inductor`` a dict of the
names Inductor's config knows, each value of its option's type; anything else is a
``ValueError`` naming the option, the value and what is accepted.
"""

from __future__ import annotations

import contextlib
import os
import types
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from vescale._env import env_flag, parse_flag
from vescale._torch_compat import inductor_config_names, inductor_config_patches
from vescale.ddp.reducer import DEFAULT_BUCKET_CAP_MB

__all__ = ["PASSES_OFF", "BackendOptions"]

# Backend options turning the communication passes off: the captured program as eager runs it.
PASSES_OFF: dict[str, Any] = {"eliminate": False, "bucket_cap_mb": 0, "overlap": False}


def _opt(default: Any, doc: str, env: str | None = None) -> Any:
    return field(default=default, metadata={"doc": doc, "env": env})


@dataclass(frozen=True)
class BackendOptions:
    """Options of the ``vescale`` backend; ``fields(BackendOptions)[i].metadata`` documents each."""

    codegen: Literal["inductor", "fx"] = _opt(
        "inductor",
        '"inductor" (Inductor\'s decompositions and partitioner) or "fx" (run the graphs as '
        "they are)",
    )
    eager: bool = _opt(
        False,
        "run the Dynamo graph through eager DTensor (debugging)",
        "VESCALE_COMPILE_EAGER",
    )
    dump_dir: str | os.PathLike[str] | None = _opt(  # noqa: RUF009 (_opt is a field)
        None,
        "write dumps (graph.<pass>.txt, schedule.json, collectives.json), one folder per rank",
        "VESCALE_DUMP_DIR",
    )
    explicit: bool | None = _opt(
        None,
        "True/False: forbid/allow implicit redistribution while this backend traces; None: "
        "the env var, or the enclosing explicit_redistribute scope",
        "VESCALE_DISABLE_REDISTRIBUTE",
    )
    strict: bool = _opt(False, "raise instead of falling back when capture or Inductor fails")
    eliminate: bool = _opt(
        True, "drop collectives whose results are unused or sliced back to the local shard"
    )
    bucket_cap_mb: float = _opt(
        DEFAULT_BUCKET_CAP_MB,
        "merge collectives of one kind, group, reduce op and dtype up to this size in MiB "
        "(0 = off); the same default as DistributedDataParallel's eager buckets",
    )
    overlap: bool = _opt(
        True,
        "schedule: issue collectives as soon as their inputs exist, wait just before first use",
    )
    overlap_cap_mb: float = _opt(
        256.0, "most MiB of issued-but-unwaited collective results the schedule may keep alive"
    )
    rank_check: bool = _opt(
        True,
        (
            "compare each graph across ranks before it runs: at every call where it has "
            "even-shard from_local calls, else at its first run"
        ),
    )
    inductor: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "doc": 'Inductor\'s config options, as backend="inductor" takes them in '
            'torch.compile\'s options (e.g. {"max_autotune": True}), patched while each graph '
            'is traced and compiled (needs codegen="inductor")',
            "env": None,
        },
    )

    @classmethod
    def resolve(cls, options: dict[str, Any] | None) -> BackendOptions:
        """``options`` checked (unknown names and values not of the field's type raise
        ``ValueError``), with the env vars of ``eager`` and ``dump_dir`` where not given."""
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"vescale backend: unknown options {unknown}; known: {sorted(known)}")
        if "eager" not in options:
            options["eager"] = env_flag("VESCALE_COMPILE_EAGER", False)
        if "dump_dir" not in options:
            options["dump_dir"] = os.environ.get("VESCALE_DUMP_DIR") or None
        checked = {name: _checked(name, value) for name, value in options.items()}
        if checked.get("inductor"):
            checked["inductor"] = _inductor_options(checked["inductor"])
        return cls(**checked)


_HINTS = get_type_hints(BackendOptions)


def _accepts(hint: Any, value: Any) -> bool:
    """Whether ``value`` is of type ``hint`` under the options' policy (module docstring)."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_accepts(h, value) for h in get_args(hint))
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in get_args(hint))
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
    return isinstance(value, origin or hint)  # bool, str, dict, os.PathLike[str], NoneType


# What each type accepts, in words.
_WORDS: dict[Any, list[str]] = {
    bool: ["True", "False"],
    float: ["a number >= 0 (int or float)"],
    str: ["a str"],
    os.PathLike: ["an os.PathLike"],
    dict: ["a dict"],
    type(None): ["None"],
}


def _accepted(hint: Any) -> list[str]:
    """What ``hint`` accepts, in words."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return [w for h in get_args(hint) for w in _accepted(h)]
    if origin is Literal:
        return [repr(a) for a in get_args(hint)]
    return _WORDS[origin or hint]


def _inductor_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` (the ``inductor`` option) if Inductor knows every name and each value has
    its option's type, else ``ValueError`` naming the unknown ones and the known ones, or the
    mistyped one."""
    bad_keys = sorted(repr(k) for k in options if not isinstance(k, str))
    if bad_keys:
        raise ValueError(f"vescale backend: option inductor takes str names, got {bad_keys}")
    known = inductor_config_names()
    unknown = sorted(k for k in options if k.replace("-", "_") not in known)
    if unknown:
        raise ValueError(
            f"vescale backend: unknown Inductor options {unknown} (option inductor); known: {known}"
        )
    try:
        inductor_config_patches(None, options)
    except RuntimeError as err:  # torch's: a value not of its option's type
        raise ValueError(f"vescale backend: option inductor: {err}") from None
    return dict(options)


def _checked(name: str, value: Any) -> Any:
    """``value`` of option ``name`` if its field's type accepts it (floats as float), else
    ``ValueError`` naming the option, the value and what is accepted."""
    hint = _HINTS[name]
    if _accepts(hint, value):
        return float(value) if hint is float else value
    words = _accepted(hint)
    accepted = ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else words[0]
    tip = ""
    if isinstance(value, str) and bool in (hint, *get_args(hint)):
        with contextlib.suppress(ValueError):
            tip = f"; pass the bool {parse_flag(name, value)}, not a string"
    raise ValueError(
        f"vescale backend: option {name} must be {accepted}, got {value!r} "
        f"({type(value).__name__}){tip}"
    )
