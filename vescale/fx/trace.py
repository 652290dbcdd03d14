"""``vescale.fx.trace``: the compiled graphs of a DTensor program, without a training loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from vescale.fx.collectives import CollectiveRecord

__all__ = ["TraceResult", "trace"]


@dataclass
class TraceResult:
    """Forward and backward graphs (local aten ops + functional collectives, placements in
    ``node.meta["custom"]``), their collective tables, per-pass timings and pass reports."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule | None
    collectives: list[CollectiveRecord] = field(default_factory=list)
    timings_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    reports: dict[str, dict[str, Any]] = field(default_factory=dict)


def trace(
    fn: Callable[..., Any],
    *args: Any,
    backward: bool = True,
    options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> TraceResult:
    """Capture ``fn(*args, **kwargs)`` with the vescale pipeline (FX codegen) and run it once;
    with ``backward`` and a differentiable output, also the backward of the sum of its
    floating-point outputs. Works on the ``fake`` process group (no data moves), so large
    world sizes can be traced on one machine. ``fn`` must compile into one graph.
    ``options`` are backend options (e.g. ``bucket_cap_mb``, ``overlap``); the graphs are
    returned after all passes."""
    from vescale.backend import capture_graphs

    with capture_graphs() as sink:
        torch._dynamo.reset()
        opts = {"codegen": "fx", "strict": True, **(options or {})}
        compiled = torch.compile(fn, backend="vescale", options=opts)
        out = compiled(*args, **kwargs)
        leaves = [
            t
            for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
        ]
        if backward and leaves:  # d(sum of all outputs): ones for every output, any layout
            torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
    graphs = {name.rsplit(".", 1)[1]: (gm, ctx) for name, gm, ctx in sink}
    if len(sink) != len(graphs) or "forward" not in graphs:
        raise RuntimeError(
            f"vescale.fx.trace: expected one forward graph (and its backward), got "
            f"{[name for name, _, _ in sink]}; the function has graph breaks"
        )
    fw, fw_ctx = graphs["forward"]
    bw, bw_ctx = graphs.get("backward", (None, None))
    records = list(fw_ctx.reports.get("collectives", []))
    timings = {"forward": fw_ctx.timings_ms}
    reports = {"forward": fw_ctx.reports}
    if bw_ctx is not None:
        records += bw_ctx.reports.get("collectives", [])
        timings["backward"] = bw_ctx.timings_ms
        reports["backward"] = bw_ctx.reports
    return TraceResult(fw, bw, records, timings, reports)
