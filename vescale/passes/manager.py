"""Runs graph passes in order, dumping the graph after each and timing each.

Each graph's text after capture and after every pass, its collective table and its estimated
schedule are also ``TORCH_TRACE`` artifacts (``vescale_<graph>_after_<pass>``,
``vescale_<graph>_collectives``, ``vescale_<graph>_schedule``: :func:`vescale._logs.artifact`),
and each pass logs its time at DEBUG (``TORCH_LOGS=+vescale``), each graph a summary at INFO.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vescale._logs import artifact, debug, info, logger
from vescale.fx.collectives import Records
from vescale.fx.dump import graph_text
from vescale.fx.timeline import chrome_trace
from vescale.passes.options import BackendOptions

__all__ = ["Pass", "PassContext", "PassManager"]

_log = logger(__name__)


@dataclass
class PassContext:
    """What a pass may read and report into: the graph's name, where dumps go, the backend's
    options (their defaults when not given), reports."""

    graph_name: str
    dump_dir: Path | None = None
    options: BackendOptions = field(default_factory=BackendOptions)
    reports: dict[str, Any] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)

    def dump(self, stage: str, gm: torch.fx.GraphModule) -> None:
        """``gm``'s text after ``stage``: a trace artifact, and a file under ``dump_dir``."""
        title = f"{self.graph_name} after {stage}"
        artifact(f"vescale_{self.graph_name}_after_{stage}", lambda: graph_text(gm, title))
        if self.dump_dir is None:
            return
        folder = self.dump_dir / self.graph_name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"graph.{stage}.txt").write_text(graph_text(gm, title))


Pass = Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule]


class PassManager:
    """Ordered ``(name, pass)`` pairs; ``run`` dumps ``graph.capture.txt`` and
    ``graph.<name>.txt`` after each pass (collective records recomputed after a pass that
    changed the graph) and records per-pass wall time."""

    def __init__(self, passes: Sequence[tuple[str, Pass]]) -> None:
        self.passes = list(passes)

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        """Run every pass; ``ctx.reports["collectives"]`` holds the final collective table."""
        records = Records(ctx.graph_name)
        ctx.reports["collectives"] = records.refresh(gm)
        ctx.dump("capture", gm)
        for name, fn in self.passes:
            t0 = time.perf_counter()
            gm = fn(gm, ctx)
            ctx.timings_ms[name] = (time.perf_counter() - t0) * 1e3
            ctx.reports["collectives"] = records.refresh(gm)
            ctx.dump(name, gm)
            debug(_log, "%s: pass %s %.1f ms", ctx.graph_name, name, ctx.timings_ms[name])
        gm.recompile()  # passes read and write the graph only: its code once, at the end
        table = ctx.reports["collectives"]
        artifact(f"vescale_{ctx.graph_name}_collectives", lambda: table, "json")
        schedule = f"vescale_{ctx.graph_name}_schedule"
        artifact(schedule, lambda: chrome_trace(gm, ctx.graph_name), "json")
        buckets = len({r["bucket"] for r in table if r.get("bucket") is not None})
        total = sum(ctx.timings_ms.values())
        info(
            _log,
            "%s after the passes (%.0f ms): collectives %d, buckets %d",
            *(ctx.graph_name, total, len(table), buckets),
        )
        return gm
