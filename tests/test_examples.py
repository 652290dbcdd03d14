"""The README's main job, run as users run it: the GPT demo under torchrun on 4 CPU ranks
matches single-device training, and prints its collective table and dump folder.

The demo runs with ``--codegen fx``: the same ``train_demo.gpt_runs`` compiled with Inductor
(the demo's default) is checked, losses and every parameter, by
tests/test_compiler.py::test_gpt_2d_compiled_equals_eager_and_single_device[inductor], so the
suite compiles the GPT with Inductor once."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs_and_matches_single_device():
    with tempfile.TemporaryDirectory() as dumps:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", "4", str(ROOT / "examples" / "train_demo.py")]
        cmd += ["--steps", "3", "--dump-dir", dumps, "--codegen", "fx"]
        # the ranks import this checkout's vescale, whatever copy is installed
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        rows = re.findall(r"^\s+(\d)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s", out.stdout, re.M)
        assert [int(r[0]) for r in rows] == [0, 1, 2], out.stdout
        for _, compiled, eager, ref in rows:
            assert abs(float(compiled) - float(ref)) <= 1e-5 >= abs(float(eager) - float(ref))
        assert float(rows[-1][3]) < float(rows[0][3])  # it trains
        assert "backward  all_reduce             0" in out.stdout  # dp gradient reductions
        assert re.search(r"max \|diff\| = \S+ \(OK, tolerance 1e-05\)", out.stdout)
        assert (Path(dumps) / "rank3" / "collectives.json").exists()


def test_demo_script_installs_the_runtime_only(tmp_path: Path) -> None:
    """``scripts/demo.sh`` installs vescale without the test extras (and torch 2.13.0 from pip's
    index when none is installed); run with a ``python`` on PATH that records its arguments
    instead of running (so it reports no installed torch)."""
    log = tmp_path / "calls"
    shim = tmp_path / "python"
    shim.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    env.pop("VESCALE_TORCH_INDEX", None)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], env=env, timeout=60)
    assert out.returncode == 0
    version_query, install, demo = log.read_text().splitlines()
    assert version_query.startswith("-c ")
    assert install.split() == ["-m", "pip", "install", "-q", "torch==2.13.0", "-e", "."]
    assert demo.split()[:2] == ["-m", "torch.distributed.run"]
    assert demo.endswith("examples/train_demo.py")
    env["VESCALE_TORCH_INDEX"] = "https://download.pytorch.org/whl/cpu"
    log.unlink()
    subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], env=env, timeout=60, check=True)
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in log.read_text()


def test_device_default_is_cuda_only_with_a_gpu_per_local_rank(monkeypatch):
    import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert launch.default_device() == "cuda"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # more local ranks than GPUs
    assert launch.default_device() == "cpu"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(SystemExit, match="LOCAL_WORLD_SIZE='four'"):
        launch.default_device()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch.default_device() == "cpu"
    assert launch.BACKENDS == {"cpu": "gloo", "cuda": "nccl"}


def test_device_argument_is_strict():
    import argparse

    import launch

    parser = argparse.ArgumentParser()
    launch.add_device_argument(parser)
    assert parser.parse_args([]).device is None
    assert parser.parse_args(["--device", "cuda"]).device == "cuda"
    with pytest.raises(SystemExit):
        parser.parse_args(["--device", "gpu"])
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="'cuda' is not available"):
            launch.select_device("cuda")


def test_demo_mesh_shape_from_the_world_or_given():
    import train_demo

    assert train_demo.mesh_shape(4) == (2, 2)
    assert train_demo.mesh_shape(8) == (4, 2)
    assert train_demo.mesh_shape(1) == (1, 1)
    assert train_demo.mesh_shape(3) == (3, 1)
    assert train_demo.mesh_shape(4, "4,1") == (4, 1)
    for bad, why in [("2,3", "2 x 3 ranks"), ("2x2", "expected DP,TP"), ("0,4", "expected")]:
        with pytest.raises(SystemExit, match=why):
            train_demo.mesh_shape(4, bad)
