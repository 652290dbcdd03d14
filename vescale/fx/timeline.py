"""``schedule.json``: a graph's estimated timeline in Chrome trace format (open in Perfetto).

Two lanes per graph: ``compute`` (nodes run one after another) and ``communication``
(a collective starts when issued and the link is free). A ``wait_tensor`` stalls compute
until its collective ends. Durations are static estimates from shapes only, identical on
every rank: matrix products at ``FLOPS``, other ops at memory bandwidth ``MEM_BPS`` over
their output, collectives ``LATENCY_US`` + bytes over ``LINK_BPS``. They order and size
events for reading; they are not measurements. A collective issued before the graph (an
input waited in it) is drawn as issued at the graph's start, sized by the tensor it delivers
(the worst case: issued just before the graph); one the graph returns unwaited has no wait.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint

from vescale.fx.collectives import (
    COLLECTIVE_KINDS,
    WAIT_TENSOR,
    inflight_inputs,
    node_bytes,
    numel_hint,
)

__all__ = ["estimate_us", "timeline", "write_schedule_json"]

FLOPS = 20e9
MEM_BPS = 10e9
LINK_BPS = 1e9
LATENCY_US = 30.0
_MATMUL = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
}


def estimate_us(node: torch.fx.Node) -> float:
    """Static duration estimate of ``node`` in microseconds."""
    if node.op != "call_function" or node.target is WAIT_TENSOR:
        return 0.0
    if node.target in COLLECTIVE_KINDS:
        return LATENCY_US + node_bytes(node.all_input_nodes[0]) / LINK_BPS * 1e6
    out = node.meta.get("val")
    if node.target in _MATMUL and isinstance(out, torch.Tensor):
        inner = optimization_hint(node.all_input_nodes[-1].meta["val"].shape[-2])
        return 2.0 * numel_hint(out) * inner / FLOPS * 1e6
    return node_bytes(node) / MEM_BPS * 1e6


def timeline(gm: torch.fx.GraphModule, graph: str) -> list[dict[str, Any]]:
    """Chrome trace events of ``gm`` in its current order (see module docstring)."""
    events: list[dict[str, Any]] = []
    compute_t = comm_t = 0.0
    ends: dict[torch.fx.Node, float] = {}
    for node in inflight_inputs(gm):
        dur = LATENCY_US + node_bytes(node) / LINK_BPS * 1e6
        events.append(
            _event(f"issued before this graph %{node.name}", comm_t, dur, graph, "communication")
        )
        comm_t = ends[node] = comm_t + dur
    for node in gm.graph.nodes:
        dur = estimate_us(node)
        if node.op == "call_function" and node.target in COLLECTIVE_KINDS:
            start = max(compute_t, comm_t)
            comm_t = ends[node] = start + dur
            lane, name = "communication", str(node.target).split(".")[1]
        elif node.target is WAIT_TENSOR:
            start, dur = compute_t, max(0.0, ends.get(node.args[0], 0.0) - compute_t)  # type: ignore[arg-type]
            compute_t += dur
            lane, name = "compute", "wait"
        elif dur > 0:
            start = compute_t
            compute_t += dur
            lane, name = "compute", str(node.target).removeprefix("aten.")
        else:
            continue
        events.append(_event(f"{name} %{node.name}", start, dur, graph, lane))
    return events


def _event(name: str, start: float, dur: float, graph: str, lane: str) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "ts": round(start, 3),
        "dur": round(dur, 3),
        "pid": graph,
        "tid": lane,
    }


def write_schedule_json(path: Path, gm: torch.fx.GraphModule, graph: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": timeline(gm, graph)}, indent=0) + "\n")
