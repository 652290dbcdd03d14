"""Choose one strategy per node: globally (an integer program over the whole joint graph) or
greedily (each node in order, cheapest given its producers' choices, as eager dispatch does).

The integer program (solved by HiGHS through ``scipy``; its LP relaxation first, which on the
graphs measured without a memory budget is integral; a budget makes it fractional: then branch
and bound over the nodes it left fractional, the others held as it chose them, and over every
node only if that finds nothing): a binary ``x[n, s]`` per node and strategy, one per node; per edge (producer value ->
consumer input) a variable ``y[a, b]`` per pair of producer placements ``a`` and required
placements ``b`` with cost ``c(a -> b)``, tied to both ends by
``sum_b y[a, b] = sum_{s: out(s)=a} x[p, s]`` and ``sum_a y[a, b] = sum_{t: in(t)=b} x[c, t]``.
Minimizing ``sum c y + sum w x`` (``w``: the strategy's estimated compute) is the estimated
time of forward and backward. Buckets: the latency of a collective that the program issues
with others of its kind and mesh dim (a demand's ``bucket``, ``Problem.latency``) is a binary
``z`` per (bucket, kind, mesh dim), ``y <= z`` for each pair paying it: paid once, however
many tensors the bucket holds; the pair's ``c`` keeps its bandwidth term. Plan placements are the only strategy of their placeholders
(hard); a gradient output must arrive in its parameter's placements. Ties go to the earlier
strategy (a cost of ``1e-9`` x its index in the registry's order), and a global choice within
``TIED`` of greedy's estimate keeps greedy's (the interior point may end on either of two tied
vertices), so every rank, solving the same problem, makes the same choice.

Size: the candidates are priced first; the cheapest's total cost ``U`` bounds the optimum, so a pair
costing more than ``U`` alone (all costs are non-negative) is in no optimal solution and is
left out: exact, and it drops most pairs of 4-D attention tensors (~36 placements each),
e.g. every gather of the batch over a data-parallel mesh dim. Greedy's choice is one candidate:
the standard recipes (``Problem.candidates``, :mod:`vescale.plan.recipes`) are the others,
each completed greedily and priced the same way; the cheapest that fits bounds the pairs
and is returned, named, when the program finds nothing cheaper.

Limits by work (:class:`Limits`): ``time_limit_s`` buys HiGHS a number of LP iterations
and branch-and-bound nodes for the program's size, so the same problem and limit give the
same choice under any load; a wall-clock backstop (:data:`BACKSTOP` x the limit, plus
:data:`BACKSTOP_S`) is said
so in the status (a machine far slower than nominal). The status says what happened: ``optimal (...)``; ``stopped at the time
limit (...): best found X us, bound Y us, gap Z%``; ``greedy fallback because ...`` or
``recipe fallback because ...`` (then a :class:`SolveStoppedWarning` on rank 0).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import pickle
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from vescale import _progress
from vescale._watchdog import collective, timeout
from vescale.plan.memory import Memory
from vescale.plan.propagate import NodeStrategies, Placements, Value
from vescale.plan.validate import PlanError

__all__ = [
    "Demand",
    "Limits",
    "Problem",
    "Solution",
    "SolveStoppedWarning",
    "objective",
    "on_first_rank",
    "solve_global",
    "solve_greedy",
    "solve_once",
    "solving_group",
]

TIE = 1e-9  # us per strategy index
TIED = 1e-6  # a global choice within this of greedy's estimate is a tie: greedy's is kept
TIME_LIMIT_S = 120.0  # parallelize's default time_limit_s
# HiGHS' work per second of time_limit_s: matrix nonzeros x iterations (the tiny GPT's LP,
# 78,500 nonzeros, ran 286 iterations at ~7e7 per second on one core of this machine)
WORK_PER_S = 5e7
NODE_ITERATIONS = 100  # LP iterations a branch-and-bound node is budgeted
BACKSTOP = 4.0  # HiGHS also stops at BACKSTOP x time_limit_s + BACKSTOP_S of wall clock
BACKSTOP_S = 60.0
MAX_TIME_LIMIT_S = 3600.0  # the largest time_limit_s (the other ranks wait that long)
MIP_GAP = 1e-3  # branch and bound stops within 0.1% of the optimum: far inside the estimates' error


@dataclass(frozen=True)
class Demand:
    """A consumer input: value ``value`` needed in ``b`` when ``(node, strategy)`` is chosen
    (``node is None``: always)."""

    value: Value
    options: list[tuple[Placements, torch.fx.Node | None, list[int]]]  # (b, node, strategies)
    reason: str
    bucket: str | None = None  # its collectives merge with the bucket's others (Problem.latency)


class SolveStoppedWarning(UserWarning):
    """The solve stopped at its limit before finding anything cheaper than its fallback."""


@dataclass
class Problem:
    table: dict[torch.fx.Node, NodeStrategies]
    demands: list[Demand]
    cost: Callable[[Value, Placements, Placements], float | None]  # us, None: impossible
    compute: Callable[[torch.fx.Node, int], float]  # us of a node's strategy
    # cost of every (a, b) pair of one value at once (inf: impossible); default: ``cost``
    pair_costs: Callable[[Value, list[Placements], list[Placements]], np.ndarray] | None = None
    # for a demand with a ``bucket``: the latency (us, inside ``cost``) of each collective of
    # the pair that merges with the bucket's others of its key, ``{key: us}`` ({}: none).
    # A key's latency is paid once per bucket (e.g. one all-gather of every gathered
    # parameter), its bandwidth term per pair.
    latency: Callable[[str, Value, Placements, Placements], dict[Any, float]] | None = None
    # bytes per rank of each node's strategies and the budget (one row ``<= budget``)
    memory: Memory | None = None
    # for a demand with a ``bucket``: us of the local copies its merged collective adds to
    # the pair (packing into the bucket's buffer, unpacking a gathered result), per pair
    packing: Callable[[str, Value, Placements, Placements], float] | None = None
    # named partial choices (e.g. the standard recipes' placeholders), each completed
    # greedily and priced: the global choice is never dearer than the cheapest that fits
    candidates: list[tuple[str, dict[torch.fx.Node, int]]] = dataclasses.field(default_factory=list)
    # {node: its twin in the first of repeated blocks} (vescale.plan.repeats): the global
    # program gives a twin its root's choice and prices twin edges once, times their members
    twins: dict[torch.fx.Node, torch.fx.Node] = dataclasses.field(default_factory=dict)

    def fits(self, chosen: dict[torch.fx.Node, int]) -> bool:
        """Whether ``chosen`` holds no more than the memory budget (if any)."""
        m = self.memory
        return m is None or m.budget is None or m.of(chosen)["total"] <= m.budget

    def shared(self, demand: Demand, a: Placements, b: Placements) -> dict[Any, float]:
        """``{(bucket, key): us}``: the latencies of the pair ``a -> b`` of ``demand`` paid
        once per bucket (not in the pair's own cost)."""
        if demand.bucket is None or self.latency is None:
            return {}
        shared = self.latency(demand.bucket, demand.value, a, b)
        return {(demand.bucket, k): us for k, us in shared.items()}

    def demand_cost(self, demand: Demand, a: Placements, b: Placements) -> float | None:
        """``cost`` of the pair ``a -> b`` of ``demand``, its bucket's packing included."""
        c = self.cost(demand.value, a, b)
        if c is None or demand.bucket is None or self.packing is None:
            return c
        return c + self.packing(demand.bucket, demand.value, a, b)

    def costs(self, value: Value, srcs: list[Placements], dsts: list[Placements]) -> np.ndarray:
        if self.pair_costs is not None:
            return self.pair_costs(value, srcs, dsts)
        out = np.full((len(srcs), len(dsts)), np.inf)
        for i, a in enumerate(srcs):
            for j, b in enumerate(dsts):
                c = self.cost(value, a, b)
                out[i, j] = np.inf if c is None else c
        return out


@dataclass
class Solution:
    """The chosen strategy per node and how it was found. ``objective_us``: its estimated
    forward+backward time; ``bound_us``: a proven lower bound on any choice's (equal when
    exact); ``greedy_us``: the greedy choice's; ``pairs``: edge pairs in the program / in all;
    ``candidates``: (name, us, fits the budget) of greedy and each recipe priced."""

    chosen: dict[torch.fx.Node, int]
    status: str
    objective_us: float
    bound_us: float | None = None
    greedy_us: float | None = None
    pairs: tuple[int, int] = (0, 0)
    candidates: list[tuple[str, float, bool]] = dataclasses.field(default_factory=list)

    @property
    def gap(self) -> float | None:
        """Relative gap to the lower bound (0: proven optimal; None: no bound)."""
        if self.bound_us is None:
            return None
        return max(self.objective_us - self.bound_us, 0.0) / max(self.objective_us, 1e-12)


def _producer_groups(ns: NodeStrategies, k: int | None) -> dict[Placements, list[int]]:
    groups: dict[Placements, list[int]] = {}
    for s, out in enumerate(ns.outputs):
        p = out[0 if k is None else k]
        if p is not None:
            groups.setdefault(p, []).append(s)
    return groups


def _required(demand: Demand, chosen: dict[torch.fx.Node, int]) -> Placements | None:
    for b, node, strategies in demand.options:
        if node is None or chosen[node] in strategies:
            return b
    return None


def objective(problem: Problem, chosen: dict[torch.fx.Node, int]) -> float:
    """The estimated time (us) of ``chosen``: compute of every node plus every redistribution
    (``inf`` when one is impossible), a bucket's latencies once."""
    total = sum(problem.compute(node, s) + TIE * s for node, s in chosen.items())
    buckets: dict[Any, float] = {}
    for demand in problem.demands:
        producer, k = demand.value
        a = problem.table[producer].outputs[chosen[producer]][0 if k is None else k]
        b = _required(demand, chosen)
        c = problem.demand_cost(demand, a, b) if a is not None and b is not None else None
        if c is not None and a is not None and b is not None:
            shared = problem.shared(demand, a, b)
            c -= sum(shared.values())
            buckets.update(shared)
        total += float("inf") if c is None else c
    return total + sum(buckets.values())


@dataclass
class _Edge:
    """One demand's pair costs ``cost[a, b]`` (``inf``: impossible or dearer than greedy's
    whole step), the producer strategies of each ``a`` and consumer strategies of each ``b``."""

    producer: torch.fx.Node
    groups: list[list[int]]
    options: list[tuple[torch.fx.Node | None, list[int]]]
    cost: np.ndarray  # without the latencies in ``shared``
    shared: dict[tuple[int, int], dict[Any, float]]  # per pair: Problem.shared


def _edge_key(problem: Problem, demand: Demand) -> Any:
    """Demands of one key are one edge of the program: twins' (:attr:`Problem.twins`)."""
    root = problem.twins
    producer, k = demand.value
    options = tuple((b, root.get(n, n) if n else None, tuple(ss)) for b, n, ss in demand.options)
    return root.get(producer, producer), k, options, demand.bucket


def _edges(problem: Problem, upper: float) -> list[_Edge]:
    """One edge per class of twin demands, its costs times its members (each pays them; a
    bucket's latency once)."""
    classes: dict[Any, list[Demand]] = {}
    for demand in problem.demands:
        classes.setdefault(_edge_key(problem, demand), []).append(demand)
    out = []
    for members in classes.values():
        demand, n = members[0], len(members)
        producer, k = demand.value
        groups = _producer_groups(problem.table[producer], k)
        dsts = [b for b, _, _ in demand.options]
        cost = problem.costs(demand.value, list(groups), dsts) * n
        cost[cost > upper] = np.inf  # dearer pairs are in no solution better than greedy's
        shared = {}
        srcs = list(groups)
        bucket = demand.bucket
        for i, j in zip(*np.nonzero(np.isfinite(cost))) if bucket is not None else ():
            if bucket is not None and problem.packing is not None:
                cost[i, j] += n * problem.packing(bucket, demand.value, srcs[i], dsts[j])
            latency = problem.shared(demand, srcs[i], dsts[j])
            if latency:
                shared[(int(i), int(j))] = latency
                cost[i, j] -= n * sum(latency.values())
        options = [(node, strategies) for _, node, strategies in demand.options]
        out.append(_Edge(producer, list(groups.values()), options, cost, shared))
    return out


class _Program:
    """The LP over all node variables and the pair variables added. A bucket key's latency
    is a variable ``z`` of that cost, with ``y <= z`` for every pair ``y`` paying it
    (inequality rows, added with the pair)."""

    def __init__(self, problem: Problem, edges: list[_Edge]) -> None:
        self.edges = edges
        self.index: dict[tuple[torch.fx.Node, int], int] = {}
        self.costs: list[float] = []
        for node, ns in problem.table.items():  # a twin shares its root's (earlier) columns
            root = problem.twins.get(node)
            for s in range(len(ns.outputs)):
                if root is None:
                    self.index[(node, s)] = len(self.costs)
                    self.costs.append(0.0)
                else:
                    self.index[(node, s)] = self.index[(root, s)]
                self.costs[self.index[(node, s)]] += problem.compute(node, s) + TIE * s
        self.num_x = len(self.costs)
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.rhs: list[float] = []
        for node, ns in problem.table.items():
            if node not in problem.twins:
                self._row([self.index[(node, s)] for s in range(len(ns.outputs))], [], 1.0)
        self.row_a: list[list[int]] = []  # per edge, per producer group: its row
        self.row_b: list[list[int]] = []
        for e in edges:
            self.row_a.append(
                [self._row([], [self.index[(e.producer, s)] for s in g], 0.0) for g in e.groups]
            )
            self.row_b.append(
                [
                    self._row([], [self.index[(n, s)] for s in ss], 0.0)
                    if n
                    else self._row([], [], 1.0)
                    for n, ss in e.options
                ]
            )
        self.pairs: dict[tuple[int, int, int], int] = {}
        self.z: dict[Any, int] = {}  # bucket key -> its column
        self.ub: list[tuple[int, int]] = []  # rows y - z <= 0: (pair column, z column)

    def _row(self, plus: list[int], minus: list[int], value: float) -> int:
        r = len(self.rhs)
        self.rows += [r] * (len(plus) + len(minus))
        self.cols += plus + minus
        self.vals += [1.0] * len(plus) + [-1.0] * len(minus)
        self.rhs.append(value)
        return r

    def add(self, e: int, i: int, j: int) -> None:
        if (e, i, j) in self.pairs:
            return
        col = len(self.costs)
        self.pairs[(e, i, j)] = col
        self.costs.append(float(self.edges[e].cost[i, j]))
        self.rows += [self.row_a[e][i], self.row_b[e][j]]
        self.cols += [col, col]
        self.vals += [1.0, 1.0]
        for key, us in self.edges[e].shared.get((i, j), {}).items():
            if key not in self.z:
                self.z[key] = len(self.costs)
                self.costs.append(us)
            self.ub.append((col, self.z[key]))

    def matrix(self) -> Any:
        import scipy.sparse

        shape = (len(self.rhs), len(self.costs))
        return scipy.sparse.csr_array((self.vals, (self.rows, self.cols)), shape=shape)

    def ub_matrix(self) -> Any:
        """``y - z <= 0`` per shared latency of a pair (``None``: no such row)."""
        import scipy.sparse

        if not self.ub:
            return None
        rows = [r for r in range(len(self.ub)) for _ in (0, 1)]
        cols = [c for pair in self.ub for c in pair]
        vals = [1.0, -1.0] * len(self.ub)
        shape = (len(self.ub), len(self.costs))
        return scipy.sparse.csr_array((vals, (rows, cols)), shape=shape)

    def budget_row(self, problem: Problem) -> Any:
        """``sum bytes(n, s) x[n, s] <= budget`` scaled to ``<= 1`` (``None``: no budget)."""
        import scipy.sparse

        m = problem.memory
        if m is None or m.budget is None:
            return None
        cols = [self.index[(n, s)] for n, per in m.per_strategy.items() for s in range(len(per))]
        vals = [b / max(m.budget, 1) for per in m.per_strategy.values() for b in per]
        shape = (1, len(self.costs))
        return scipy.sparse.csr_array((vals, ([0] * len(cols), cols)), shape=shape)

    def inequalities(self, problem: Problem) -> tuple[Any, np.ndarray | None]:
        """The ``y <= z`` rows, then the budget row, and their right-hand sides."""
        import scipy.sparse

        parts = [m for m in (self.ub_matrix(), self.budget_row(problem)) if m is not None]
        if not parts:
            return None, None
        rhs = np.zeros(sum(p.shape[0] for p in parts))
        if self.budget_row(problem) is not None:
            rhs[-1] = 1.0
        return scipy.sparse.vstack(parts, format="csr"), rhs


@dataclass(frozen=True)
class Limits:
    """HiGHS' limits for a solve given ``time_limit_s`` on a program of ``nonzeros``: work,
    not wall clock (``iterations`` of the LP, ``nodes`` of branch and bound, each the work
    ``time_limit_s`` buys at :data:`WORK_PER_S`), so one problem and limit stop at the same
    point whatever the machine's load. ``wall_s``: a backstop only (:data:`BACKSTOP`)."""

    time_limit_s: float
    iterations: int
    nodes: int

    @classmethod
    def of(cls, time_limit_s: float, nonzeros: int) -> Limits:
        iterations = int(time_limit_s * WORK_PER_S / max(nonzeros, 1))
        return cls(time_limit_s, max(iterations, 1), max(iterations // NODE_ITERATIONS, 1))

    @property
    def wall_s(self) -> float:
        return BACKSTOP * self.time_limit_s + BACKSTOP_S

    def text(self) -> str:
        return (
            f"time_limit_s={self.time_limit_s:g}: {self.iterations} LP iterations, "
            f"{self.nodes} branch-and-bound nodes"
        )


def _stopped(message: str, limits: Limits) -> str:
    """Which limit a HiGHS run that stopped early reached, from its ``message``."""
    if "time limit" in message.lower():
        return f"the wall-clock backstop ({limits.wall_s:g} s, load-dependent)"
    return f"the time limit ({limits.text()})"


def solve_global(problem: Problem, time_limit_s: float = TIME_LIMIT_S) -> Solution:
    """The strategy of every node minimizing the total estimated cost; never dearer than the
    cheapest candidate (greedy, then ``problem.candidates`` completed greedily), which it
    returns, named, when the program finds nothing cheaper within ``time_limit_s``
    (:class:`Limits`). A stop at the limit with nothing cheaper warns on rank 0."""
    import scipy.optimize

    start = time.perf_counter()
    best, priced = _cheapest_candidate(problem)
    # its cost bounds the optimum only when it fits the budget
    upper = best.objective_us * (1 + 1e-9) + 1e-9 if problem.fits(best.chosen) else np.inf
    edges = _edges(problem, upper)
    lp = _Program(problem, edges)
    for e, edge in enumerate(edges):
        for i, j in zip(*np.nonzero(np.isfinite(edge.cost))):
            lp.add(e, int(i), int(j))
    a_ub, b_ub = lp.inequalities(problem)
    a_eq = lp.matrix()
    limits = Limits.of(time_limit_s, a_eq.nnz + (0 if a_ub is None else a_ub.nnz))
    result = scipy.optimize.linprog(
        np.asarray(lp.costs),
        A_ub=a_ub,
        b_ub=b_ub,
        A_eq=a_eq,
        b_eq=np.asarray(lp.rhs),
        bounds=(0, None),
        method="highs-ipm",  # with crossover: a vertex; 10-40x faster than simplex here
        options={"maxiter": limits.iterations, "time_limit": limits.wall_s},
    )
    x, bound, how, proven, stopped = None, None, "the LP relaxation is integral", True, None
    if result.status == 0:
        bound = float(result.fun)  # no choice is cheaper
        if not np.any((result.x > 1e-6) & (result.x < 1 - 1e-6)):
            x = result.x
    else:
        proven, stopped = False, _stopped(str(result.message), limits)
    if x is None and result.status == 0:  # fractional: branch on its fractional nodes only
        x, _, hit = _branch(lp, a_ub, b_ub, limits, fixed=result.x)
        how, proven = "branch and bound over the LP's fractional nodes", False
        stopped = hit
    if x is None and result.status == 0:  # branch and bound over every node
        x, dual, hit = _branch(lp, a_ub, b_ub, limits)
        how, proven, stopped = f"branch and bound within {MIP_GAP:.1%}", hit is None, hit
        bound = dual if dual is not None else bound
    pairs = (len(lp.pairs), sum(edge.cost.size for edge in edges))
    if problem.twins:  # the tied program's bound holds for choices equal in every block only
        bound = None
    chosen = (
        None
        if x is None
        else {
            node: max(range(len(ns.outputs)), key=lambda s: x[lp.index[(node, s)]])
            for node, ns in problem.table.items()
        }
    )
    value = np.inf if chosen is None else objective(problem, chosen)
    # not cheaper than the candidate beyond the LP's tolerance: a tie, which goes to the
    # candidate (greedy first: eager's choice), not to whichever tied vertex the interior
    # point ended on
    tied = value >= best.objective_us * (1 - TIED)
    greedy_us = priced[0][1]
    if chosen is None or tied or not problem.fits(chosen):
        best.status = _fallback(best, bound, stopped, proven and chosen is not None)
        best.status += _shared(problem) if proven and stopped is None else ""
        best.bound_us, best.greedy_us, best.pairs, best.candidates = bound, greedy_us, pairs, priced
        if stopped is not None:
            _warn_on_first_rank(f"vescale.parallelize: {best.status}", start)
        return best
    if stopped is not None:
        status = f"stopped at {stopped}: best found"
    else:
        status = "optimal" if proven else f"best found by {how}"
    solution = Solution(chosen, status, value, bound, greedy_us, pairs, priced)
    if status == "optimal":
        solution.status = f"optimal ({how}{_shared(problem)})"
    else:
        solution.status += f" {value:.1f} us, bound {_us(bound)}, gap {_gap(solution)}"
    return solution


def _shared(problem: Problem) -> str:
    """What an optimum of the program sharing repeated blocks' choices proves (no bound
    over choices that differ between blocks)."""
    if not problem.twins:
        return ""
    return (
        f"; {len(problem.twins)} nodes of repeated blocks take their first block's choice: "
        "optimal among such choices"
    )


def _us(bound: float | None) -> str:
    return "none" if bound is None else f"{bound:.1f} us"


def _gap(solution: Solution) -> str:
    return "unknown" if solution.gap is None else f"{solution.gap:.2%}"


def _fallback(best: Solution, bound: float | None, stopped: str | None, proven: bool) -> str:
    """The status of a solve returning the cheapest candidate ``best`` (``status``: its
    name): proven optimal, found nothing cheaper, or stopped at a limit before that."""
    name = best.status
    kind = "greedy" if name.startswith("greedy") else "recipe"
    if stopped is not None:
        gap = Solution(best.chosen, "", best.objective_us, bound)
        return (
            f"{kind} fallback because the solve stopped at {stopped} before finding anything "
            f"cheaper: {name}, {best.objective_us:.1f} us, bound {_us(bound)}, gap {_gap(gap)}"
        )
    if proven:
        return f"optimal: {name} (nothing cheaper: bound {_us(bound)})"
    return f"{kind} fallback: {name} (the program found nothing cheaper, bound {_us(bound)})"


def _is_first_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _warn_on_first_rank(message: str, start: float) -> None:
    """One warning, on rank 0 only (every rank may solve the same problem)."""
    if _is_first_rank():
        spent = time.perf_counter() - start
        warnings.warn(
            f"{message} (after {spent:.1f} s; raise parallelize's time_limit_s)",
            SolveStoppedWarning,
            stacklevel=2,
        )


def _branch(
    lp: _Program, a_ub: Any, b_ub: Any, limits: Limits, fixed: np.ndarray | None = None
) -> tuple[np.ndarray | None, float | None, str | None]:
    """Branch and bound (HiGHS' ``milp``) on ``lp``'s node variables within ``limits``: the
    solution (``None``: none found), HiGHS' lower bound, and the limit it stopped at
    (``None``: it did not). With ``fixed`` (an LP relaxation's solution) every node variable
    integral there is held at its value, so the search runs over the nodes it left
    fractional: a heuristic, fast where few are (no choice of those may fit: ``None``)."""
    import scipy.optimize

    n = len(lp.costs)
    lower, upper = np.zeros(n), np.ones(n)
    if fixed is not None:
        node = np.arange(n) < lp.num_x
        at_one, at_zero = node & (fixed > 1 - 1e-6), node & (fixed < 1e-6)
        lower[at_one], upper[at_zero] = 1.0, 0.0
    constraints = [scipy.optimize.LinearConstraint(lp.matrix(), lp.rhs, lp.rhs)]
    if a_ub is not None:
        constraints.append(scipy.optimize.LinearConstraint(a_ub, -np.inf, b_ub))
    mip = scipy.optimize.milp(
        np.asarray(lp.costs),
        # integral choices make every pair and bucket variable integral: y is the one pair
        # of the chosen ends, z the largest y paying it
        integrality=(np.arange(n) < lp.num_x).astype(int),
        constraints=constraints,
        bounds=scipy.optimize.Bounds(lower, upper),
        options={"node_limit": limits.nodes, "time_limit": limits.wall_s, "mip_rel_gap": MIP_GAP},
    )
    stopped = _stopped(str(mip.message), limits) if mip.status == 1 else None
    return mip.x, getattr(mip, "mip_dual_bound", None), stopped


def solve_greedy(problem: Problem) -> Solution:
    """Nodes in graph order, each the strategy cheapest given its producers' choices (ties:
    the earliest), as eager dispatch chooses; placeholders the plan leaves open: replicated
    (eager's default for unplanned parameters). Over the memory budget: again with every node
    that holds memory in its leanest strategy (placeholders the plan leaves open sharded)."""
    solution = _greedy(problem, lean=False)
    if problem.fits(solution.chosen):
        return solution
    lean = _greedy(problem, lean=True)
    lean.status = "greedy, leanest placements (over the memory budget otherwise)"
    return lean


def _cheapest_candidate(problem: Problem) -> tuple[Solution, list[tuple[str, float, bool]]]:
    """Greedy's choice and each of ``problem.candidates`` completed greedily, priced: the
    cheapest that fits the budget (ties: the earlier, greedy first; none fits: greedy's),
    its ``status`` its name, and every candidate's (name, us, fits)."""
    best = solve_greedy(problem)
    priced = [(best.status, best.objective_us, problem.fits(best.chosen))]
    for name, partial in problem.candidates:
        candidate = _greedy(problem, lean=False, initial=partial)
        fits = problem.fits(candidate.chosen)
        priced.append((name, candidate.objective_us, fits))
        cheaper = candidate.objective_us < best.objective_us or not problem.fits(best.chosen)
        if fits and cheaper:
            best = dataclasses.replace(candidate, status=name)
    return best, priced


def _greedy(
    problem: Problem, lean: bool, initial: dict[torch.fx.Node, int] | None = None
) -> Solution:
    """:func:`solve_greedy`'s pass, ``initial``'s nodes held at their strategies."""
    memory = problem.memory.per_strategy if problem.memory is not None and lean else {}
    by_consumer: dict[torch.fx.Node, list[Demand]] = {}
    for demand in problem.demands:
        node = demand.options[0][1]
        if node is not None and node.op != "placeholder":  # not a gradient output
            by_consumer.setdefault(node, []).append(demand)
    chosen: dict[torch.fx.Node, int] = {}
    for node, ns in problem.table.items():
        if initial and node in initial:
            chosen[node] = initial[node]
            continue
        if ns.source == "free" and node not in memory:
            chosen[node] = next(
                s for s, out in enumerate(ns.outputs) if all(not p.is_shard() for p in out[0] or ())
            )
            continue
        best, best_cost = 0, float("inf")
        allowed = list(range(len(ns.outputs)))
        if node in memory:
            least = min(memory[node])
            allowed = [s for s in allowed if memory[node][s] == least]
            best = allowed[0]
        for s in allowed:
            total = problem.compute(node, s)
            for demand in by_consumer.get(node, []):
                producer, k = demand.value
                a = problem.table[producer].outputs[chosen[producer]][0 if k is None else k]
                b = next((b for b, _, strategies in demand.options if s in strategies), None)
                c = problem.demand_cost(demand, a, b) if a is not None and b is not None else None
                total += float("inf") if c is None else c
            if total < best_cost:
                best, best_cost = s, total
        chosen[node] = best
    return Solution(chosen, "greedy", objective(problem, chosen))


T = TypeVar("T")


@functools.cache
def _patient_group() -> dist.ProcessGroup:
    """The world on gloo with a timeout longer than any solve: the other ranks wait for rank
    0's choice in it (the default group's timeout may be shorter than a large solve); a rank
    stuck for ``VESCALE_TIMEOUT_S`` beyond the longest solve is an error."""
    seconds = BACKSTOP * MAX_TIME_LIMIT_S + BACKSTOP_S
    limit = datetime.timedelta(seconds=seconds) + timeout()
    group = dist.new_group(backend="gloo", timeout=limit)
    assert group is not None
    return group


def solving_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The group in which rank 0 solves for every rank (:func:`solve_once`): the world when
    ``mesh`` spans all of it (more than one rank, real backend); ``None`` otherwise (every
    rank then solves the same problem itself, deterministically)."""
    spans_world = (
        dist.is_initialized()
        and mesh.device_type != "meta"
        and dist.get_backend() != "fake"
        and mesh.size() == dist.get_world_size() > 1
    )
    return _patient_group() if spans_world else None


def on_first_rank(fn: Callable[[], T], what: str, group: dist.ProcessGroup) -> T:
    """``fn()`` run on rank 0 of ``group`` only, and its outcome broadcast in ``group``: every
    rank returns rank 0's result, or, when ``fn`` raised there (or its result does not
    pickle), raises the same :class:`PlanError` naming ``what``, the exception's class and
    message, as soon as rank 0 failed (never a hang of the other ranks)."""
    box: list[Any] = [None]
    cause: Exception | None = None
    if dist.get_rank(group) == 0:
        try:
            box = [("ok", fn())]
            pickle.dumps(box)  # a result that cannot be sent fails here, not in the broadcast
        except Exception as err:  # any failure: every rank must hear of it
            box, cause = [("error", f"{type(err).__name__}: {err}")], err
    with collective(f"vescale.parallelize: {what} (the broadcast of rank 0's result)"):
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    status, value = box[0]
    if status == "error":
        raise PlanError(f"vescale.parallelize: {what} failed on rank 0: {value}") from cause
    return value  # type: ignore[no-any-return]


def _summary(solution: Solution) -> str:
    gap = solution.gap
    return solution.status + ("" if gap is None else f", gap {gap:.2%}")


def solve_once(
    solve: Callable[[Problem], Solution], problem: Problem, group: dist.ProcessGroup | None
) -> Solution:
    """``solve(problem)``, reported as the ``solve`` progress stage (:mod:`vescale._progress`):
    with ``group`` (:func:`solving_group`) solved on its rank 0 alone and broadcast
    (:func:`on_first_rank`: a failure there is a :class:`PlanError` on every rank), else here."""
    nodes = list(problem.table)

    def run() -> Solution:
        with _progress.stage("solve") as shown:
            solution = solve(problem)
            shown.detail = _summary(solution)
        return solution

    def run_to_send() -> tuple[Solution, list[int]]:  # fx nodes do not travel: indices do
        solution = run()
        return dataclasses.replace(solution, chosen={}), [solution.chosen[n] for n in nodes]

    if group is None:
        return run()
    sent, chosen = on_first_rank(run_to_send, "the solve (rank 0 solves for every rank)", group)
    return dataclasses.replace(sent, chosen=dict(zip(nodes, chosen)))
