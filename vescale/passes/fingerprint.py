"""Rank consistency: every rank must issue the same collectives in the same order.

``fingerprint`` (the last pass) describes each collective of the final graph as
``kind dtype[shape] over mesh dim d of n`` (rank-independent: ranks in different groups
of one mesh dim issue the same sequence; an all-to-all's shape is left out, its splits may
be uneven), with graph boundaries: ``wait on input
dtype[shape]: collective issued before this graph`` where the graph waits for a collective
issued before it, ``..., waited after this graph`` for a collective it returns unwaited.
It reports the list (``ctx.reports["fingerprint"]``). :func:`from_local_calls` describes the
``from_local`` calls of a Dynamo graph (inside a compiled region they communicate nothing and,
without ``shape=``/``stride=``, assume even shards: their local shapes must agree on every
rank).

:class:`RankCheck` compares a compiled graph across ranks before it runs, in
:mod:`vescale._agree`'s side group (never the training group): phase 1 is one
``all_equal`` of a 63-bit digest of the graph's rank-independent identity (Dynamo frame,
forward/backward), explicit mode, its ``from_local`` calls with their local shapes and its
collectives; only when it differs, phase 2 gathers every rank's entries and every rank
raises the same :class:`RankDivergenceError` naming each rank's graph (name and Dynamo
compile id) and its entry where the sequences first differ (a ``from_local`` call, a
collective, or the end of a shorter sequence). A graph with even-shard ``from_local`` calls is
checked at every call (its correctness depends on the other ranks' local shapes: an uneven
last batch recompiles on one rank only, and that rank's new graph and the others' cached one
meet in this check); other graphs at their first run, except a recompile whose digest passed
already (a rank that recompiled alone into the same collectives, e.g. plain-tensor DDP on an
uneven batch, must not wait for ranks that run their cached graph; it issues what they
do). A rank that does not arrive is
:mod:`vescale._agree`'s ``AgreementError`` after ``VESCALE_TIMEOUT_S``, naming it and its last
check.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.fx.experimental.symbolic_shapes import optimization_hint

from vescale import _agree
from vescale._node_meta import get_collective
from vescale.fx.collectives import inflight_inputs, user_source
from vescale.passes.manager import PassContext

__all__ = [
    "FromLocal",
    "RankCheck",
    "RankDivergenceError",
    "check_rank_consistency",
    "fingerprint",
    "from_local_calls",
]

FROM_LOCAL = "from_local"


class RankDivergenceError(RuntimeError):
    """Ranks are about to run graphs that differ (collectives, ``from_local`` local shapes,
    explicit mode, or the graph itself)."""


def fingerprint(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Report the collective sequence of ``gm`` (its records come from the pass manager),
    graph boundaries included: where the graph waits for a collective issued before it, and
    which collectives it returns unwaited."""
    before = {w: v for v, ws in inflight_inputs(gm).items() for w in ws}
    lines = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        shape = list(val.shape) if isinstance(val, torch.Tensor) else "[?]"
        dtype = str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else ""
        if node in before:
            lines.append(f"wait on input {dtype}{shape}: collective issued before this graph")
        rec = get_collective(node)
        if rec is not None:
            group = f"mesh dim {rec['mesh_dim']}" if rec["mesh_dim"] is not None else "group"
            after = ", waited after this graph" if rec.get("waited") == "after graph" else ""
            # an all-to-all's sizes may differ by rank (uneven splits: RaggedShard)
            size = "" if rec["kind"] == "all_to_all" else shape
            lines.append(
                f"{rec['kind']} {rec['dtype']}{size} over {group} of "
                f"{len(rec['group_ranks'])}{after} @ {rec['source'] or '?'}"
            )
    ctx.reports["fingerprint"] = lines
    return gm


def _is_from_local(node: torch.fx.Node) -> bool:
    target = node.target
    return (
        node.op == "call_function"
        and getattr(target, "__name__", None) == FROM_LOCAL
        and getattr(target, "__module__", "").startswith("vescale.")
    )


def _value(arg: Any) -> Any:
    return arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else arg


Sizes = Mapping[str, int]  # a dynamic graph's size symbols (by name) at one call


def _size(s: int | torch.SymInt, sizes: Sizes | None) -> int | str:
    """``s`` at this call (``sizes``), else its symbol text (``sizes`` ``None``), or an int."""
    if isinstance(s, int):
        return s
    expr = s.node.expr
    if sizes is None:
        return str(expr)
    values = {sym: sizes[sym.name] for sym in expr.free_symbols if sym.name in sizes}
    known = len(values) == len(expr.free_symbols)
    return int(expr.xreplace(values)) if known else int(optimization_hint(s))


