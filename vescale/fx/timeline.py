"""``schedule.json``: a graph's estimated timeline in Chrome trace format (open in Perfetto).

One process (``pid`` 1, named after the graph) with two threads: ``compute`` (``tid`` 1,
nodes run one after another) and ``communication`` (``tid`` 2, a collective starts when
issued and the link is free); metadata events name them, and each event's ``args`` hold the
node, its estimate and, for a collective, its bytes, bucket and user source line. A ``wait_tensor`` stalls compute
until its collective ends. Durations come from the cost model of :mod:`vescale.cost`, the
one the plan path's solver uses: an op ``op_s + max(FLOPs / flops_rate, bytes * gamma)``
(views free), a collective ``alpha + beta * wire`` of the mesh dim whose group it uses. The
constants are those calibrated in this process for that mesh (the plan path calibrates;
they are agreed across ranks), else the defaults, so the timeline is identical on every rank.
They order and size events for reading; they are not measurements. A collective issued
before the graph (an input waited in it) is drawn as issued at the graph's start, sized by
the tensor it delivers (the worst case: issued just before the graph); one the graph returns
unwaited has no wait.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vescale._node_meta import get_bucket
from vescale.cost.calibration import calibrated
from vescale.cost.model import CostModel, default_cost_model, tensor_args
from vescale.dtensor.device_mesh import known_meshes
from vescale.fx.collectives import (
    COLLECTIVE_KINDS,
    WAIT_TENSOR,
    group_name,
    inflight_inputs,
    node_bytes,
    numel_hint,
    user_source,
)

__all__ = ["LANES", "chrome_trace", "estimate_us", "timeline", "write_schedule_json"]

LANES = {"compute": 1, "communication": 2}
"""Thread id of each lane."""


def _group(node: torch.fx.Node) -> tuple[CostModel, int, int]:
    """The cost model, mesh dim and group size of a collective node's process group (a group
    of no known mesh: the defaults over the world)."""
    name = group_name(node)
    for mesh in known_meshes():
        names = list(getattr(mesh, "_dim_group_names", None) or [])
        if name in names:
            d = names.index(name)
            return calibrated(mesh) or default_cost_model(mesh.ndim), d, mesh.size(d)
    world = dist.get_world_size() if dist.is_initialized() else 2
    return default_cost_model(1), 0, world


def _compute_model() -> CostModel:
    for mesh in known_meshes():
        model = calibrated(mesh)
        if model is not None:
            return model
    return default_cost_model(1)


def estimate_us(node: torch.fx.Node, model: CostModel | None = None) -> float:
    """Static duration estimate of ``node`` in microseconds (``model``: of its compute;
    default: the calibrated one of a known mesh, else the defaults)."""
    if node.op != "call_function" or node.target is WAIT_TENSOR:
        return 0.0
    if node.target in COLLECTIVE_KINDS:
        comm, d, n = _group(node)
        nbytes = node_bytes(node.all_input_nodes[0])
        return comm.comm_s(COLLECTIVE_KINDS[node.target], (d,), n, nbytes) * 1e6
    model = model or _compute_model()
    nbytes = sum(node_bytes(a) for a in tensor_args(node)) + _out_bytes(node.meta.get("val"))
    return model.op_time(node, nbytes) * 1e6


def _out_bytes(val: object) -> int:
    vals = val if isinstance(val, tuple | list) else (val,)
    return sum(numel_hint(v) * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def timeline(gm: torch.fx.GraphModule, graph: str) -> list[dict[str, Any]]:
    """Chrome trace events of ``gm`` in its current order (see module docstring)."""
    events: list[dict[str, Any]] = []
    compute_t = comm_t = 0.0
    ends: dict[torch.fx.Node, float] = {}
    compute = _compute_model()
    for node in inflight_inputs(gm):
        dur = (compute.alpha[0] + compute.beta[0] * node_bytes(node)) * 1e6
        name = f"issued before this graph %{node.name}"
        events.append(_event(name, comm_t, dur, "communication", node, node_bytes(node)))
        comm_t = ends[node] = comm_t + dur
    for node in gm.graph.nodes:
        dur = estimate_us(node, compute)
        nbytes = None
        if node.op == "call_function" and node.target in COLLECTIVE_KINDS:
            start = max(compute_t, comm_t)
            comm_t = ends[node] = start + dur
            lane, name = "communication", str(node.target).split(".")[1]
            nbytes = node_bytes(node.all_input_nodes[0])
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
        events.append(_event(f"{name} %{node.name}", start, dur, lane, node, nbytes))
    return events


def _event(
    name: str, start: float, dur: float, lane: str, node: torch.fx.Node, nbytes: int | None
) -> dict[str, Any]:
    args: dict[str, Any] = {"node": node.name, "estimate_us": round(dur, 3)}
    if nbytes is not None:
        args["bytes"] = nbytes
        args["bucket"] = get_bucket(node)
    if source := user_source(node):
        args["source"] = source
    return {
        "name": name,
        "ph": "X",
        "ts": round(start, 3),
        "dur": round(dur, 3),
        "pid": 1,
        "tid": LANES[lane],
        "args": args,
    }


def chrome_trace(gm: torch.fx.GraphModule, graph: str) -> dict[str, Any]:
    """``gm``'s estimated timeline as a Chrome trace object: metadata naming the process
    (``graph``) and the lanes, then :func:`timeline`'s events; times in microseconds."""
    meta: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": graph}}
    ]
    meta += [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
        for lane, tid in LANES.items()
    ]
    return {
        "traceEvents": meta + timeline(gm, graph),
        "displayTimeUnit": "ms",
        "otherData": {"vescale": "estimated schedule (static cost model)", "graph": graph},
    }


def write_schedule_json(path: Path, gm: torch.fx.GraphModule, graph: str) -> None:
    """:func:`chrome_trace` of ``gm`` written to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(gm, graph), indent=0) + "\n")
