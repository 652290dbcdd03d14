"""The non-finite check: which op, on which rank, first made a NaN/Inf, raised on every rank
before the optimizer step applies it.

Opt-in: ``VESCALE_CHECK_FINITE=1`` (strict boolean, read at ``import vescale``: on for the
process) or ``with vescale.check_finite():``. Off, nothing runs (no mode, no hook).

On, a ``TorchDispatchMode`` (a debug mode: one host read per floating-point op output) keeps
this rank's first op since the last optimizer step whose output is not finite, with how it
arose: *produced* (its inputs were finite), *received* (the result of a collective: an
``all_reduce`` or redistribution waited), or *from a non-finite input* that no checked op made
(the batch, a parameter). It names the phase: ``forward`` (any op outside backward, with the
user's ``file.py:line``), ``backward`` (with the autograd node), or a compiled graph's FX node
and its user line (graphs that ``backend="vescale"`` compiles while the check is on run node
by node, :func:`interpreted`). Functional collectives' buffers are read only once waited;
view ops and uninitialized outputs (``empty``) are not checked; ``torch.distributed``'s
in-place collectives are not seen (what they bring counts as a non-finite input).

A global optimizer step pre-hook (through ``vescale._patches``) gathers every rank's record
and whether its gradients are finite (``vescale._agree.gather``: the side gloo group, never
the training group) and, if any rank saw a non-finite value, raises :class:`NonFiniteError`
with the same text on every rank: the step does not run, the parameters stay unchanged.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale import _agree
from vescale._env import env_flag
from vescale._patches import restore_entry, set_entry
from vescale._stack import user_line_of_stack
from vescale._torch_compat import (
    AsyncCollectiveTensor,
    TorchDispatchMode,
    are_we_tracing,
    current_autograd_node,
    current_graph_task_id,
    global_optimizer_pre_hooks,
    make_boxed_func,
    tree_map,
)
from vescale.fx.collectives import COLLECTIVE_KINDS, user_source

__all__ = ["ENV", "NonFiniteError", "check_finite", "enabled", "from_env", "interpreted"]

ENV = "VESCALE_CHECK_FINITE"
_HOOK = "vescale_check_finite"


class NonFiniteError(RuntimeError):
    """A NaN/Inf reached an optimizer step while the non-finite check is on."""


@dataclass(frozen=True)
class Record:
    """This rank's first non-finite op output since the last step."""

    index: int  # ops checked on this rank since the last step before it
    how: str  # "produced", "input" (from a non-finite input no checked op made), "received"
    op: str
    where: str  # the phase and source


@dataclass
class _State:
    depth: int = 0
    mode: TorchDispatchMode | None = None
    first: Record | None = None
    ops: int = 0
    step: int = 1
    node: str | None = None  # the compiled graph's node running now
    pending: dict[int, str] = field(default_factory=dict)  # collective buffer -> its kind


_state = _State()


def enabled() -> bool:
    """Whether the check is on."""
    return _state.depth > 0


def _local(t: Any) -> torch.Tensor | None:
    """The floating-point local values of ``t`` (a DTensor's shard), else None."""
    if isinstance(t, _UpstreamDTensor):
        t = t._local_tensor
    if isinstance(t, AsyncCollectiveTensor):
        t = t.elem  # read once waited: by the op that takes it
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    return t if t.is_floating_point() or t.is_complex() else None


def _tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(x: Any) -> Any:
        local = _local(x)
        if local is not None:
            found.append(local)
        return x

    tree_map(visit, tree)
    return found


