"""``scripts/gpu_check.py --device cpu``: every check of the one-GPU script runs on CPU in the
suite, so the script is ready for a GPU machine. Every check passes, or is skipped for a
reason that only a GPU lifts (CUDA graphs): the exact table is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEVICE_ONLY = {"cuda_graphs"}  # skipped on CPU: needs a CUDA device
CHECKS = {
    "demo_gpt",
    "cuda_graphs",
    "host_syncs",
    "profiler_trace",
    "dropout",
    "fsdp_storage",
    "sdpa_sharded",
    "sdpa_dropout_heads",
    "fake_pg_compile_8",
}


def test_gpu_check_on_cpu(tmp_path):
    summary = tmp_path / "summary.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/gpu_check.py",
            "--device",
            "cpu",
            "--json",
            str(summary),
            "--trace-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln[:4] in {"PASS", "FAIL", "SKIP"}]
    checks = json.loads(summary.read_text())["checks"]
    assert set(checks) == CHECKS, proc.stdout + proc.stderr
    assert len(lines) == len(CHECKS)  # one line per check
    status = {name: c["status"] for name, c in checks.items()}
    expected = {name: "SKIP" if name in DEVICE_ONLY else "PASS" for name in CHECKS}
    assert status == expected, proc.stdout + proc.stderr
    assert proc.returncode == 0
    trace = Path(checks["profiler_trace"]["detail"].split(" in ")[-1])
    assert json.loads(trace.read_text())["traceEvents"]
