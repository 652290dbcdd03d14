"""``eliminate``: drop collectives whose work is discarded or undone.

* A collective whose waited result nobody uses is removed, always (option or not): the
  captured backward can hold forward computations AOTAutograd replays and never uses (e.g. a
  vocabulary-parallel loss's max all-reduce), kept alive only because a collective is
  impure. Eager never issues them; every rank compiles the same graph, so every rank drops
  the same ones.
* With ``ctx.options.eliminate``: an all-gather whose result is only sliced back to this
  rank's own chunk (dim 0, the gathered dim: ``slice``/``narrow`` or ``split`` + ``getitem``)
  at the coordinate of the gather's own mesh dim (a redistribution ``R -> S(0)`` of that dim
  alone, from the placements recorded at capture: the own chunk on every rank, so every rank
  decides alike) is the identity on that chunk: the slice is replaced by the all-gather's
  input (a redistribute ``S -> R -> S``), and the all-gather then goes as unused.

Graph boundaries are left alone: a ``wait_tensor`` on a tensor whose collective was issued
before the graph is kept even when nothing reads its result (it still completes the
collective), and a collective the graph returns unwaited is used (by a later region).

Both rewrites are exact; ``ctx.reports["eliminated"]`` counts removed collectives.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.distributed as dist

from vescale._node_meta import get_placements
from vescale._torch_compat import resolve_process_group
from vescale.fx.collectives import COLLECTIVE_KINDS, WAIT_TENSOR, group_name, mesh_dim_of_group
from vescale.passes.manager import PassContext

__all__ = ["eliminate"]

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional


def _rank_in_group(node: torch.fx.Node) -> int | None:
    if not dist.is_initialized():
        return None
    ranks = dist.get_process_group_ranks(resolve_process_group(group_name(node)))  # type: ignore[arg-type]
    return ranks.index(dist.get_rank()) if dist.get_rank() in ranks else None


def _own_chunk(user: torch.fx.Node, rank: int, rows: int) -> torch.fx.Node | None:
    """``user`` (of the waited all-gather) if it selects rows [rank*rows, (rank+1)*rows)."""
    if user.target is aten.slice.Tensor:
        _, dim, start, end, step = list(user.args) + [None] * (5 - len(user.args))
        if (
            (dim or 0) == 0
            and (step or 1) == 1
            and (start, end) == (rank * rows, (rank + 1) * rows)
        ):
            return user
    if user.target is aten.split.Tensor and user.args[1] == rows and user.args[2:] in ((), (0,)):
        items = list(user.users)
        if len(items) == 1 and items[0].target is operator.getitem and items[0].args[1] == rank:
            return items[0]
    return None


def eliminate(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Remove unused collectives; with ``ctx.options.eliminate`` also undone all-gathers."""
    if ctx.options.eliminate:
        _forward_own_chunks(gm)
    removed, changed = 0, True
    while changed:  # a dead chain may feed one collective into another
        gm.graph.eliminate_dead_code()  # pure ops only: waits and collectives are impure
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in COLLECTIVE_KINDS:
                continue
            for w in [u for u in node.users if u.target is WAIT_TENSOR and not u.users]:
                gm.graph.erase_node(w)
            if not node.users:
                gm.graph.erase_node(node)
                removed += 1
                changed = True
    ctx.reports["eliminated"] = removed
    return gm


def _takes_back_over(wait: torch.fx.Node, chunk: torch.fx.Node, dim: int | None) -> bool:
    """``chunk`` ends a redistribution that changes mesh dim ``dim`` alone, ``R -> S(0)``,
    of the gathered result ``wait`` (placements recorded at capture): such a chunk is taken at
    the coordinate of ``dim`` on every rank, as the gather over ``dim`` orders the pieces."""
    before, after = get_placements(wait), get_placements(chunk)
    if dim is None or before is None or after is None or len(before) != len(after):
        return False
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    return changed == [dim] and before[dim] == "R" and after[dim] == "S(0)"


def _forward_own_chunks(gm: torch.fx.GraphModule) -> None:
    """Slices of an all-gather back to this rank's own chunk read the all-gather's input,
    where the chunk is the own one on every rank by construction (:func:`_takes_back_over`):
    the slice bounds are this rank's traced constants, and a chunk at another mesh dim's
    coordinate (``(R, S(0)) -> (S(0), R)``) is the own one on some ranks only, which would
    compile a different program there."""
    for node in list(gm.graph.nodes):
        if node.target is not _c10d.all_gather_into_tensor.default or len(node.users) != 1:
            continue
        (wait,) = node.users
        if wait.target is not WAIT_TENSOR:  # returned unwaited: a later region reads it
            continue
        inp: Any = node.args[0]
        rank = _rank_in_group(node)
        rows = inp.meta["val"].shape[0] if "val" in inp.meta else None
        dim = mesh_dim_of_group(group_name(node))
        for user in list(wait.users):
            chunk = _own_chunk(user, rank, rows) if rank is not None and rows else None
            val = chunk.meta.get("val") if chunk is not None else None
            if (
                chunk is not None
                and val is not None
                and val.shape == inp.meta["val"].shape
                and _takes_back_over(wait, chunk, dim)
            ):
                chunk.replace_all_uses_with(inp)
    gm.graph.eliminate_dead_code()  # the slices now unused; waits and collectives stay (impure)