def _finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _buffer(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _where() -> str:
    if _state.node is not None:
        return _state.node
    phase = "forward"
    if current_graph_task_id() != -1:
        node = current_autograd_node()
        phase = "backward" if node is None else f"backward, {node.name()}"
    line = user_line_of_stack("".join(traceback.format_stack()))
    return f"{phase}, {line}" if line else phase


_aten = torch.ops.aten
_UNINITIALIZED = {  # outputs hold whatever memory held: not values the program made
    _aten.empty,
    _aten.empty_like,
    _aten.empty_strided,
    _aten.empty_permuted,
    _aten.new_empty,
    _aten.new_empty_strided,
}


class _FiniteMode(TorchDispatchMode):
    """Records the first non-finite op output on this rank (see the module doc)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # off while torch.compile traces, on while compiled graphs run

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _state.first is not None or are_we_tracing():  # tracing: a lazy backward compile
            return out
        _state.ops += 1
        if func.overloadpacket in _UNINITIALIZED:
            return out
        if func.is_view:  # aliases its input: no values of its own
            return out
        if func in COLLECTIVE_KINDS:  # its buffer is read once waited
            for t in _tensors(out):
                _state.pending[_buffer(t)] = COLLECTIVE_KINDS[func]
            return out
        if _finite(_tensors(out)):
            return out
        bad = [t for t in _tensors((args, kwargs)) if not _finite([t])]
        kinds = [_state.pending[b] for t in bad if (b := _buffer(t)) in _state.pending]
        if kinds:
            record = Record(_state.ops, "received", kinds[0], _where())
        else:
            record = Record(_state.ops, "input" if bad else "produced", str(func), _where())
        _state.first = record
        return out


def _grads_finite(optimizer: Any) -> bool:
    grads = [
        g
        for group in optimizer.param_groups
        for p in group["params"]
        if (g := _local(p.grad)) is not None
    ]
    return not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())


def _rank_list(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _describe(r: Record, ranks: str) -> str:
    if r.how == "received":
        return f"{ranks} received them through {r.op} ({r.where})"
    text = f"produced by {r.op} ({r.where}) on {ranks}"
    return text if r.how == "produced" else f"{text}, from a non-finite input (batch, parameter)"


def message(everyone: list[tuple[int, Record | None, bool]], step: int, optimizer: str) -> str:
    """The error every rank raises, from every rank's (rank, record, gradients finite)."""
    seen = sorted(
        (r.how == "received", r.index, rank, r) for rank, r, _ in everyone if r is not None
    )
    parts = []
    if seen:
        _, _, first_rank, first = seen[0]
        parts.append("first " + _describe(first, f"rank {first_rank}"))
        by_record: dict[Record, list[int]] = {}
        for _, _, rank, r in seen[1:]:
            by_record.setdefault(replace(r, index=0), []).append(rank)
        parts += [_describe(r, _rank_list(ranks)) for r, ranks in by_record.items()]
    silent = [rank for rank, r, ok in everyone if r is None and not ok]
    if silent:
        parts.append(f"{_rank_list(silent)} hold non-finite gradients no checked op produced")
    return (
        f"vescale: non-finite values at step {step}: {'; '.join(parts)}. "
        f"{optimizer}.step did not run on any rank (parameters unchanged)"
    )


def _check_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The optimizer step pre-hook: every rank raises the same :class:`NonFiniteError` if any
    rank saw a non-finite value since the last step."""
    mine = (_state.first, _grads_finite(optimizer))
    step = _state.step
    gathered = _agree.gather(f"the non-finite check of step {step}", mine)
    ranks = (
        range(len(gathered))
        if _agree.active()
        else [dist.get_rank() if dist.is_initialized() else 0]
    )
    everyone = [(rank, r, ok) for rank, (r, ok) in zip(ranks, gathered, strict=True)]
    _state.step += 1
    _state.first, _state.ops = None, 0
    _state.pending.clear()
    if any(r is not None or not ok for _, r, ok in everyone):
        raise NonFiniteError(message(everyone, step, type(optimizer).__name__))


def _start() -> None:
    mode = _FiniteMode()
    mode.__enter__()
    _state.mode, _state.step = mode, 1
    set_entry(
        global_optimizer_pre_hooks,
        "torch.optim.optimizer._global_optimizer_pre_hooks",
        _HOOK,
        _check_step,
        f"while the non-finite check is on ({ENV}, vescale.check_finite): a NaN/Inf raises "
        "NonFiniteError on every rank before the step",
    )


def _stop() -> None:
    restore_entry(global_optimizer_pre_hooks, _HOOK)
    assert _state.mode is not None
    _state.mode.__exit__(None, None, None)
    _state.mode, _state.first, _state.ops = None, None, 0
    _state.pending.clear()


@contextlib.contextmanager
def check_finite(enabled: bool = True) -> Iterator[None]:
    """The non-finite check on inside the block (nested blocks share the outer one's)."""
    if not enabled:
        yield
        return
    if _state.depth == 0:
        _start()
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        if _state.depth == 0:
            _stop()


def from_env() -> None:
    """On for the process if ``VESCALE_CHECK_FINITE`` says so (``ValueError`` naming it if
    it is not a boolean)."""
    if env_flag(ENV, False) and _state.depth == 0:
        _start()
        _state.depth = 1


def interpreted(gm: torch.fx.GraphModule, name: str) -> Callable[[list[Any]], Any]:
    """``gm`` run node by node (boxed), each node named in the check's records as
    ``<name> %<node> (file.py:line)``."""

    class Checked(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            source = user_source(n)
            outer, _state.node = (
                _state.node,
                f"{name} %{n.name}" + (f", {source}" if source else ""),
            )
            try:
                return super().run_node(n)
            finally:
                _state.node = outer

    return make_boxed_func(lambda *args: Checked(gm).run(*args))
