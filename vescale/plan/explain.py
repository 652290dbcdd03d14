"""What the plan path chose and why: per node its placements and the alternatives' costs,
every redistribution with the op that wanted it, and bytes per step by mesh dim and kind."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vescale.plan.cost import CommStep, group_of, step_time
from vescale.plan.program import DP_GATHER_PENALTY_US, PlacedProgram
from vescale.plan.propagate import Placements
from vescale.plan.solve import Solution

__all__ = ["Explanation", "Redistribution", "explain"]


def _fmt(placements: Placements | None) -> str:
    if placements is None:
        return "-"
    short = {"Replicate()": "R"}
    out = []
    for p in placements:
        text = repr(p)
        text = short.get(text, text)
        text = text.replace("Shard(dim=", "S(").replace("Partial(sum)", "P")
        out.append(text)
    return "(" + ", ".join(out) + ")"


@dataclass(frozen=True)
class Redistribution:
    """One inserted redistribution: ``value`` from ``src`` to ``dst`` for ``reason``."""

    value: str
    src: Placements
    dst: Placements
    steps: tuple[CommStep, ...]
    reason: str
    source: str
    cost_us: float


@dataclass
class Explanation:
    solver: str
    alpha_beta: Any
    nodes: list[tuple[str, str, str, list[tuple[str, float]]]]  # name, op, chosen, alternatives
    redistributions: list[Redistribution]
    timings_s: dict[str, float]
    measured: dict[str, Any] = field(default_factory=dict)
    solution: Solution | None = None
    # (bucket, kind, mesh dim, or the dims of a flattened group) -> members
    buckets: dict[tuple[str, str, Any], int] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)  # bytes per rank by kind, "total"
    budget: int | None = None
    recipe: str = ""
    penalties: int = 0  # data-parallel gathers taken (in the objective, not in the estimate)

    @property
    def step_us(self) -> float | None:
        """The solver's estimated step time (us), without the soft penalties it took."""
        if self.solution is None:
            return None
        return self.solution.objective_us - self.penalties * DP_GATHER_PENALTY_US

    @property
    def bytes_by_dim_and_kind(self) -> Counter[tuple[Any, str]]:
        """Bytes per (mesh dim, or the dims of a flattened group, kind)."""
        out: Counter[tuple[Any, str]] = Counter()
        for r in self.redistributions:
            for s in r.steps:
                out[(_group_key(s), s.kind)] += s.bytes
        return out

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_dim_and_kind.values())

    @property
    def collective_count(self) -> int:
        return sum(len(r.steps) for r in self.redistributions)

    @property
    def merged_count(self) -> int:
        """Collectives per step once the ``bucket`` pass merged each bucket's members."""
        return self.collective_count - sum(self.buckets.values()) + len(self.buckets)

    @property
    def estimated_us(self) -> float:
        """Every redistribution's time, a bucket's latency once."""
        shared = sum(
            self.alpha_beta.comm_s(kind, _dims(key), 2, 0) * (n - 1)
            for (_, kind, key), n in self.buckets.items()
        )
        return sum(r.cost_us for r in self.redistributions) - shared * 1e6

    def summary(self) -> str:
        ab = self.alpha_beta
        lines = [
            f"solver: {self.solver}; propagate {self.timings_s.get('propagate', 0):.2f} s, "
            f"solve {self.timings_s.get('solve', 0):.2f} s",
            *self._solution_lines(),
            "alpha (us) / beta (ns/B) per mesh dim: "
            + ", ".join(f"{a * 1e6:.1f} / {b * 1e9:.3f}" for a, b in zip(ab.alpha, ab.beta)),
            f"collectives per step: {self.collective_count}{self._merged()}, "
            f"bytes per step: {self.total_bytes}, "
            f"estimated communication time: {self.estimated_us:.1f} us",
            *self._memory_lines(),
            "| mesh dim | kind | count | bytes |",
            "|---|---|---|---|",
        ]
        counts: Counter[tuple[Any, str]] = Counter(
            (_group_key(s), s.kind) for r in self.redistributions for s in r.steps
        )
        for (dim, kind), b in sorted(self.bytes_by_dim_and_kind.items(), key=repr):
            lines.append(f"| {_dim_text(dim)} | {kind} | {counts[(dim, kind)]} | {b} |")
        for k, v in self.measured.items():
            lines.append(f"measured {k}: {v}")
        return "\n".join(lines)

    def _merged(self) -> str:
        if not self.buckets:
            return ""
        parts = ", ".join(
            f"{b} {k}[dim {_dim_text(d)}] x{n}"
            for (b, k, d), n in sorted(self.buckets.items(), key=repr)
        )
        return f" ({self.merged_count} after the bucket pass: {parts})"

    def _memory_lines(self) -> list[str]:
        lines = [f"recipe: {self.recipe}"] if self.recipe else []
        m = self.memory
        if m:
            parts = ", ".join(f"{k} {_mib(b)}" for k, b in m.items() if k != "total" and b)
            limit = "" if self.budget is None else f" (budget {_mib(self.budget)})"
            lines.append(f"memory per rank: {_mib(m['total'])}{limit}: {parts}")
        return lines

    def _solution_lines(self) -> list[str]:
        sol = self.solution
        if sol is None:
            return []
        line = f"{sol.status}: estimated step {self.step_us:.1f} us"
        if sol.gap is not None:
            gap_us = max(sol.objective_us - (sol.bound_us or 0.0), 0.0)
            line += f" (gap to the lower bound {gap_us:.1f} us = {sol.gap:.2%})"
        if self.penalties:
            line += (
                f"; {self.penalties} value(s) computed from the batch gathered over a "
                f"data-parallel mesh dim (no strategy keeps them split)"
            )
        if sol.greedy_us is not None:
            line += f"; greedy {sol.greedy_us:.1f} us"
        if sol.pairs[1]:
            line += f"; {sol.pairs[0]} of {sol.pairs[1]} edge pairs within the cheapest candidate's cost"
        priced = ", ".join(
            f"{name} {us:.1f} us" + ("" if fits else " (over the budget)")
            for name, us, fits in sol.candidates
        )
        return [line, f"candidates priced: {priced}"] if priced else [line]

    def markdown(self) -> str:
        lines = ["# placements", "", self.summary(), "", "## redistributions", ""]
        lines += [
            "| value | from | to | collectives | est. us | why | source |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in self.redistributions:
            steps = ", ".join(
                f"{s.kind}[dim {_dim_text(_group_key(s))}] {s.bytes} B" for s in r.steps
            )
            lines.append(
                f"| {r.value} | {_fmt(r.src)} | {_fmt(r.dst)} | {steps or 'local'} | {r.cost_us:.1f} | "
                f"{r.reason} | {r.source} |"
            )
        lines += [
            "",
            "## nodes",
            "",
            "| node | op | chosen | alternatives (est. us of their input redistributions) |",
        ]
        lines.append("|---|---|---|---|")
        for name, op, chosen, alts in self.nodes:
            alt = "; ".join(f"{p} {c:.1f}" for p, c in alts)
            lines.append(f"| {name} | {op} | {chosen} | {alt} |")
        return "\n".join(lines) + "\n"

    def write(self, folder: str | Path) -> Path:
        path = Path(folder) / "placements.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.markdown())
        return path


def _group_key(step: CommStep) -> Any:
    """A step's mesh dim, or the dims of its flattened group."""
    dims = group_of(step)
    return dims[0] if len(dims) == 1 else dims


def _dims(key: Any) -> tuple[int, ...]:
    return key if isinstance(key, tuple) else (key,)


def _dim_text(key: Any) -> str:
    return "+".join(str(d) for d in _dims(key))


def _mib(b: int) -> str:
    return f"{b / 2**20:.2f} MiB"


def _source(node: torch.fx.Node | None) -> str:
    trace = (node.meta.get("stack_trace") or "") if node is not None else ""
    frames = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File ")]
    user = [f for f in frames if "/torch/" not in f and "/vescale/plan/" not in f]
    if not user:
        return ""
    parts = user[-1].split('"')
    path = parts[1].rsplit("/", 1)[-1] if len(parts) > 1 else "?"
    line = user[-1].split("line ")[-1].split(",")[0]
    return f"{path}:{line}"


def explain(program: PlacedProgram, max_alternatives: int = 3) -> Explanation:
    """The :class:`Explanation` of ``program`` (also ``PlannedModule.explain()``)."""
    redistributions = []
    buckets: Counter[tuple[str, str, int]] = Counter()
    for demand in program.demands:
        src = program.placements(demand.value)
        dst = program.required(demand)
        if src == dst:
            continue
        steps = tuple(program.steps(demand.value, src, dst))
        if demand.bucket is not None:
            bucketed = program.bucketed(demand, src, dst)
            buckets.update((demand.bucket, s.kind, _group_key(s)) for s in bucketed)
        node, k = demand.value
        consumer = next((n for _, n, _ in demand.options if n is not None), None)
        name = node.name if k is None else f"{node.name}[{k}]"
        cost = sum(step_time(program.alpha_beta, s) for s in steps) * 1e6
        where = consumer if consumer is not None and consumer.op != "placeholder" else node
        redistributions.append(
            Redistribution(name, src, dst, steps, demand.reason, _source(where), cost)
        )
    for node, ns in program.table.items():
        inside = tuple(ns.internal[program.chosen[node]]) if ns.internal else ()
        if inside:
            cost = sum(step_time(program.alpha_beta, s) for s in inside) * 1e6
            p = ns.outputs[program.chosen[node]][0]
            assert p is not None
            why = f"inside {node.target} (vescale's handler)"
            redistributions.append(
                Redistribution(node.name, p, p, inside, why, _source(node), cost)
            )
    by_consumer: dict[torch.fx.Node, list[Any]] = {}
    for demand in program.demands:
        consumer = demand.options[0][1]
        if consumer is not None and consumer.op != "placeholder":
            by_consumer.setdefault(consumer, []).append(demand)
    nodes = []
    for node, ns in program.table.items():
        if node.op == "placeholder" or ns.source == "constant":
            continue
        alts: dict[str, float] = {}
        for s, outs in enumerate(ns.outputs):
            total = 0.0
            for i, demand in enumerate(by_consumer.get(node, [])):
                src = program.placements(demand.value)
                needed = program.steps(demand.value, src, ns.input_placements[s][i])
                total += sum(step_time(program.alpha_beta, st) for st in needed) * 1e6
            key = _fmt(outs[0]) if len(outs) == 1 else "/".join(_fmt(o) for o in outs)
            alts[key] = min(total, alts.get(key, float("inf")))
        chosen_outs = ns.outputs[program.chosen[node]]
        chosen = (
            _fmt(chosen_outs[0])
            if len(chosen_outs) == 1
            else "/".join(_fmt(o) for o in chosen_outs)
        )
        others = sorted(((p, c) for p, c in alts.items() if p != chosen), key=lambda x: x[1])
        op = str(node.target).removeprefix("aten.")
        label = op if ns.source == "registry" else f"{op} [{ns.source}]"
        nodes.append((node.name, label, chosen, others[:max_alternatives]))
    return Explanation(
        program.solver,
        program.alpha_beta,
        nodes,
        redistributions,
        dict(program.timings_s),
        solution=program.solution,
        buckets=dict(buckets),
        memory={} if program.memory is None else program.memory.of(program.chosen),
        budget=None if program.memory is None else program.memory.budget,
        recipe=recipe(program),
        penalties=program.penalties,
    )


def recipe(program: PlacedProgram) -> str:
    """The hand-written recipe the choice amounts to, per mesh dim, read from each trained
    parameter's placement and its gradient's as computed: ``DDP`` (parameter replicated,
    gradient partial: reduced), ``FSDP`` (parameter sharded, gradient partial: gathered
    before use, gradient reduce-scattered), ``TP`` (parameter sharded, gradient not
    reduced), ``replicated`` (neither); by the majority of trained parameter bytes (the share
    when not all), e.g. ``"FSDP over dp x TP over tp"``."""
    joint, mesh = program.joint, program.mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    by_name = {n.name: n for n in program.table}
    owner_ph = dict(zip(joint.param_names, joint.placeholder_names))
    output = next(n for n in joint.gm.graph.nodes if n.op == "output")
    outs = output.args[0]
    weights: list[Counter[str]] = [Counter() for _ in range(mesh.ndim)]
    for pos, owner in joint.grad_of.items():
        param, grad = by_name[owner_ph[owner]], outs[pos]
        if not isinstance(grad, torch.fx.Node) or grad not in program.table:
            continue
        size = param.meta["val"].numel()
        held = program.placements((param, None))
        computed = program.placements((grad, None))
        for d, (p, g) in enumerate(zip(held, computed)):
            reduced = g.is_partial()
            kind = (
                ("FSDP" if reduced else "TP")
                if p.is_shard()
                else ("DDP" if reduced else "replicated")
            )
            weights[d][kind] += size
    parts: list[tuple[str, list[str]]] = []
    for d, w in enumerate(weights):
        if mesh.size(d) == 1 or not w:
            continue
        kind, n = w.most_common(1)[0]
        share = n / sum(w.values())
        label = kind if share == 1 else f"{kind} ({share:.0%} of parameter bytes)"
        same = next((p for p in parts if p[0] == label), None)
        if same is None:
            parts.append((label, [names[d]]))
        else:
            same[1].append(names[d])
    if not parts:
        return "one device's program on every rank (nothing split)"
    return " x ".join(f"{label} over {'+'.join(dims)}" for label, dims in parts)
