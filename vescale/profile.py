"""The measured timeline of a compiled step beside its estimate, collective by collective.

    report = vescale.profile_step(train_step, x, y, out="profile")
    print(report)

``train_step(*args)`` runs one training step whose model was compiled with
``backend="vescale"`` and has not run yet. :func:`profile_step` calls it twice: the first
call compiles (each graph's estimated schedule is kept, as ``schedule.json`` is made), the
second runs under ``torch.profiler``. ``out`` then holds ``measured.json`` (torch's Chrome
trace of the second call: each compiled graph is the range ``vescale::<graph>``) and
``<graph>.schedule.json`` per graph (the estimate), to open side by side in Perfetto.

The returned :class:`StepProfile` pairs every collective of every graph with its measured
event, in graph order within the graph's range: the estimate (the cost model's, as in
``schedule.json``) against the host-side time from the collective's launch to the end of the
wait on its result. That is the collective's time on gloo; on CUDA the host's wait returns
once the work is queued, so there read the device lanes of ``measured.json`` (the profile
records CUDA activity when CUDA is in use). A graph whose profiled collectives and waits do
not line up with its nodes one to one (e.g. Inductor reordered them) reports its rows
unmatched.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vescale.backend import CompiledGraph, capture_graphs
from vescale.fx.collectives import COLLECTIVE_KINDS, WAIT_TENSOR, node_bytes, user_source
from vescale.fx.timeline import estimate_us, write_schedule_json

__all__ = ["CollectiveTiming", "StepProfile", "profile_step"]

_LAUNCH = {
    f"_c10d_functional::{str(op).split('.')[1]}": kind for op, kind in COLLECTIVE_KINDS.items()
}
_LAUNCH.update({f"{name}_": kind for name, kind in list(_LAUNCH.items())})  # Inductor's in-place
_WAIT = "_c10d_functional::wait_tensor"


@dataclass(frozen=True)
class CollectiveTiming:
    """One collective: its graph, kind, bytes (this rank's input) and user line, the
    estimate and the measured launch-to-wait time (``None``: not found in the profile)."""

    graph: str
    kind: str
    bytes: int
    source: str
    estimated_us: float
    measured_us: float | None


@dataclass(frozen=True)
class StepProfile:
    """:func:`profile_step`'s result: one row per collective, and the files written."""

    rows: list[CollectiveTiming]
    measured: Path
    estimated: list[Path]

    def __str__(self) -> str:
        lines = [
            f"{'graph':<18} {'collective':<14} {'bytes':>10} {'estimate us':>12} "
            f"{'measured us':>12} {'measured/est':>12}  source"
        ]
        for r in self.rows:
            measured = "unmatched" if r.measured_us is None else f"{r.measured_us:.1f}"
            ratio = (
                f"{r.measured_us / r.estimated_us:.2f}"
                if r.measured_us is not None and r.estimated_us > 0
                else "-"
            )
            lines.append(
                f"{r.graph:<18} {r.kind:<14} {r.bytes:>10} {r.estimated_us:>12.1f} "
                f"{measured:>12} {ratio:>12}  {r.source}"
            )
        return "\n".join(lines)


def profile_step(
    step: Callable[..., Any], *args: Any, out: str | os.PathLike[str], **kwargs: Any
) -> StepProfile:
    """Profile the second call of ``step(*args, **kwargs)`` against the estimates of the
    graphs its first call compiled (see the module doc)."""
    with capture_graphs() as graphs:
        step(*args, **kwargs)
    if not graphs:
        raise ValueError(
            "profile_step: the first call of the step compiled no vescale graph; pass a step "
            "whose model is compiled with backend='vescale' and has not run yet"
        )
    _synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if _cuda_in_use():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step(*args, **kwargs)
        if _cuda_in_use():
            torch.cuda.synchronize()
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    measured = folder / "measured.json"
    prof.export_chrome_trace(str(measured))
    estimated = []
    for g in graphs:
        path = folder / f"{g.name}.schedule.json"
        write_schedule_json(path, g.gm, g.name)
        estimated.append(path)
    events = _host_events(prof)
    rows = [row for g in graphs for row in _match(g, events)]
    return StepProfile(rows, measured, estimated)


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _synchronize() -> None:
    """Wait for queued device work and for the other ranks (so the profiled call's first
    collective does not absorb the skew the compile left between ranks)."""
    if _cuda_in_use():
        torch.cuda.synchronize()
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
        dist.barrier()


_Event = tuple[str, int, int, int]  # name, thread, start ns, end ns


def _host_events(prof: torch.profiler.profile) -> list[_Event]:
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    raw = results.events() if results else []
    wanted = set(_LAUNCH) | {_WAIT}
    found = [
        (e.name(), e.start_thread_id(), e.start_ns(), e.end_ns())
        for e in raw
        if e.name() in wanted or e.name().startswith("vescale::graph")
    ]
    return sorted(found, key=lambda e: (e[2], -e[3]))


def _within(events: list[_Event], outer: _Event) -> list[_Event]:
    """The outermost collective and wait events inside ``outer`` on its thread (a call on an
    async result re-dispatches itself inside its own event: counted once)."""
    inside = [
        e
        for e in events
        if e[1] == outer[1] and outer[2] <= e[2] and e[3] <= outer[3] and e is not outer
    ]
    kept: list[_Event] = []
    for e in inside:
        if not kept or not (kept[-1][2] <= e[2] and e[3] <= kept[-1][3]):
            kept.append(e)
    return [e for e in kept if not e[0].startswith("vescale::")]


def _match(graph: CompiledGraph, events: list[_Event]) -> list[CollectiveTiming]:
    """``graph``'s collectives in graph order, each with the launch-to-wait time of the
    same-position collective in the graph's first profiled range."""
    nodes = list(graph.gm.graph.nodes)
    launches = [n for n in nodes if n.op == "call_function" and n.target in COLLECTIVE_KINDS]
    waits = [n for n in nodes if n.target is WAIT_TENSOR]
    ranges = [e for e in events if e[0] == f"vescale::{graph.name}"]
    inside = _within(events, ranges[0]) if ranges else []
    measured_launches = [e for e in inside if e[0] in _LAUNCH]
    measured_waits = [e for e in inside if e[0] == _WAIT]
    kinds = [COLLECTIVE_KINDS[n.target] for n in launches]
    lined_up = [_LAUNCH[e[0]] for e in measured_launches] == kinds and len(measured_waits) == len(
        waits
    )
    wait_end = {w.args[0]: e[3] for w, e in zip(waits, measured_waits)} if lined_up else {}
    rows = []
    for i, node in enumerate(launches):
        measured = None
        if node in wait_end:
            measured = (wait_end[node] - measured_launches[i][2]) / 1e3
        rows.append(
            CollectiveTiming(
                graph.name,
                kinds[i],
                node_bytes(node.all_input_nodes[0]),
                user_source(node),
                estimate_us(node),
                measured,
            )
        )
    return rows