class FromLocal(NamedTuple):
    """One ``from_local`` call of a Dynamo graph: local dtype and shape (symbolic where the
    graph is dynamic), placements, ``shape=``/``stride=`` when given, the user line."""

    dtype: str
    shape: tuple[int | torch.SymInt, ...]
    placements: Any
    given: str | None
    site: str

    @property
    def even(self) -> bool:
        """Whether it assumes even shards (no ``shape=``/``stride=``)."""
        return self.given is None

    def line(self, sizes: Sizes | None = None) -> str:
        """``from_local dtype[local shape] as placements @ file.py:line``; with ``shape=``
        given, the local shape (which then may differ per rank) follows the ``@``. A symbolic
        size reads from ``sizes``, else as its symbol (``s0``)."""
        shape = [_size(s, sizes) for s in self.shape]
        if self.given is None:
            return f"{FROM_LOCAL} {self.dtype}{shape} as {self.placements} @ {self.site}"
        return f"{FROM_LOCAL} {self.dtype} as {self.placements}, {self.given} @ {self.site}, local {shape}"


def from_local_calls(gm: torch.fx.GraphModule) -> list[FromLocal]:
    """The ``from_local`` calls of the Dynamo graph ``gm``, in order."""
    calls = []
    for node in gm.graph.nodes:
        if not _is_from_local(node):
            continue
        call = inspect.signature(node.target).bind(*node.args, **node.kwargs)  # type: ignore[arg-type]
        args = {k: _value(v) for k, v in call.arguments.items()}
        local = args.get("local_tensor")
        if not isinstance(local, torch.Tensor):
            continue
        given_pl = args.get("placements")
        placements = tuple(given_pl) if isinstance(given_pl, list | tuple) else given_pl
        given = None
        if args.get("shape") is not None:
            given = f"shape={tuple(args['shape'])}, stride={tuple(args['stride'])}"
        dtype = str(local.dtype).removeprefix("torch.")
        calls.append(
            FromLocal(dtype, tuple(local.shape), placements, given, user_source(node) or "?")
        )
    return calls


def size_args(calls: Sequence[FromLocal], example_inputs: Sequence[Any]) -> dict[str, int]:
    """Which graph input holds each size symbol of the even-shard ``calls``' local shapes:
    ``{symbol name: input index}`` (empty for a static graph)."""
    names = {
        sym.name
        for c in calls
        if c.even
        for s in c.shape
        if isinstance(s, torch.SymInt)
        for sym in s.node.expr.free_symbols
    }
    return {
        str(a.node.expr): i
        for i, a in enumerate(example_inputs)
        if isinstance(a, torch.SymInt) and str(a.node.expr) in names
    }


def _key(line: str) -> str:
    return line.split(" @ ")[0]  # the source line may differ between ranks' files


def _first_difference(seqs: list[list[str]]) -> int | None:
    """The first position where the ranks' sequences differ (one ending counts), or None."""
    for i in range(max(map(len, seqs))):
        if len({_key(s[i]) if i < len(s) else None for s in seqs}) > 1:
            return i
    return None


def _is_call(entry: str) -> bool:
    return entry.startswith(f"{FROM_LOCAL} ")


def _entry(seq: list[str], i: int | None) -> str:
    """``seq[i]`` labelled with its index among its kind (from_local calls come first)."""
    if i is None:
        return "the same sequence"
    calls = sum(map(_is_call, seq))
    if i >= len(seq):
        return f"#{len(seq) - calls}: (no more collectives)"
    return f"call #{i}: {seq[i]}" if _is_call(seq[i]) else f"#{i - calls}: {seq[i]}"


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest()) >> 1


_UNEVEN = (
    "; a from_local call differs: inside a compiled region from_local communicates nothing "
    "and assumes even shards (the same local shape and dtype on every rank) unless shape= and "
    "stride= are given. For an uneven last batch drop it (DataLoader(drop_last=True)) or pad "
    "it to the same local shape on every rank; otherwise pass shape= and stride= (the global "
    "layout), or call from_local before the compiled region (its run_check then checks every "
    "rank's metadata)"
)
_RECOMPILED = (
    "; the ranks run different compiles of one graph (Dynamo compile ids differ): a rank "
    "recompiled alone, as its guards (e.g. on a local batch size) failed there only"
)
_MARK_DYNAMIC = (
    "; give every rank the same shapes, or mark such sizes dynamic from the start "
    "(torch._dynamo.mark_dynamic) so that no rank recompiles alone"
)
_EXPLICIT = (
    "; explicit mode differs across ranks: set the backend option explicit, "
    "VESCALE_DISABLE_REDISTRIBUTE and explicit_redistribute scopes the same on every rank"
)


