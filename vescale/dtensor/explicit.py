"""Explicit mode: implicit redistributions that communicate are errors.

On by default (``VESCALE_DISABLE_REDISTRIBUTE``: unset or ``1/true/yes/on`` on,
``0/false/no/off`` off, case-insensitive, anything else a ``ValueError``; or
:func:`explicit_redistribute` in a scope): an op whose vescale inputs would need a
redistribution that communicates raises :class:`ImplicitRedistributionError` naming the op,
the input placements and the placements the strategy wanted (upstream DTensors keep
upstream's implicit redistribution). Local steps (e.g. Replicate -> Shard, or any change on
a mesh dim of one rank, which moves nothing) stay allowed;
explicit ``redistribute()`` calls always are. The rule covers the forward, the code users
write: inside backward (the autograd engine running, eager or while AOTAutograd traces it) a
redistribution is the adjoint of a layout the forward chose (e.g. the all-reduce of a
column-parallel input's ``Partial`` gradient, or of cross-entropy's total weight) and no user
code could annotate it, so it is allowed; compiled graphs still list it in
``collectives.json`` with its reason.

:func:`observe_redistribution` replaces upstream's observer; it is installed by
``vescale._patches``, the one module that changes torch objects.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._stack import user_line_of_stack
from vescale._torch_compat import (
    DTensorSpec,
    ExplicitRedistributionContext,
    get_proxy_mode,
    redistribute_cost,
)
from vescale.dtensor.dtensor import VescaleSpec, redistribute_dtensor
from vescale.dtensor.explicit_env import env_state
from vescale.dtensor.placement_types import Placement, is_norm_partial, spec_placements
from vescale.dtensor.redistribute import moves_nothing, strided_communicates

__all__ = [
    "ImplicitRedistributionError",
    "explicit_redistribute",
    "explicit_redistribute_enabled",
    "explicit_scope",
    "explicit_state",
    "observe_redistribution",
    "redistribute_for",
]

OpOverload = torch._ops.OpOverload

_explicit = threading.local()  # .state: (enabled, what set it) of the innermost scope, or None


def explicit_state() -> tuple[bool, str]:
    """Whether implicit redistribution is forbidden here, and what says so (for messages):
    the innermost scope, else ``VESCALE_DISABLE_REDISTRIBUTE`` (``ValueError`` if it is not a
    boolean), else on."""
    state: tuple[bool, str] | None = getattr(_explicit, "state", None)
    return env_state() if state is None else state


def explicit_redistribute_enabled() -> bool:
    """Whether implicit redistribution is forbidden here (context manager, else env var)."""
    return explicit_state()[0]


@contextlib.contextmanager
def explicit_scope(enabled: bool, source: str) -> Iterator[None]:
    """Explicit mode ``enabled`` in this scope and thread, set by ``source`` (for messages)."""
    prev = getattr(_explicit, "state", None)
    _explicit.state = (enabled, source)
    try:
        yield
    finally:
        _explicit.state = prev


def explicit_redistribute(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Forbid (``True``) or allow (``False``) implicit redistribution in this scope and thread,
    overriding ``VESCALE_DISABLE_REDISTRIBUTE``."""
    return explicit_scope(enabled, f"vescale.dtensor.explicit_redistribute({enabled})")


def _op_of(msg: Any) -> str:
    """The op named by upstream's lazy message (an OpSchema, or the op on the C++ fast path)."""
    subject = getattr(msg, "args", (None,))[0]
    return str(subject if isinstance(subject, OpOverload) else getattr(subject, "op", subject))


class ImplicitRedistributionError(RuntimeError):
    """An op needed a communicating redistribution while explicit mode was on."""


def _traced_user_line() -> str:
    """`` at file.py:line`` of the user code whose graph node AOTAutograd is tracing, if any
    (the check is deferred past Dynamo's own pass, see ``_dynamo_propagating``)."""
    meta = torch.fx.traceback.get_current_meta() or {}
    line = user_line_of_stack(meta.get("stack_trace") or "")
    return f" at {line}" if line else ""


def _dynamo_propagating() -> bool:
    """Dynamo's fake-tensor pass over the user frame (compiling, no proxy tracer yet).

    The check is deferred from it to the pass that follows with the same dispatch: the
    vescale backend's AOT trace, where its ``explicit`` option is in effect (other backends:
    AOT tracing, or eager dispatch at run time)."""
    return torch.compiler.is_compiling() and get_proxy_mode() is None


def _communicates(src: DTensorSpec, dst: DTensorSpec) -> bool:
    # cheap for local slices; upstream prices strided-shard steps at 0, and steps on mesh
    # dims of one rank above 0
    if moves_nothing(src, dst):
        return False
    return redistribute_cost(src, dst) > 0 or strided_communicates(src, dst)


def _finishes_norm(src: DTensorSpec, dst: DTensorSpec) -> bool:
    """Whether ``src -> dst`` communicates only to reduce a norm's pending partial
    (:func:`~vescale.dtensor.placement_types.is_norm_partial`): the last step of a norm the
    caller asked for (a norm is a reduction), deferred so that a norm of norms
    (``clip_grad_norm_``'s total over per-parameter norms) reduces once."""
    if not any(is_norm_partial(p) for p in src.placements):
        return False
    rest = tuple(
        d if is_norm_partial(s) and not d.is_partial() else s
        for s, d in zip(src.placements, dst.placements)
    )
    return not _communicates(DTensorSpec(src.mesh, rest, tensor_meta=src.tensor_meta), dst)


def _shown_mesh(mesh: Any) -> Any:
    """``mesh`` as eager prints it: a trace holds it in an opaque ``FakeScriptObject`` whose
    ``real_obj`` is the mesh."""
    try:
        return object.__getattribute__(mesh, "real_obj")
    except AttributeError:
        return mesh


_upstream_observe = ExplicitRedistributionContext.observe_redistribution


def observe_redistribution(
    cls: type, src_spec: DTensorSpec, dst_spec: DTensorSpec, redistribution_msg: Any
) -> None:
    """Upstream's observer of implicit redistributions, plus explicit mode for vescale DTensors."""
    if (
        type(src_spec) is VescaleSpec
        and _communicates(src_spec, dst_spec)  # first: cheap for local slices
        and not _finishes_norm(src_spec, dst_spec)
        and explicit_redistribute_enabled()
        and torch._C._current_graph_task_id() == -1  # not inside backward: see module docstring
        and not _dynamo_propagating()
    ):
        op, source = _op_of(redistribution_msg), explicit_state()[1]
        raise ImplicitRedistributionError(
            f"{op}{_traced_user_line()}: implicit redistribution of an input from {tuple(src_spec.placements)} to "
            f"{tuple(dst_spec.placements)} on {_shown_mesh(src_spec.mesh)} (global shape "
            f"{tuple(src_spec.shape)}) is forbidden: explicit mode is on "
            f"({source}). Call .redistribute(placements="
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
    return redistribute_dtensor(t, t.device_mesh, placements, async_op=False)


class _OpMessage:
    """The lazy redistribution message upstream's observer expects: names ``op``."""

    def __init__(self, op: OpOverload) -> None:
        self.args = (op,)

    def __str__(self) -> str:
        return f"{self.args[0]}: redistribution of an input"
