"""The solved-choice cache (vescale/plan/cache.py) on a meta (dp=2, tp=2) mesh: a second
placement of the same problem reads the first one's choice; anything the solve reads that
differs (here the memory budget) is another entry; a damaged entry is solved again; the
variable that turns it off is parsed strictly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.misuse import error_everywhere
from tests.plan.gpt_cases import meta_gpt_problem
from tests.plan.test_choice_space import COSTS, FREE, _cfg, _param_bytes
from vescale.plan.program import place

ROOT = Path(__file__).resolve().parents[2]


def _choice(program):  # type: ignore[no-untyped-def]
    return {node.name: i for node, i in program.chosen.items()}


def test_second_solve_of_the_same_problem_reads_the_first(tmp_path, monkeypatch):
    monkeypatch.setenv("VESCALE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VESCALE_PLAN_CACHE", "1")
    mesh, joint, free, model = meta_gpt_problem(_cfg(64), FREE)
    first = place(joint, mesh, free, None, COSTS, buckets=True)
    assert not first.solution.status.endswith("(cached)"), first.solution.status
    (entry,) = (tmp_path / "plans").iterdir()

    again = place(joint, mesh, free, None, COSTS, buckets=True)
    assert again.solution.status == f"{first.solution.status} (cached)"
    assert _choice(again) == _choice(first)
    assert again.solution.objective_us == first.solution.objective_us

    budget = 2 * _param_bytes(model)  # what the solve reads differs: another entry
    lean = place(joint, mesh, free, None, COSTS, buckets=True, memory_budget=budget)
    assert not lean.solution.status.endswith("(cached)")
    assert len(list((tmp_path / "plans").iterdir())) == 2

    data = json.loads(entry.read_text())
    data["chosen"][0] = 10**6  # no such strategy: not this problem's choice
    entry.write_text(json.dumps(data))
    solved = place(joint, mesh, free, None, COSTS, buckets=True)
    assert solved.solution.status == first.solution.status
    assert _choice(solved) == _choice(first)
    assert json.loads(entry.read_text())["chosen"] == [first.chosen[n] for n in first.table]


def test_cache_off_and_a_wrong_value(tmp_path, monkeypatch):
    monkeypatch.setenv("VESCALE_CACHE_DIR", str(tmp_path))
    mesh, joint, free, _ = meta_gpt_problem(_cfg(64), FREE)
    monkeypatch.setenv("VESCALE_PLAN_CACHE", "off")
    place(joint, mesh, free, None, COSTS, solver="greedy")
    assert not (tmp_path / "plans").exists()
    monkeypatch.setenv("VESCALE_PLAN_CACHE", "maybe")
    with pytest.raises(ValueError, match="VESCALE_PLAN_CACHE='maybe' is not a boolean"):
        place(joint, mesh, free, None, COSTS, solver="greedy")


_PLACE = """
from tests.plan.gpt_cases import meta_gpt_problem
from tests.plan.test_choice_space import COSTS, FREE, _cfg
from vescale.plan.program import place
mesh, joint, free, model = meta_gpt_problem(_cfg(64), FREE)
print(place(joint, mesh, free, None, COSTS, solver="greedy", memory_budget=10**9).solution.status)
"""


def last_lines_of_two_runs(code: str, cache_dir: Path) -> tuple[str, str]:
    """The last stdout line of each of two processes running ``code`` one after the other
    (this checkout and examples/ importable; both caches on, in ``cache_dir``)."""
    env = {**os.environ, "VESCALE_CACHE_DIR": str(cache_dir), "VESCALE_PLAN_CACHE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "examples"), env.get("PYTHONPATH", "")]
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
        )
        for _ in range(2)
    ]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-2000:] + runs[1].stderr[-2000:]
    first, second = (r.stdout.strip().splitlines()[-1] for r in runs)
    return first, second


def test_a_later_process_reads_the_entry(tmp_path):
    """The key is the same in another process (no set or address order in it): the second
    run's solve is read."""
    first, second = last_lines_of_two_runs(_PLACE, tmp_path)
    assert second == f"{first} (cached)", (first, second)


def _place_on_two_ranks() -> None:
    from tests.plan.test_calibration import _choice

    _choice(COSTS)


def test_a_wrong_value_is_one_error_on_every_rank(pool2):
    """Rank 0 reads the variable where it solves for every rank: the others get its error,
    the same text, within seconds (no rank waits in the broadcast)."""
    error = error_everywhere(
        pool2, _place_on_two_ranks, env={"VESCALE_PLAN_CACHE": "maybe"}, timeout_s=120
    )
    assert error.kind == "PlanError", error
    assert "VESCALE_PLAN_CACHE='maybe' is not a boolean" in error.message, error
