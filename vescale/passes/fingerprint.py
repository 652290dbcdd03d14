"""Rank consistency: every rank must issue the same collectives in the same order.

``fingerprint`` (the last pass) describes each collective of the final graph as
``kind dtype[shape] over mesh dim d of n`` (rank-independent: ranks in different groups
of one mesh dim issue the same sequence), with graph boundaries: ``wait on input
dtype[shape]: collective issued before this graph`` where the graph waits for a collective
issued before it, ``..., waited after this graph`` for a collective it returns unwaited.
It reports the list (``ctx.reports["fingerprint"]``).
:func:`check_rank_consistency` compares the lists of all ranks once, at the compiled graph's
first run, before it issues anything: a mismatch raises on every rank, naming the first
differing collective of each rank, instead of hanging in a collective that not every rank
issues.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from vescale.fx.collectives import inflight_inputs
from vescale.passes.manager import PassContext

__all__ = ["RankDivergenceError", "check_rank_consistency", "fingerprint"]


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
        rec = (node.meta.get("custom") or {}).get("vescale_collective")
        if rec is not None:
            group = f"mesh dim {rec['mesh_dim']}" if rec["mesh_dim"] is not None else "group"
            after = ", waited after this graph" if rec.get("waited") == "after graph" else ""
            lines.append(
                f"{rec['kind']} {rec['dtype']}{shape} over {group} of "
                f"{len(rec['group_ranks'])}{after} @ {rec['source'] or '?'}"
            )
    ctx.reports["fingerprint"] = lines
    return gm


def _key(line: str) -> str:
    return line.split(" @ ")[0]  # the source line may differ between ranks' files


def check_rank_consistency(graph_name: str, sequence: list[str]) -> None:
    """All-gather (graph name, collective sequence) over the default group and raise
    :class:`RankDivergenceError` on every rank if any rank differs. Skipped without a real multi-rank
    default group (single process, the ``fake`` group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return
    digest = hashlib.sha256("\n".join(map(_key, sequence)).encode()).hexdigest()
    mine = (graph_name, digest, sequence)
    everyone: list[tuple[str, str, list[str]]] = [mine] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if len({(name, d) for name, d, _ in everyone}) == 1:
        return
    ref = everyone[0][2]
    lines = []
    for rank, (name, _, seq) in enumerate(everyone):
        i = next(
            (k for k, (a, b) in enumerate(zip(seq, ref)) if _key(a) != _key(b)),
            min(len(seq), len(ref)),
        )
        first = seq[i] if i < len(seq) else "(no more collectives)"
        lines.append(f"  rank {rank}: {name}, {len(seq)} collectives, #{i}: {first}")
    raise RankDivergenceError(
        f"vescale backend: ranks compiled different collective sequences for {graph_name} "
        f"(a rank-dependent program would hang in a collective not every rank issues); "
        f"first difference from rank 0:\n" + "\n".join(lines)
    )
