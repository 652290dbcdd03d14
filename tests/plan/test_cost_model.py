"""The cost model's bucket rule: collectives the placed program issues together (every
parameter's all-gather before the first op, every gradient's all-reduce before the first
slice at the end) are merged by the ``bucket`` pass into one per kind and mesh dim, so their
latency is paid once, their bandwidth per tensor.

Exact and deterministic: hand-built problems with fixed costs, no ranks, no timing. ``k``
parameters, each used by one op that either computes on its shard (``local_us``: what the
sharded program's own collectives cost, e.g. a row-parallel all-reduce) or gathers it first
(``alpha + bw_us``, latency shared by the bucket). With the rule the gathers cost
``alpha + k * bw_us`` together, so all of them win exactly when ``alpha < k (local_us - bw_us)``;
without it (no bucket) each pays ``alpha`` and gathering wins only when ``alpha < local_us -
bw_us``. A meta-mesh GPT-like MLP checks the pipeline tags the right demands.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import vescale
from vescale import Replicate, Shard
from vescale.plan import AlphaBeta
from vescale.plan.capture import capture_joint
from vescale.plan.cost import bucketed_steps
from vescale.plan.explain import explain
from vescale.plan.program import place
from vescale.plan.propagate import NodeStrategies, Placements, Value
from vescale.plan.solve import Demand, Problem, objective, solve_global, solve_greedy

S: Placements = (Shard(0),)
R: Placements = (Replicate(),)
K, LOCAL_US, BW_US = 4, 10.0, 2.0
THRESHOLD = K * (LOCAL_US - BW_US)  # 32 us: alpha below it, gather all; above, none


def _problem(alpha_us: float, bucket: str | None) -> tuple[Problem, list[torch.fx.Node]]:
    graph = torch.fx.Graph()
    params = [graph.placeholder(f"w{i}") for i in range(K)]
    ops = [graph.call_function(torch.neg, (p,)) for p in params]
    graph.output(tuple(ops))
    table: dict[torch.fx.Node, NodeStrategies] = {}
    demands = []
    for p, op in zip(params, ops):
        table[p] = NodeStrategies(p, [], [(S,)], [()], "plan")
        table[op] = NodeStrategies(op, [(p, None)], [(S,), (R,)], [(S,), (R,)], "registry")
        demands.append(Demand((p, None), [(S, op, [0]), (R, op, [1])], "input", bucket))

    def cost(value: Value, a: Placements, b: Placements) -> float:
        return 0.0 if a == b else alpha_us + BW_US

    def compute(node: torch.fx.Node, s: int) -> float:
        return LOCAL_US if table[node].source == "registry" and s == 0 else 0.0

    def latency(bucket: str, value: Value, a: Placements, b: Placements) -> dict[Any, float]:
        return {("all_gather", 0): alpha_us} if a != b else {}

    return Problem(table, demands, cost, compute, latency=latency), ops


@pytest.mark.parametrize("alpha_us", [THRESHOLD - 0.5, THRESHOLD + 0.5])
def test_bucketed_gathers_flip_at_the_shared_latency(alpha_us: float) -> None:
    problem, ops = _problem(alpha_us, "parameters")
    solution = solve_global(problem)
    gathered = [solution.chosen[op] for op in ops]
    want = 1 if alpha_us < THRESHOLD else 0
    assert gathered == [want] * K, gathered
    expected = alpha_us + K * BW_US if want else K * LOCAL_US
    assert solution.objective_us == pytest.approx(expected, abs=1e-6)
    # the other program is priced by the same arithmetic, and is dearer
    other = {**solution.chosen, **{op: 1 - want for op in ops}}
    other_us = K * LOCAL_US if want else alpha_us + K * BW_US
    assert objective(problem, other) == pytest.approx(other_us, abs=1e-6)
    assert objective(problem, other) > solution.objective_us
    # one gather alone pays the whole latency: never cheaper than none
    one = {**solution.chosen, **{op: int(i == 0) for i, op in enumerate(ops)}}
    assert objective(problem, one) == pytest.approx(alpha_us + BW_US + (K - 1) * LOCAL_US)


@pytest.mark.parametrize("alpha_us", [LOCAL_US - BW_US - 0.5, LOCAL_US - BW_US + 0.5])
def test_unbucketed_gathers_each_pay_the_latency(alpha_us: float) -> None:
    problem, ops = _problem(alpha_us, None)
    solution = solve_global(problem)
    want = 1 if alpha_us < LOCAL_US - BW_US else 0
    assert [solution.chosen[op] for op in ops] == [want] * K
    per_op = alpha_us + BW_US if want else LOCAL_US
    assert solution.objective_us == pytest.approx(K * per_op, abs=1e-6)


def test_greedy_pays_every_latency_and_keeps_the_shards() -> None:
    """Op by op a gather costs its whole latency, so greedy keeps every shard where the
    global choice (the bucket's latency once) gathers them all."""
    problem, ops = _problem(THRESHOLD - 0.5, "parameters")
    assert [solve_greedy(problem).chosen[op] for op in ops] == [0] * K
    assert [solve_global(problem).chosen[op] for op in ops] == [1] * K


def test_bucketed_steps_only_where_the_program_issues_the_bucket() -> None:
    mesh = (2, 2)
    shape = (8, 6)
    rr: Placements = (Replicate(), Replicate())
    (gather,) = bucketed_steps("parameters", (Replicate(), Shard(1)), rr, shape, 4, mesh)
    assert (gather.kind, gather.mesh_dim, gather.bytes) == ("all_gather", 1, 8 * 3 * 4)
    # the gather then a local slice onto another dim: still one all-gather
    assert bucketed_steps(
        "parameters", (Replicate(), Shard(1)), (Shard(0), Replicate()), shape, 4, mesh
    )
    # sharded over both mesh dims, or unevenly: not in the bucket
    both = (Shard(0), Shard(1))
    assert bucketed_steps("parameters", both, rr, shape, 4, mesh) == ()
    assert bucketed_steps("parameters", (Replicate(), Shard(0)), rr, (7, 6), 4, mesh) == ()
    partial = (vescale.Partial(), Replicate())
    (reduce,) = bucketed_steps("gradients", partial, (Replicate(), Shard(0)), shape, 4, mesh)
    assert (reduce.kind, reduce.mesh_dim) == ("all_reduce", 0)
    # every reduction of a gradient: a reduce-scatter, two all-reduces, a reduce-scatter
    # then an all-reduce (each joins its own kind's bucket)
    (scatter,) = bucketed_steps("gradients", partial, (Shard(0), Replicate()), shape, 4, mesh)
    assert (scatter.kind, scatter.mesh_dim) == ("reduce_scatter", 0)
    pp = (vescale.Partial(), vescale.Partial())
    two = bucketed_steps("gradients", pp, rr, shape, 4, mesh)
    assert sorted((s.kind, s.mesh_dim) for s in two) == [("all_reduce", 0), ("all_reduce", 1)]
    mixed = bucketed_steps("gradients", pp, (Shard(0), Replicate()), shape, 4, mesh)
    assert sorted((s.kind, s.mesh_dim) for s in mixed) == [("all_reduce", 1), ("reduce_scatter", 0)]
    # a gather is no gradient reduction
    assert bucketed_steps("gradients", (Replicate(), Shard(1)), rr, shape, 4, mesh) == ()


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.ModuleList(nn.Linear(16, 32, bias=False) for _ in range(2))
        self.proj = nn.ModuleList(nn.Linear(32, 16, bias=False) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc, proj in zip(self.fc, self.proj):
            x = proj(torch.relu(fc(x)))
        return x.square().sum()


def _place_mlp(alpha_s: float) -> Any:
    mesh = vescale.DeviceMesh("meta", torch.arange(2), mesh_dim_names=("tp",))
    joint = capture_joint(_MLP(), [torch.randn(4, 16)])
    names = joint.placeholder_names  # fc.0, fc.1, proj.0, proj.1, x
    fixed = {n: (Shard(0 if i < 2 else 1),) for i, n in enumerate(names[:4])}
    fixed[names[4]] = (Replicate(),)
    return place(joint, mesh, fixed, None, AlphaBeta((alpha_s,), (1e-9,), 0.0), buckets=True)


def test_mlp_gathers_its_weights_when_latency_dominates() -> None:
    """Two Megatron MLPs (column- then row-parallel, batch of 4) need three all-reduces of
    256 B activations (two forward, one backward); gathering the four 1 KiB weight shards is
    one bucketed all-gather. 1 ms latency: gather; none: keep the shards."""
    for alpha_s, gathers in ((1e-3, True), (0.0, False)):
        program = _place_mlp(alpha_s)
        kinds = {}
        for demand in program.demands:
            src, dst = program.placements(demand.value), program.required(demand)
            steps = program.steps(demand.value, src, dst)
            if steps and demand.bucket == "parameters":
                assert program.bucketed(demand, src, dst)
            for s in steps:
                kinds.setdefault((demand.bucket, s.kind), 0)
                kinds[(demand.bucket, s.kind)] += 1
        if gathers:
            assert set(kinds) == {("parameters", "all_gather")}, kinds
            report = explain(program)  # one latency for the bucket, bandwidth per tensor
            n = kinds[("parameters", "all_gather")]
            assert report.buckets == {("parameters", "all_gather", 0): n}
            assert report.estimated_us == pytest.approx(1e3 + report.total_bytes * 1e-3)
        else:
            assert ("parameters", "all_gather") not in kinds, kinds


def _check_mlp_program_on_two_ranks() -> None:
    """1 ms latency on 2 gloo ranks. Compiled (bucketing on): the four weights gathered, one
    all-gather in the step (the ``bucket`` pass merged every gather, as priced) and nothing
    else. Eager (no bucket pass, every gather pays its latency): Megatron's program, no
    gather. Both equal one device."""
    from tests.dtensor.reference import mesh_of
    from tests.harness.collectives import count_collectives
    from vescale.backend import capture_graphs
    from vescale.fx.collectives import COLLECTIVE_KINDS

    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    ref = _MLP()
    ref(x).backward()
    plan = {"fc.*": (Shard(0),), "proj.*": (Shard(1),)}
    costs = AlphaBeta((1e-3,), (1e-9,), 0.0)
    for compile in (True, False):
        model = vescale.parallelize(
            _MLP(),
            mesh_of((2,)),
            plan,
            inputs=[(Replicate(),)],
            example_inputs=[x],
            alpha_beta=costs,
            compile=compile,
            options={"codegen": "fx"},
        )
        with count_collectives() as counts, capture_graphs() as graphs:
            loss = model(x)
            loss.backward()
        assert abs(loss.full_tensor().item() - ref(x).item()) < 1e-5
        for name, p in model.module.named_parameters():
            want = dict(ref.named_parameters())[name].grad
            assert p.grad is not None and tuple(p.grad.placements) == tuple(p.placements)
            assert torch.allclose(p.grad.full_tensor(), want, atol=1e-5), name
        if compile:
            kinds = [
                COLLECTIVE_KINDS[n.target]
                for g in graphs
                for n in g.gm.graph.nodes
                if n.op == "call_function" and n.target in COLLECTIVE_KINDS
            ]
            assert kinds == ["all_gather"], kinds
        else:
            assert "all_gather" not in counts and counts["all_reduce"] >= 2, dict(counts)


def test_mlp_program_gathers_in_one_bucket(pool2):
    pool2.run(_check_mlp_program_on_two_ranks, timeout_s=600)
