"""The global solve's limit and its candidates (meta mesh, no ranks, fixed costs).

* ``time_limit_s`` is spent as HiGHS work (LP iterations, branch-and-bound nodes) fixed by
  the problem and the limit: a clock running 1000 s per reading (a loaded machine) gives
  HiGHS the same options and the same choice.
* The standard recipes are priced as candidates: a solve forced to stop at once returns the
  cheapest, named, with one warning; on a GPT whose batch may split over dp only and whose
  compute dominates, that is Megatron TP over tp (the hand-written plan's placements), not
  greedy's data-parallel choice.
* The status says what happened; a wrong ``time_limit_s`` is a ``PlanError`` before tracing.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch

import vescale
from tests.plan.gpt_cases import GPT_PLAN, meta_gpt_problem
from vescale import Replicate, Shard
from vescale.plan import AlphaBeta, Batch, PlanError
from vescale.plan.explain import explain
from vescale.plan.program import place
from vescale.plan.recipes import megatron_shard_dims
from vescale.plan.solve import SolveStoppedWarning

COSTS = AlphaBeta((20e-6, 20e-6), (1e-9, 1e-9), 1e-10, flops_rate=1e9)


@pytest.fixture(autouse=True)
def _no_plan_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VESCALE_PLAN_CACHE", "0")


def _problem(batch: Batch, vocab: int, dim: int, seq: int):  # type: ignore[no-untyped-def]
    import gpt

    return meta_gpt_problem(gpt.GPTConfig(vocab=vocab, seq=seq, dim=dim, heads=4, layers=1), batch)


def test_a_solve_stopped_at_once_returns_the_cheapest_recipe() -> None:
    mesh, joint, free, model = _problem(Batch("dp"), vocab=1024, dim=128, seq=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = place(joint, mesh, free, None, COSTS, buckets=True, time_limit_s=1e-6)
    stopped = [w for w in caught if issubclass(w.category, SolveStoppedWarning)]
    solution = program.solution
    assert solution is not None
    assert len(stopped) == 1 and solution.status in str(stopped[0].message), stopped
    assert solution.status.startswith(
        "recipe fallback because the solve stopped at the time limit (time_limit_s=1e-06: "
    ), solution.status
    assert "before finding anything cheaper: DDP over dp x TP over tp, " in solution.status
    # the cheapest candidate that fits, cheaper than greedy's (eager's) choice
    greedy_name, greedy_us, _ = solution.candidates[0]
    assert greedy_name == "greedy" and solution.greedy_us == greedy_us
    assert solution.objective_us == min(us for _, us, fits in solution.candidates if fits)
    assert solution.objective_us < greedy_us
    # the hand-written Megatron plan's placements over tp (gpt_cases.GPT_PLAN), data
    # parallel over dp
    chosen = program.param_placements()
    megatron = _megatron(model)
    for name, _ in model.named_parameters():
        tp = Shard(megatron[name]) if name in megatron else Replicate()
        assert chosen[name] == (Replicate(), tp), (name, chosen[name])
    assert explain(program).summary().splitlines()[1].startswith(solution.status)


def _matches(name: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(name, pattern)


def _megatron(model: torch.nn.Module) -> dict[str, int]:
    """The tensor dim each parameter is sharded on over tp by the hand-written plan
    (gpt_cases.GPT_PLAN), with the column-parallel linears' biases."""
    out = {}
    for name, _ in model.named_parameters():
        for pattern, p in GPT_PLAN.items():
            if _matches(name, pattern) and isinstance(p, dict):
                out[name] = p["tp"].dim
    for layer in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
        out[f"blocks.0.{layer}.bias"] = 0
    return out


def test_megatron_dims_are_the_hand_written_plans() -> None:
    _, joint, _, model = _problem(Batch("dp"), vocab=64, dim=32, seq=16)
    names = dict(zip(joint.placeholder_names, [n for n, _ in model.named_parameters()]))
    got = {names[ph]: d for ph, d in megatron_shard_dims(joint).items()}
    assert got == _megatron(model)


def _record_highs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    import scipy.optimize

    calls: list[tuple[str, dict[str, Any]]] = []
    for name in ("linprog", "milp"):
        real = getattr(scipy.optimize, name)

        def spy(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            calls.append((_name, dict(k["options"])))
            return _real(*a, **k)

        monkeypatch.setattr(scipy.optimize, name, spy)
    return calls


def test_the_limits_are_work_not_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget makes the relaxation fractional, so both the LP and branch and bound run."""
    import time

    mesh, joint, free, model = _problem(Batch("dp", "tp"), vocab=64, dim=32, seq=16)
    budget = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    calls = _record_highs(monkeypatch)
    quiet = place(joint, mesh, free, None, COSTS, buckets=True, memory_budget=budget)
    quiet_calls = list(calls)
    calls.clear()
    ticks = itertools.count()
    for clock in ("monotonic", "perf_counter"):  # every reading 1000 s after the last
        monkeypatch.setattr(time, clock, lambda: 1000.0 * next(ticks))
    loaded = place(joint, mesh, free, None, COSTS, buckets=True, memory_budget=budget)
    assert [n for n, _ in quiet_calls] == ["linprog", "milp"], quiet_calls
    assert calls == quiet_calls, (calls, quiet_calls)
    assert quiet_calls[0][1]["maxiter"] > 0 and quiet_calls[1][1]["node_limit"] > 0
    assert loaded.chosen == quiet.chosen


def test_a_completed_solve_says_optimal() -> None:
    mesh, joint, free, _ = _problem(Batch("dp", "tp"), vocab=64, dim=32, seq=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SolveStoppedWarning)
        program = place(joint, mesh, free, None, COSTS, buckets=True)
    assert program.solution is not None
    assert program.solution.status == "optimal (the LP relaxation is integral)"
    assert program.solution.objective_us < program.solution.greedy_us  # type: ignore[operator]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), 3601, "10", True, None])
def test_a_wrong_time_limit_is_refused_before_tracing(bad: Any) -> None:
    import gpt

    mesh = vescale.DeviceMesh("meta", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    cfg = gpt.GPTConfig(vocab=64, seq=16, dim=32, heads=4, layers=1)
    with pytest.raises(
        PlanError, match=r"time_limit_s must be a positive number of seconds, at most 3600, got"
    ):
        vescale.parallelize(
            gpt.build(cfg),
            mesh,
            {},
            inputs=[Batch("dp"), Batch("dp")],
            example_inputs=gpt.batch(cfg, 0),
            cost="h100",
            time_limit_s=bad,
        )
