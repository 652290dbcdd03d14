"""``schedule``: issue collectives early and wait late, so independent compute overlaps them.

A deterministic list scheduling of the graph, from its structure alone (every rank makes
the same decisions):

* a collective is issued as soon as its inputs exist, but never before the collective that
  preceded it in the graph: the order of collectives is unchanged on every rank;
* its ``wait_tensor`` is placed just before the first node that needs the result;
* other nodes keep their relative graph order;
* memory cap: before issuing a collective whose output would raise the bytes of issued but
  not yet waited results above ``overlap_cap_mb``, the oldest in-flight results are waited.

``ctx.reports["overlap"]`` holds how many nodes each collective now overlaps.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import cast

import torch

from vescale.fx.collectives import COLLECTIVE_KINDS, WAIT_TENSOR, node_bytes
from vescale.passes.manager import PassContext

__all__ = ["schedule", "schedule_order"]


def _collective(wait: torch.fx.Node) -> torch.fx.Node:
    return cast(torch.fx.Node, wait.args[0])


def schedule_order(gm: torch.fx.GraphModule, cap_bytes: int) -> list[torch.fx.Node]:
    """The new node order (see module docstring)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    is_coll = {n: n.op == "call_function" and n.target in COLLECTIVE_KINDS for n in nodes}
    is_wait = {n: n.op == "call_function" and n.target is WAIT_TENSOR for n in nodes}
    colls = [n for n in nodes if is_coll[n]]
    prev = {c: p for p, c in itertools.pairwise(colls)}

    def gates(n: torch.fx.Node) -> list[torch.fx.Node]:
        """What must be scheduled before ``n`` can be: inputs, a wait counting as its
        collective (the wait itself is placed on demand)."""
        out = [_collective(a) if is_wait[a] else a for a in n.all_input_nodes]
        if n in prev:
            out.append(prev[n])
        return out

    output = nodes[-1]
    blockers = {n: set(gates(n)) for n in nodes if not is_wait[n] and n is not output}
    waiting_on: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n, gs in blockers.items():
        for g in gs:
            waiting_on.setdefault(g, []).append(n)
    order: list[torch.fx.Node] = []
    done: set[torch.fx.Node] = set()
    ready_compute: list[int] = []  # indices
    ready_colls: deque[torch.fx.Node] = deque()
    inflight: deque[torch.fx.Node] = deque()  # collectives issued, wait not yet placed
    inflight_bytes = 0
    wait_of = {_collective(a): a for a in nodes if is_wait[a]}

    def place(n: torch.fx.Node) -> None:
        order.append(n)
        done.add(n)
        for user in waiting_on.get(n, ()):
            blockers[user].discard(n)
            if not blockers[user]:
                if is_coll[user]:
                    ready_colls.append(user)
                else:
                    heapq.heappush(ready_compute, index[user])

    def place_wait(w: torch.fx.Node) -> None:
        nonlocal inflight_bytes
        if w in done:
            return
        c = _collective(w)
        inflight.remove(c)
        inflight_bytes -= node_bytes(c)
        place(w)

    for n, gs in blockers.items():
        if not gs:
            if is_coll[n]:
                ready_colls.append(n)
            else:
                heapq.heappush(ready_compute, index[n])
    while ready_colls or ready_compute:
        if ready_colls:
            c = ready_colls.popleft()
            while inflight and inflight_bytes + node_bytes(c) > cap_bytes:
                place_wait(wait_of[inflight[0]])
            for a in c.all_input_nodes:  # a chained collective needs the previous result
                if is_wait[a]:
                    place_wait(a)
            place(c)
            if c in wait_of:
                inflight.append(c)
                inflight_bytes += node_bytes(c)
            continue
        n = nodes[heapq.heappop(ready_compute)]
        for a in n.all_input_nodes:
            if is_wait[a]:
                place_wait(a)
        place(n)
    for c in list(inflight):  # results only the output needs, or nobody
        place_wait(wait_of[c])
    order.append(output)
    if len(order) != len(nodes) or output.op != "output":
        raise RuntimeError(f"schedule: {len(nodes) - len(order)} nodes could not be ordered")
    return order


def schedule(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Reorder ``gm`` for overlap (no-op unless ``ctx.options["overlap"]``)."""
    if not ctx.options.get("overlap", False):
        return gm
    cap = int(float(ctx.options.get("overlap_cap_mb", 256)) * 2**20)
    order = schedule_order(gm, cap)
    for before, after in itertools.pairwise(order):
        before.append(after)
    gm.graph.lint()
    pos = {n: i for i, n in enumerate(order)}
    ctx.reports["overlap"] = {
        n.name: pos[w] - pos[n] - 1
        for n in order
        if n.target in COLLECTIVE_KINDS
        for w in n.users
        if w.target is WAIT_TENSOR
    }
    return gm
