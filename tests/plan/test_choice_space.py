"""The plan path's choice space on a small GPT with an empty plan and a free batch
(``Batch("dp", "tp")``) on a (dp=2, tp=2) mesh, and its memory budget.

* No budget: the data-parallel program over all four ranks (DDP-4) is chosen: parameters
  replicated, the batch split over both mesh dims, every gradient reduced by one all-reduce
  over the flattened group of the four ranks, all of them one bucket: the compiled step's
  collectives are counted from its graph; losses and parameters equal one device.
* A budget below what replicated parameters and gradients alone hold: every parameter is
  sharded (FSDP-like: gathered before use, gradients reduce-scattered); the parameter bytes
  each rank really holds equal the report's, which is under the budget; losses equal one
  device.
* Parameters stay plain tensors (gradients too, as under upstream DDP) only when the plan
  names none of them and the choice replicates every one; a plan naming them replicated
  gives DTensors; both train like one device, a deferred-init model initialized as one; a
  retained graph's second backward adds the same gradients again. The compiled DDP step's
  gradients become the parameters' ``.grad`` as handed over (no copy).
* A budget nothing fits: the same :class:`PlanError` on every rank, naming the smallest
  budget that fits; that budget fits and one byte less does not (meta mesh, no ranks).
"""

from __future__ import annotations

import re

import pytest
import torch

import vescale
from tests.harness.misuse import error_everywhere
from tests.plan.gpt_cases import gpt_mesh, meta_gpt_problem, train
from vescale import Replicate
from vescale.plan import AlphaBeta, Batch, PlanError
from vescale.plan.program import place

# fixed costs (20 us, 1 GB/s, 10 GB/s memory, 10 GFLOP/s): the choice does not depend on load
COSTS = AlphaBeta((20e-6, 20e-6), (1e-9, 1e-9), 1e-10, flops_rate=10e9)
FREE = Batch("dp", "tp")