class _Entry(NamedTuple):
    """What phase 2 gathers from one rank."""

    name: str
    compile_id: str
    identity: str
    explicit: tuple[bool, str]
    failure: str | None
    sequence: list[str]


_agreed: dict[int, set[int]] = {}  # per default group: digests of first-run checks that passed


@dataclass
class RankCheck:
    """The rank check of one compiled graph (see the module doc): ``name`` (this rank's
    ``graph<i>.forward``), ``identity`` (rank-independent: Dynamo frame and forward/backward),
    ``compile_id`` (Dynamo's, ``frame/compile``), ``explicit`` (explicit mode and what set
    it), the ``from_local`` ``calls`` and ``collectives`` (:func:`fingerprint`),
    ``size_args`` (:func:`size_args`), or the ``failure`` that stopped its capture (raised
    after the check, so a rank whose capture failed alone fails the check on every rank)."""

    name: str
    identity: str
    compile_id: str
    explicit: tuple[bool, str]
    calls: list[FromLocal]
    collectives: list[str]
    size_args: dict[str, int] = field(default_factory=dict)
    failure: str | None = None
    every_call: bool = field(init=False)
    digest: int = field(init=False)  # of everything but the sizes at a call
    checked: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.every_call = any(c.even for c in self.calls)
        text = [self.identity, f"explicit={self.explicit[0]}", f"failure={self.failure}"]
        self.digest = _digest("\n".join(text + [_key(x) for x in self.sequence()]))

    @property
    def recompiled(self) -> bool:
        """Whether Dynamo compiled this graph's frame before (compile id ``f/c``, ``c > 0``)."""
        return self.compile_id.rpartition("/")[2] not in ("0", "?")

    def sequence(self, sizes: Sizes | None = None) -> list[str]:
        """The ``from_local`` calls (shapes at ``sizes``) then the collectives."""
        return [*(c.line(sizes) for c in self.calls), *self.collectives]

    def before_run(self, args: Sequence[Any]) -> None:
        """Check before a run with graph inputs ``args`` (every call, or the first; see the
        module doc). Cost where the ranks agree: one all-reduce of two int64s (16 bytes) in
        the gloo side group."""
        if self.checked and not self.every_call:
            return
        self.checked = True
        agreed = _agreed.setdefault(id(dist.group.WORLD), set())
        if not self.every_call and self.recompiled and self.digest in agreed:
            return
        sizes = {name: int(args[i]) for name, i in self.size_args.items()}
        check_rank_consistency(self, sizes)
        if not self.every_call:
            agreed.add(self.digest)


def check_rank_consistency(check: RankCheck, sizes: Sizes | None = None) -> None:
    """Raise :class:`RankDivergenceError` on every rank if any rank's ``check`` (with its
    dynamic ``sizes`` at this call) differs; see the module doc. Passes at once without a
    real multi-rank default group (one process, the ``fake`` group)."""
    digest = check.digest
    if sizes:
        digest = _digest(f"{digest} {sorted(sizes.items())}")
    what = f"rank check of {check.name}"
    if _agree.all_equal(what, digest):
        return
    mine = _Entry(
        check.name,
        check.compile_id,
        check.identity,
        check.explicit,
        check.failure,
        check.sequence(sizes or {}),
    )
    raise RankDivergenceError(_message(_agree.gather(f"{what} (each rank's entries)", mine)))


def _message(everyone: list[_Entry]) -> str:
    """The same text on every rank: each rank's graph and its first differing entry."""
    seqs = [e.sequence for e in everyone]
    i = _first_difference(seqs)
    explicit_differs = len({e.explicit[0] for e in everyone}) > 1
    lines = []
    for rank, e in enumerate(everyone):
        n = len(e.sequence) - sum(map(_is_call, e.sequence))
        mode = f", explicit mode {'on' if e.explicit[0] else 'off'} ({e.explicit[1]})"
        what = (
            f"its capture failed: {e.failure}"
            if e.failure
            else f"{n} collectives, {_entry(e.sequence, i)}"
        )
        shown = mode if explicit_differs else ""
        lines.append(f"  rank {rank}: {e.name} (compile {e.compile_id}){shown}, {what}")
    uneven = i is not None and any(i < len(s) and _is_call(s[i]) for s in seqs)
    cause = _UNEVEN if uneven else ""
    if len({e.identity for e in everyone}) == 1 and len({e.compile_id for e in everyone}) > 1:
        cause += _RECOMPILED if uneven else _RECOMPILED + _MARK_DYNAMIC
    if explicit_differs:
        cause += _EXPLICIT
    return (
        "vescale backend: the rank check found that the ranks are about to run different "
        "graphs (a rank-dependent program would hang in a collective not every rank issues); "
        f"each rank's graph and its entry where the sequences first differ{cause}:\n"
        + "\n".join(lines)
    )
