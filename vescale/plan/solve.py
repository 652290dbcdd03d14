"""Choose one strategy per node: globally (an integer program over the whole joint graph) or
greedily (each node in order, cheapest given its producers' choices, as eager dispatch does).

The integer program (solved exactly by HiGHS through ``scipy.optimize.milp``; its LP
relaxation first, which on the graphs measured so far is already integral and ~10x faster,
then branch and bound only if it is not): a binary
``x[n, s]`` per node and strategy, one per node; per edge (producer value -> consumer input)
a variable ``y[a, b]`` per pair of producer placements ``a`` and required placements ``b``
with cost ``c(a -> b)``, tied to both ends by ``sum_b y[a, b] = sum_{s: out(s)=a} x[p, s]``
and ``sum_a y[a, b] = sum_{t: in(t)=b} x[c, t]``. Minimizing ``sum c y + sum w x`` (``w``: the
strategy's estimated compute) is the estimated time of forward and backward. Plan placements are the only strategy of their
placeholders (hard); a gradient output must arrive in its parameter's placements. Ties go to
the earlier strategy (a cost of ``1e-9`` x its index in the registry's order), so every rank,
solving the same problem, makes the same choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vescale.plan.propagate import NodeStrategies, Placements, Value

__all__ = ["Demand", "Problem", "solve_global", "solve_greedy"]

TIE = 1e-9  # us per strategy index


@dataclass(frozen=True)
class Demand:
    """A consumer input: value ``value`` needed in ``b`` when ``(node, strategy)`` is chosen
    (``node is None``: always)."""

    value: Value
    options: list[tuple[Placements, torch.fx.Node | None, list[int]]]  # (b, node, strategies)
    reason: str


@dataclass
class Problem:
    table: dict[torch.fx.Node, NodeStrategies]
    demands: list[Demand]
    cost: Callable[[Value, Placements, Placements], float | None]  # us, None: impossible
    compute: Callable[[torch.fx.Node, int], float]  # us of a node's strategy


def _producer_groups(ns: NodeStrategies, k: int | None) -> dict[Placements, list[int]]:
    groups: dict[Placements, list[int]] = {}
    for s, out in enumerate(ns.outputs):
        p = out[0 if k is None else k]
        if p is not None:
            groups.setdefault(p, []).append(s)
    return groups


def solve_global(problem: Problem) -> dict[torch.fx.Node, int]:
    """The strategy index of every node minimizing the total estimated cost (needs scipy)."""
    try:
        import scipy.optimize
        import scipy.sparse
    except ImportError as err:
        raise ImportError(
            "vescale.parallelize(solver='global') needs scipy: pip install scipy"
        ) from err
    index: dict[tuple[torch.fx.Node, int], int] = {}
    costs: list[float] = []
    for node, ns in problem.table.items():
        for s in range(len(ns.outputs)):
            index[(node, s)] = len(costs)
            costs.append(problem.compute(node, s) + TIE * s)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def row(entries: list[tuple[int, float]], value: float) -> None:
        r = len(lo)
        for c, v in entries:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        lo.append(value)
        hi.append(value)

    for node, ns in problem.table.items():
        row([(index[(node, s)], 1.0) for s in range(len(ns.outputs))], 1.0)
    for demand in problem.demands:
        producer, k = demand.value
        groups = _producer_groups(problem.table[producer], k)
        ys: dict[Placements, list[int]] = {a: [] for a in groups}
        yb: list[list[int]] = [[] for _ in demand.options]
        for j, (b, _, _) in enumerate(demand.options):
            for a in groups:
                c = problem.cost(demand.value, a, b)
                if c is None:
                    continue
                ys[a].append(len(costs))
                yb[j].append(len(costs))
                costs.append(c)
        for a, strategies in groups.items():
            row([(y, 1.0) for y in ys[a]] + [(index[(producer, s)], -1.0) for s in strategies], 0.0)
        for j, (_, consumer, strategies) in enumerate(demand.options):
            if consumer is None:
                row([(y, 1.0) for y in yb[j]], 1.0)
            else:
                row(
                    [(y, 1.0) for y in yb[j]] + [(index[(consumer, s)], -1.0) for s in strategies],
                    0.0,
                )
    n = len(costs)
    matrix = scipy.sparse.csr_array((vals, (rows, cols)), shape=(len(lo), n))
    args = (np.asarray(costs),)
    kw: dict = {
        "constraints": scipy.optimize.LinearConstraint(matrix, lo, hi),
        "bounds": scipy.optimize.Bounds(0, 1),
    }
    result = scipy.optimize.milp(*args, **kw)  # the LP relaxation: usually integral already
    if result.x is None or np.any((result.x > 1e-6) & (result.x < 1 - 1e-6)):
        result = scipy.optimize.milp(
            *args, integrality=np.ones(n), options={"mip_rel_gap": 1e-7}, **kw
        )
    if result.x is None:
        raise RuntimeError(
            f"vescale.plan: no placement assignment satisfies the plan ({result.message})"
        )
    chosen = {}
    for node, ns in problem.table.items():
        chosen[node] = max(range(len(ns.outputs)), key=lambda s: result.x[index[(node, s)]])
    return chosen


def solve_greedy(problem: Problem) -> dict[torch.fx.Node, int]:
    """Nodes in graph order, each the strategy cheapest given its producers' choices (ties:
    the earliest), as eager dispatch chooses; placeholders the plan leaves open: replicated
    (eager's default for unplanned parameters)."""
    by_consumer: dict[torch.fx.Node, list[Demand]] = {}
    for demand in problem.demands:
        node = demand.options[0][1]
        if node is not None and node.op != "placeholder":  # not a gradient output
            by_consumer.setdefault(node, []).append(demand)
    chosen: dict[torch.fx.Node, int] = {}
    for node, ns in problem.table.items():
        if ns.source == "free":
            chosen[node] = next(
                s for s, out in enumerate(ns.outputs) if all(not p.is_shard() for p in out[0] or ())
            )
            continue
        best, best_cost = 0, float("inf")
        for s in range(len(ns.outputs)):
            total = problem.compute(node, s)
            for demand in by_consumer.get(node, []):
                producer, k = demand.value
                a = problem.table[producer].outputs[chosen[producer]][0 if k is None else k]
                b = next((b for b, _, strategies in demand.options if s in strategies), None)
                c = problem.cost(demand.value, a, b) if a is not None and b is not None else None
                total += float("inf") if c is None else c
            if total < best_cost:
                best, best_cost = s, total
        chosen[node] = best
    return chosen