def _cfg(vocab: int):  # type: ignore[no-untyped-def]
    import gpt

    return gpt.GPTConfig(vocab=vocab, seq=16, dim=32, heads=4, layers=1)


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _placed(vocab: int, budget: int | None, compile: bool = True):  # type: ignore[no-untyped-def]
    """The GPT placed from an empty plan and a free batch, trained 3 SGD steps and checked
    against one device (losses and parameters within 1e-5). The second step's inputs are
    contiguous copies (the first's are views of one tensor, as ``gpt.batch`` gives them) and
    its loss is halved before ``backward``."""
    import gpt

    torch._dynamo.reset()
    cfg = _cfg(vocab)
    batches = [gpt.batch(cfg, i) for i in range(3)]
    scales = (1.0, 0.5, 1.0)
    ref_losses, ref_params = train(gpt.build(cfg), batches, scales)
    batches[1] = tuple(t.contiguous() for t in batches[1])
    model = vescale.parallelize(
        gpt.build(cfg),
        gpt_mesh(),
        {},
        inputs=[FREE, FREE],
        example_inputs=batches[0],
        alpha_beta=COSTS,
        compile=compile,
        options={"codegen": "fx"},
        memory_budget=budget,
        progress=False,
    )
    losses, params = train(model, batches, scales)
    assert all(abs(a - b) < 1e-5 for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    for k, v in params.items():
        torch.testing.assert_close(v, ref_params[k], atol=1e-5, rtol=0, msg=k)
    return model


def _check_ddp() -> dict:
    from vescale.backend import capture_graphs
    from vescale.fx.collectives import collective_table

    with capture_graphs() as graphs:  # the placed step, compiled at its first call
        model = _placed(64, None)
    import gpt

    model.zero_grad()
    handed = _handed_gradients(model, gpt.batch(_cfg(64), 0))
    placements = set(model.program.param_placements().values())
    records = [r for g in graphs for r in collective_table(g.gm, g.name)]
    return {
        "placements": placements,
        "inputs": model.input_placements,
        "recipe": model.explain().recipe,
        "collectives": [(r["kind"], tuple(r["group_ranks"]), r["bytes"]) for r in records],
        "param_bytes": _param_bytes(model.module),
        # a data-parallel program keeps plain parameters and gradients, as upstream DDP does
        "plain": {(type(p).__name__, type(p.grad).__name__) for p in model.module.parameters()},
        # each gradient the step hands over becomes its parameter's .grad, not a copy of it
        "handed": handed == [_storage(p.grad) for p in model.parameters()],
    }


def test_empty_plan_free_batch_is_ddp_over_both_mesh_dims(pool4):
    for out in pool4.run(_check_ddp, timeout_s=900):
        rep = (Replicate(), Replicate())
        assert out["placements"] == {rep}, out["placements"]
        # the tokens split (the rest of the split is a local slice, free), the targets whole:
        # every rank is given them, so the loss counts its global token count locally
        assert out["inputs"][0][0] == vescale.Shard(0), out["inputs"]
        assert out["inputs"][1] == rep, out["inputs"]
        assert out["recipe"] == "DDP over dp+tp", out["recipe"]
        assert out["plain"] == {("Parameter", "Tensor")}, out["plain"]
        assert out["handed"]
        # the step: one all-reduce over the four ranks holding every gradient and the loss
        # value (one float32); nothing else (upstream DDP's one bucket)
        assert out["collectives"] == [("all_reduce", (0, 1, 2, 3), out["param_bytes"] + 4)], out[
            "collectives"
        ]


def _storage(t: torch.Tensor) -> int:
    return (t._local_tensor if isinstance(t, vescale.DTensor) else t).data_ptr()


def _handed_gradients(model, inputs) -> list[int]:  # type: ignore[no-untyped-def]
    """One step's backward; the storage of each gradient the placed step hands over."""
    from vescale.plan import api

    handed: list[int] = []
    backward = api._AttachGrads.backward

    def recorded(ctx, grad):  # type: ignore[no-untyped-def]
        out = backward(ctx, grad)
        handed.extend(_storage(t) for t in out if isinstance(t, torch.Tensor))
        return out

    api._AttachGrads.backward = staticmethod(recorded)  # type: ignore[method-assign]
    try:
        model(*inputs).backward()
    finally:
        api._AttachGrads.backward = staticmethod(backward)  # type: ignore[method-assign]
    return handed


def _check_plain_only_when_unnamed() -> dict:
    """A deferred-init GPT under the empty plan (parameters materialized plain, as one
    device initializes them) and under a plan naming every parameter replicated (the same
    program, but the user asked for DTensors): both train like one device."""
    import gpt

    cfg = _cfg(64)
    batches = [gpt.batch(cfg, i) for i in range(2)]
    ref_init = {k: v.detach().clone() for k, v in gpt.build(cfg).named_parameters()}
    ref_losses, ref_params = train(gpt.build(cfg), batches)
    kinds = {}
    for name, plan in (("empty", {}), ("named", {"*": (Replicate(), Replicate())})):
        model = vescale.parallelize(
            gpt.build_deferred(cfg), gpt_mesh(), plan, inputs=[FREE, FREE], example_inputs=batches[0],
            alpha_beta=COSTS, compile=False, progress=False,
        )  # fmt: skip
        if name == "empty":
            for k, v in model.module.named_parameters():
                assert torch.equal(v.detach(), ref_init[k]), k
        losses, params = train(model, batches)
        assert all(abs(a - b) < 1e-5 for a, b in zip(losses, ref_losses)), (losses, ref_losses)
        for k, v in params.items():
            torch.testing.assert_close(v, ref_params[k], atol=1e-5, rtol=0, msg=k)
        kinds[name] = {(type(p).__name__, type(p.grad).__name__) for p in model.parameters()}
        # a retained graph hands the same gradients again: they add up
        model.zero_grad()
        loss = model(*batches[0])
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in model.parameters()]
        loss.backward()
        for p, g in zip(model.parameters(), first):
            torch.testing.assert_close(p.grad, 2 * g, atol=0, rtol=0)
    return kinds


