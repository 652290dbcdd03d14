"""The README's main job: the tensor-parallel demo matches single-device training to 1e-5."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "examples" / "train_demo.py"


def _demo_losses():
    spec = importlib.util.spec_from_file_location("train_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tensor_parallel_losses(steps=4)


def test_demo_matches_single_device(pool4):
    for eager, compiled, ref in pool4.run(_demo_losses):
        assert len(eager) == len(compiled) == len(ref) == 4
        for run in (eager, compiled):
            assert all(abs(a - b) <= 1e-5 for a, b in zip(run, ref)), (run, ref)
        assert ref[-1] < ref[0]  # it trains
