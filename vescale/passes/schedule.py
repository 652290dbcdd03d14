"""``schedule``: issue collectives early and wait late, so independent compute overlaps them.

A deterministic list scheduling of the graph, from its structure alone (every rank makes
the same decisions):

* a collective is issued as soon as its inputs exist, but never before the collective that
  preceded it in the graph: the order of collectives is unchanged on every rank;
* its ``wait_tensor`` is placed just before the first node that needs the result;
* graph boundaries: a tensor whose collective was issued before this graph (an
  ``AsyncCollectiveTensor`` input, waited by a ``wait_tensor`` on the graph input) counts as
  in flight from the graph's start; its waits are placed just before the first node that
  reads it, through a wait or directly (its buffer is written until waited). A collective
  whose result the graph returns unwaited is issued like any other and stays unwaited;
* other nodes keep their relative graph order;
* memory cap: before issuing a collective whose output would raise the bytes of issued but
  not yet waited results above ``ctx.options.overlap_cap_mb``, the oldest in-flight results are waited.

``ctx.reports["overlap"]`` holds how many nodes each collective now overlaps,
``ctx.reports["overlap_inputs"]`` how many nodes run before each in-flight input is waited.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

import torch

from vescale.fx.collectives import (
    COLLECTIVE_KINDS,
    WAIT_TENSOR,
    inflight_inputs,
    node_bytes,
    waited_node,
)
from vescale.passes.manager import PassContext

__all__ = ["schedule", "schedule_order"]


def schedule_order(gm: torch.fx.GraphModule, cap_bytes: int) -> list[torch.fx.Node]:
    """The new node order (see module docstring)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    is_coll = {n: n.op == "call_function" and n.target in COLLECTIVE_KINDS for n in nodes}
    is_wait = {n: n.op == "call_function" and n.target is WAIT_TENSOR for n in nodes}
    colls = [n for n in nodes if is_coll[n]]
    prev = {c: p for p, c in itertools.pairwise(colls)}

    def root(wait: torch.fx.Node) -> torch.fx.Node:
        """The node a wait (or a wait of a wait: a waited result waited again) waits for."""
        while is_wait[wait]:
            wait = waited_node(wait)
        return wait

    # waited node (a collective, or a tensor whose collective was issued before this graph)
    # -> its waits in graph order, all placed together when the result is first needed
    waits: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in nodes:
        if is_wait[n]:
            waits.setdefault(root(n), []).append(n)

    def gates(n: torch.fx.Node) -> list[torch.fx.Node]:
        """What must be scheduled before ``n`` can be: inputs, a wait counting as the node it
        waits on (the wait itself is placed on demand)."""
        out = [root(a) if is_wait[a] else a for a in n.all_input_nodes]
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
    ready_compute: list[int] = []  # indices
    ready_colls: deque[torch.fx.Node] = deque()
    inflight: deque[torch.fx.Node] = deque()  # waited nodes placed, their waits not yet
    inflight_bytes = 0

    def place(n: torch.fx.Node) -> None:
        nonlocal inflight_bytes
        order.append(n)
        if n in waits:
            inflight.append(n)
            inflight_bytes += node_bytes(n)
        for user in waiting_on.get(n, ()):
            blockers[user].discard(n)
            if not blockers[user]:
                if is_coll[user]:
                    ready_colls.append(user)
                else:
                    heapq.heappush(ready_compute, index[user])

    def settle(v: torch.fx.Node) -> None:
        """Place the waits of ``v`` if it is still in flight."""
        nonlocal inflight_bytes
        if v in inflight:
            inflight.remove(v)
            inflight_bytes -= node_bytes(v)
            order.extend(waits[v])

    def settle_inputs(n: torch.fx.Node) -> None:
        """Wait for what ``n`` reads: results through their wait, and tensors of collectives
        issued before the graph that ``n`` reads directly (their buffer is still written)."""
        for a in n.all_input_nodes:
            if is_wait[a]:
                settle(root(a))
            elif a in waits and not is_coll[a]:
                settle(a)

    for n, gs in blockers.items():
        if not gs and n.op != "placeholder":
            if is_coll[n]:
                ready_colls.append(n)
            else:
                heapq.heappush(ready_compute, index[n])
    for n in nodes:  # inputs first, in their order: in-flight ones count from the start
        if n.op == "placeholder":
            place(n)
    while ready_colls or ready_compute:
        if ready_colls:
            c = ready_colls.popleft()
            while inflight and inflight_bytes + node_bytes(c) > cap_bytes:
                settle(inflight[0])
            settle_inputs(c)  # a chained collective needs the previous result
            place(c)
            continue
        n = nodes[heapq.heappop(ready_compute)]
        settle_inputs(n)
        place(n)
    for v in list(inflight):  # results only the output needs, or nobody
        settle(v)
    order.append(output)
    if len(order) != len(nodes) or output.op != "output":
        raise RuntimeError(f"schedule: {len(nodes) - len(order)} nodes could not be ordered")
    return order


def schedule(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Reorder ``gm`` for overlap (no-op unless ``ctx.options.overlap``)."""
    if not ctx.options.overlap:
        return gm
    cap = int(float(ctx.options.overlap_cap_mb) * 2**20)
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
    placeholders = sum(n.op == "placeholder" for n in order)
    ctx.reports["overlap_inputs"] = {
        v.name: pos[ws[0]] - max(pos[v], placeholders - 1) - 1
        for v, ws in inflight_inputs(gm).items()
    }
    return gm