def test_plain_parameters_only_when_the_plan_names_none(pool4):
    for kinds in pool4.run(_check_plain_only_when_unnamed, timeout_s=600):
        assert kinds == {"empty": {("Parameter", "Tensor")}, "named": {("DTensor", "DTensor")}}


def _check_whole_inputs_sliced() -> None:
    from vescale.dtensor.placement_types import InterleavedShard
    from vescale.plan.api import _narrows, _take

    mesh, r, s0, s1 = gpt_mesh(), Replicate(), vescale.Shard(0), vescale.Shard(1)
    whole = torch.arange(35.0).reshape(5, 7)[:, :6]  # uneven over 2 and 4, not contiguous
    for placements in [(s0, s0), (s0, s1), (s1, s0), (r, s0), (s1, r), (r, r)]:
        d = vescale.DTensor.from_local(whole, mesh, (r, r)).redistribute(mesh, placements)
        local = _take(whole, _narrows(d._spec))
        assert torch.equal(local, d.to_local()) and local.is_contiguous(), placements
    d = vescale.DTensor.from_local(whole, mesh, (r, r)).redistribute(
        mesh, (r, InterleavedShard(1, 3))
    )
    assert _narrows(d._spec) is None  # not a plain slice: redistributed at every call


def test_whole_inputs_are_sliced_as_redistribution_slices_them(pool4):
    """Later calls slice a plain input locally (``PlannedModule._inputs``); the slice is the
    first call's redistribution's, on every rank, for uneven shapes and views."""
    pool4.run(_check_whole_inputs_sliced, timeout_s=120)


def _check_budget(budget: int) -> dict:
    model = _placed(1024, budget)
    report = model.explain()
    local = sum(p.to_local().numel() * p.element_size() for p in model.module.parameters())
    return {
        "placements": {n: tuple(p.placements) for n, p in model.module.named_parameters()},
        "memory": report.memory,
        "local_param_bytes": local,
        "recipe": report.recipe,
        "summary": report.summary(),
    }


def test_budget_below_replicated_parameters_shards_them(pool4):
    import gpt

    # replicated parameters and their gradients alone (SGD: no state) would fill the budget
    replicated = _param_bytes(gpt.build(_cfg(1024)))
    budget = 2 * replicated
    for out in pool4.run(_check_budget, budget, timeout_s=900):
        # sharded enough to fit: small parameters may stay replicated where the rest fits
        assert out["local_param_bytes"] < replicated, (out["placements"], out["summary"])
        assert out["memory"]["parameters"] == out["local_param_bytes"], out["memory"]
        assert out["memory"]["total"] <= budget, (out["memory"], budget)
        # not the free choice (DDP over dp+tp); FSDP or TP, whichever the costs prefer
        assert out["recipe"].startswith(("FSDP", "DDP (", "TP")), out["summary"]
        assert f"budget {budget / 2**20:.2f} MiB" in out["summary"], out["summary"]


def _infeasible() -> None:
    _placed(64, 1000, compile=False)


def test_infeasible_budget_names_the_smallest_that_fits(pool4):
    error = error_everywhere(pool4, _infeasible, timeout_s=300)
    assert error.kind == "PlanError", error
    assert "memory_budget=1000 bytes per rank fits no placement" in error.message, error
    least = int(re.search(r"smallest budget that fits is (\d+) bytes", error.message)[1])
    # the same number from a meta mesh (no ranks): it fits, one byte less does not
    mesh, joint, free, _ = meta_gpt_problem(_cfg(64), FREE)
    program = place(joint, mesh, free, None, COSTS, buckets=True, memory_budget=least)
    assert program.memory is not None and program.memory.of(program.chosen)["total"] <= least
    with pytest.raises(PlanError, match=f"smallest budget that fits is {least} bytes"):
        place(joint, mesh, free, None, COSTS, buckets=True, memory_budget=least - 1)


