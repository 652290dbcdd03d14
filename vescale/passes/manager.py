"""Runs graph passes in order, dumping the graph after each and timing each."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vescale.fx.collectives import Records
from vescale.fx.dump import graph_text
from vescale.passes.options import BackendOptions

__all__ = ["Pass", "PassContext", "PassManager"]


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
        if self.dump_dir is None:
            return
        folder = self.dump_dir / self.graph_name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"graph.{stage}.txt").write_text(
            graph_text(gm, f"{self.graph_name} after {stage}")
        )


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
        gm.recompile()  # passes read and write the graph only: its code once, at the end
        return gm
