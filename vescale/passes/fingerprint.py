"""Rank consistency: every rank must issue the same collectives in the same order.

``fingerprint`` (the last pass) describes each collective of the final graph as
``kind dtype[shape] over mesh dim d of n`` (rank-independent: ranks in different groups
of one mesh dim issue the same sequence; an all-to-all's shape is left out, its splits may
be uneven), with graph boundaries: ``wait on input
dtype[shape]: collective issued before this graph`` where the graph waits for a collective
issued before it, ``..., waited after this graph`` for a collective it returns unwaited.
It reports the list (``ctx.reports["fingerprint"]``). :func:`from_local_calls` describes the
``from_local`` calls of a Dynamo graph (inside a compiled region they communicate nothing and
assume even shards, so their local shapes must agree on every rank).
:func:`check_rank_consistency` compares the lists of all ranks once, at the compiled graph's
first run, before it issues anything: a mismatch raises on every rank, naming each rank's
entry at the first position where the sequences differ (a ``from_local`` call, a collective,
or the end of a shorter sequence), instead of hanging in a collective that not every rank
issues.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch.fx.experimental.symbolic_shapes import optimization_hint

from vescale._node_meta import get_collective
from vescale.fx.collectives import inflight_inputs, user_source
from vescale.passes.manager import PassContext

__all__ = ["RankDivergenceError", "check_rank_consistency", "fingerprint", "from_local_calls"]

FROM_LOCAL = "from_local"


class RankDivergenceError(RuntimeError):
    """Ranks compiled different collective sequences for one graph."""


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


def from_local_calls(gm: torch.fx.GraphModule) -> list[str]:
    """One line per ``from_local`` call of the Dynamo graph ``gm``, in order:
    ``from_local dtype[local shape] as placements @ file.py:line``; with ``shape=``/``stride=``
    given, the local shape (which then may differ per rank) follows the ``@``. Symbolic sizes
    read at their example value (a rank's actual size)."""
    lines = []
    for node in gm.graph.nodes:
        if not _is_from_local(node):
            continue
        call = inspect.signature(node.target).bind(*node.args, **node.kwargs)  # type: ignore[arg-type]
        args = {k: _value(v) for k, v in call.arguments.items()}
        local = args.get("local_tensor")
        if not isinstance(local, torch.Tensor):
            continue
        dtype = str(local.dtype).removeprefix("torch.")
        shape = [int(optimization_hint(s)) for s in local.shape]
        given_pl = args.get("placements")
        placements = tuple(given_pl) if isinstance(given_pl, list | tuple) else given_pl
        site = user_source(node) or "?"
        if args.get("shape") is None:
            lines.append(f"{FROM_LOCAL} {dtype}{shape} as {placements} @ {site}")
        else:
            given = f"shape={tuple(args['shape'])}, stride={tuple(args['stride'])}"
            lines.append(f"{FROM_LOCAL} {dtype} as {placements}, {given} @ {site}, local {shape}")
    return lines


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


_UNEVEN = (
    "; a from_local call differs: inside a compiled region from_local communicates nothing "
    "and assumes even shards (the same local shape and dtype on every rank) unless shape= and "
    "stride= are given: pass them, or call from_local before the compiled region (its "
    "run_check then checks every rank's metadata)"
)


def check_rank_consistency(graph_name: str, sequence: list[str]) -> None:
    """All-gather (graph name, sequence) over the default group and raise
    :class:`RankDivergenceError` on every rank if any rank differs. ``sequence``: the graph's
    ``from_local`` calls (:func:`from_local_calls`) then its fingerprint. Skipped without a
    real multi-rank default group (single process, the ``fake`` group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return
    digest = hashlib.sha256("\n".join(map(_key, sequence)).encode()).hexdigest()
    mine = (graph_name, digest, sequence)
    everyone: list[tuple[str, str, list[str]]] = [mine] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if len({(name, d) for name, d, _ in everyone}) == 1:
        return
    seqs = [seq for _, _, seq in everyone]
    i = _first_difference(seqs)
    lines = []
    for rank, (name, _, seq) in enumerate(everyone):
        n = len(seq) - sum(map(_is_call, seq))
        lines.append(f"  rank {rank}: {name}, {n} collectives, {_entry(seq, i)}")
    cause = ""
    if i is not None and any(i < len(s) and _is_call(s[i]) for s in seqs):
        cause = _UNEVEN
    raise RankDivergenceError(
        f"vescale backend: ranks compiled different collective sequences for {graph_name} "
        f"(a rank-dependent program would hang in a collective not every rank issues); "
        f"each rank's entry where the sequences first differ{cause}:\n" + "\n".join(lines)
    )