def test_budget_branches_on_the_relaxations_fractional_nodes(monkeypatch):
    """A budget makes the LP relaxation fractional; branching over its fractional nodes alone
    (the rest held as the LP chose) finds a choice within 1% of branch and bound over every
    node, which fits (meta mesh, the GPT above with vocab 64, budget twice its parameters)."""
    import vescale.plan.solve as solve

    mesh, joint, free, model = meta_gpt_problem(_cfg(64), FREE)
    budget = 2 * _param_bytes(model)
    fixed = place(joint, mesh, free, None, COSTS, buckets=True, memory_budget=budget)
    branch = solve._branch
    monkeypatch.setattr(  # the heuristic finds nothing: every node is branched on
        solve,
        "_branch",
        lambda lp, *a, fixed=None: (None, None, None) if fixed is not None else branch(lp, *a),
    )
    full = place(joint, mesh, free, None, COSTS, buckets=True, memory_budget=budget)
    assert fixed.solution is not None and full.solution is not None
    assert fixed.solution.status.startswith(
        "best found by branch and bound over the LP's fractional nodes "
    ), fixed.solution.status
    assert full.solution.status == "optimal (branch and bound within 0.1%)", full.solution.status
    assert fixed.solution.objective_us <= full.solution.objective_us * 1.01
    assert fixed.memory is not None and fixed.memory.of(fixed.chosen)["total"] <= budget


@pytest.mark.parametrize(
    ("spec", "shape", "message"),
    [
        (
            Batch("dp", "pp"),
            (8, 4),
            r"inputs\[0\]: mesh dim 'pp' is not a dim of mesh\(dp=2, tp=2\)",
        ),
        (Batch("dp", 0), (8, 4), r"Batch\('dp', 0\) names a mesh dim of mesh\(dp=2, tp=2\) twice"),
        (Batch(), (8, 4), r"Batch\(\) names no mesh dim"),
        (Batch("dp", dim=2), (8, 4), r"splits dim 2, but the input has shape \(8, 4\)"),
        (Batch("dp", "tp"), (3, 4), r"no set of the mesh dims \{'dp': 2, 'tp': 2\}.*size 3"),
    ],
)
def test_batch_spec_errors_name_input_spec_and_mesh(spec: Batch, shape, message: str) -> None:
    from vescale.plan.batch import batch_choices

    mesh = vescale.DeviceMesh("meta", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(PlanError, match=message):
        batch_choices("inputs[0]", spec, torch.zeros(shape), mesh)


def test_batch_choices_are_every_dividing_set_most_split_first() -> None:
    from vescale import Shard
    from vescale.plan.batch import batch_choices

    mesh = vescale.DeviceMesh("meta", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    s, r = Shard(1), Replicate()
    got = batch_choices("x", Batch("tp", "dp", dim=1), torch.zeros(3, 4), mesh)
    assert got == [(s, s), (s, r), (r, s)]
    assert batch_choices("x", Batch("dp", "tp", dim=1), torch.zeros(3, 2), mesh) == [(s, r), (r, s)]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"memory_budget": 0}, PlanError, "memory_budget must be a positive int .* got 0"),
        ({"memory_budget": 1.5e6}, PlanError, "memory_budget must be a positive int"),
        ({"optimizer": "lion"}, ValueError, r"optimizer must be one of \['adagrad', 'adam'"),
    ],
)
def test_budget_arguments_are_checked_before_tracing(kwargs, error, message) -> None:
    import gpt

    mesh = vescale.DeviceMesh("meta", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    cfg = _cfg(64)
    with pytest.raises(error, match=message):
        vescale.parallelize(
            gpt.build(cfg),
            mesh,
            {},
            inputs=[FREE, FREE],
            example_inputs=gpt.batch(cfg, 0),
            **kwargs,
        )
