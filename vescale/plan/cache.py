"""Solved choices cached on disk: a later run of the same problem on this machine reads the
choice instead of solving again, so it is the same choice (a solve stopped at its time limit
included) and planning skips the solve.

The key hashes everything the solve reads: per node its name, op, output shapes and dtypes
and strategies (output, input and internal placements, their source); the demands; the
memory budget and per-strategy bytes; the cost model's constants (in ``what``, from the
caller); the solver; and the source of the modules that propagate, price and solve (a
change to them is a new key). A cached choice is checked against the problem (one strategy
index per node, within its strategies) before it is used. Files:
``$VESCALE_CACHE_DIR/plans/<key>.json`` (default ``~/.cache/vescale``), next to the
calibration. ``VESCALE_PLAN_CACHE=0`` solves every time (strictly parsed: ``1/0``,
``true/false``, ``yes/no``, ``on/off``) and compiles every step (the compiled-step cache,
:mod:`vescale.plan.step_cache`, reads the same variable).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from vescale._env import env_flag
from vescale.cost.calibration import cache_root, write_atomic
from vescale.plan.solve import Problem, Solution

__all__ = ["PACKAGE", "cache_key", "cached", "enabled", "read", "source_digest", "write"]

_FORMAT = 1  # of the files; a change invalidates every file
_PRICED_BY = (
    "plan/propagate.py",
    "plan/program.py",
    "plan/cost.py",
    "plan/solve.py",
    "plan/recipes.py",
    "plan/repeats.py",
    "plan/memory.py",
    "cost/model.py",
)


PACKAGE = Path(__file__).resolve().parents[1]


def enabled() -> bool:
    """Whether the plan cache and the compiled-step cache are on: ``VESCALE_PLAN_CACHE``
    (strict boolean, default on)."""
    return env_flag("VESCALE_PLAN_CACHE", True)


def source_digest(paths: Iterable[str]) -> str:
    """The sha256 of the contents of vescale's source files ``paths`` (relative to the
    package), in that order."""
    h = hashlib.sha256()
    for rel in paths:
        h.update((PACKAGE / rel).read_bytes())
    return h.hexdigest()


@functools.cache
def _code_digest() -> str:
    return source_digest(_PRICED_BY)


def _shapes(val: Any) -> Any:
    vals = val if isinstance(val, tuple | list) else (val,)
    return [
        (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else repr(v) for v in vals
    ]


def cache_key(problem: Problem, what: str) -> str | None:
    """The hex key of ``problem`` solved as ``what`` says (the solver and the cost model's
    constants); ``None`` when the cache is off."""
    if not enabled():
        return None
    h = hashlib.sha256(f"{_FORMAT} {_code_digest()} {torch.__version__} {what}".encode())
    for node, ns in problem.table.items():
        internal = ns.internal if ns.internal else ()
        h.update(
            repr(
                (
                    node.name,
                    str(node.target),
                    _shapes(node.meta.get("val")),
                    ns.source,
                    ns.outputs,
                    ns.input_placements,
                    internal,
                    [(n.name, k) for n, k in ns.inputs],
                )
            ).encode()
        )
    for d in problem.demands:
        node, k = d.value
        options = [(b, n.name if n is not None else None, s) for b, n, s in d.options]
        h.update(repr((node.name, k, options, d.reason, d.bucket)).encode())
    m = problem.memory
    if m is not None:
        per = sorted((n.name, list(b)) for n, b in m.per_strategy.items())  # set-built
        h.update(repr((m.budget, per)).encode())
    return h.hexdigest()


def _path(key: str) -> Path:
    return cache_root() / "plans" / f"{key}.json"


def read(key: str, problem: Problem) -> Solution | None:
    """The cached solution of ``key``, checked against ``problem``; ``None``: absent,
    unreadable, or not a choice of this problem's strategies."""
    try:
        data = json.loads(_path(key).read_text())
        chosen = [int(i) for i in data["chosen"]]
        nodes = list(problem.table)
        if len(chosen) != len(nodes) or any(
            not 0 <= i < len(problem.table[n].outputs) for n, i in zip(nodes, chosen)
        ):
            return None
        return Solution(
            dict(zip(nodes, chosen)),
            f"{data['status']} (cached)",
            float(data["objective_us"]),
            None if data["bound_us"] is None else float(data["bound_us"]),
            None if data["greedy_us"] is None else float(data["greedy_us"]),
            (int(data["pairs"][0]), int(data["pairs"][1])),
        )
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def write(key: str, problem: Problem, solution: Solution) -> None:
    """Store ``solution`` of ``problem`` under ``key`` (atomically); a cache that cannot be
    written is skipped: the next run solves again."""
    path = _path(key)
    data = {
        "chosen": [solution.chosen[n] for n in problem.table],
        "status": solution.status,
        "objective_us": solution.objective_us,
        "bound_us": solution.bound_us,
        "greedy_us": solution.greedy_us,
        "pairs": list(solution.pairs),
    }
    with contextlib.suppress(OSError):
        write_atomic(path, json.dumps(data) + "\n")


def cached(solve: Callable[[Problem], Solution], what: str) -> Callable[[Problem], Solution]:
    """``solve``, reading the choice from the cache when it holds this problem (``what``:
    the solver and every constant the costs read that the problem does not show)."""

    def run(problem: Problem) -> Solution:
        key = cache_key(problem, what)
        hit = read(key, problem) if key is not None else None
        if hit is not None:
            return hit
        solution = solve(problem)
        if key is not None:
            write(key, problem, solution)
        return solution

    return run
