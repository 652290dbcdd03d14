"""vescale in the tools users read: TORCH_TRACE artifacts (tlparse), TORCH_LOGS=vescale, and
``schedule.json`` as a valid Chrome/Perfetto trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from tests.harness.chrome_trace import check_chrome_trace
from tests.harness.simulated import fake_world
from vescale.backend import PIPELINE
from vescale.fx.timeline import LANES, chrome_trace

ROOT = Path(__file__).resolve().parents[2]
PASSES = ["capture", *(name for name, _ in PIPELINE.passes)]


def _run_sample(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "VESCALE_PROGRESS": "1", **env}
    return subprocess.run(
        [sys.executable, "-m", "tests.fx.compile_sample"],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )


def _artifacts(trace_dir: Path) -> dict[str, str]:
    """name -> payload of every ``artifact`` record in the structured trace logs."""
    found: dict[str, str] = {}
    for log in trace_dir.glob("*.log"):
        lines = log.read_text().splitlines()
        for i, line in enumerate(lines):
            if '{"artifact"' not in line:
                continue
            record = json.loads(line[line.index("{") :])
            payload = []
            for more in lines[i + 1 :]:
                if not more.startswith("\t"):
                    break
                payload.append(more[1:])
            found[record["artifact"]["name"]] = "\n".join(payload)
    return found


def test_torch_trace_holds_every_vescale_artifact(tmp_path):
    _run_sample({"TORCH_TRACE": str(tmp_path)})
    found = _artifacts(tmp_path)
    for graph in ("graph0.forward", "graph0.backward"):
        for stage in PASSES:
            text = found[f"vescale_{graph}_after_{stage}"]
            assert text.startswith(f"# {graph} after {stage}\n")
            assert "profiler" not in text  # eager's profiler ranges are not traced
        table = json.loads(found[f"vescale_{graph}_collectives"])
        assert all(r["graph"] == graph for r in table)
        trace = json.loads(found[f"vescale_{graph}_schedule"])
        check_chrome_trace(trace)
    forward = json.loads(found["vescale_graph0.forward_collectives"])
    assert [r["kind"] for r in forward] == ["all_reduce"]  # the row-parallel output


def test_torch_logs_vescale(tmp_path):
    info = _run_sample({"TORCH_LOGS": "vescale"}).stderr
    assert "graph0.forward after the passes (" in info
    assert "): collectives 1, buckets 0" in info
    assert "compile graph0.forward ..." in info  # progress through the logger
    assert "pass annotate" not in info  # per-pass lines are DEBUG
    debug = _run_sample({"TORCH_LOGS": "+vescale"}).stderr
    for name in PASSES[1:]:
        assert f"graph0.backward: pass {name} " in debug
    quiet = _run_sample({}).stderr
    assert "after the passes" not in quiet and "vescale: compile graph0.forward ..." in quiet


def test_schedule_json_is_a_chrome_trace_with_collective_args():
    with fake_world(2):
        group = dist.new_group([0, 1])

        def fn(x):
            return funcol.all_reduce(x * 2, "sum", group) + 1  # waited at its first use

        gm = make_fx(fn, tracing_mode="fake")(torch.randn(256))
        trace = chrome_trace(gm, "g")
    check_chrome_trace(trace)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    comm = [e for e in events if e["tid"] == LANES["communication"]]
    assert [e["name"].split(" %")[0] for e in comm] == ["all_reduce"]
    assert comm[0]["args"]["bytes"] == 256 * 4 and comm[0]["args"]["bucket"] is None
    assert all(e["args"]["estimate_us"] == e["dur"] for e in events)
