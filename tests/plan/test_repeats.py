"""Identical blocks share their solve (meta (dp=2, tp=2) mesh, no ranks, fixed costs): the
demo GPT's program, counted in LP columns, rows and nonzeros handed to HiGHS, is no larger
with 4 blocks than with 2; the shared choice is the solve of the whole graph's (every node
its own variables: the same estimate, placements and collectives); every later block's parameter is its first-block namesake's twin and
nothing outside the blocks (embeddings, final norm, head, loss) is tied."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import vescale
import vescale.plan.program as program
from tests.plan.gpt_cases import GPT_PLAN
from vescale.plan import AlphaBeta, Batch
from vescale.plan.batch import batch_choices
from vescale.plan.capture import capture_joint
from vescale.plan.explain import explain
from vescale.plan.validate import normalize_plan

COSTS = AlphaBeta((20e-6, 20e-6), (1e-9, 1e-9), 1e-10, flops_rate=1e9)


@pytest.fixture(autouse=True)
def _no_plan_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VESCALE_PLAN_CACHE", "0")


def _placed(layers: int, plan: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
    import gpt

    mesh = vescale.DeviceMesh("meta", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    cfg = gpt.GPTConfig(vocab=64, seq=16, dim=32, heads=4, layers=layers)
    example, model = gpt.batch(cfg, 0), gpt.build(cfg)
    joint = capture_joint(model, example)
    names = [n for n, _ in model.named_parameters()]
    by_name = normalize_plan(plan or {}, dict(model.named_parameters()), mesh)
    fixed: dict[str, Any] = {
        ph: by_name[n] for n, ph in zip(names, joint.placeholder_names) if n in by_name
    }
    batch = Batch("dp") if plan else Batch("dp", "tp")
    for ph, t in zip(joint.placeholder_names[len(names) :], example):
        fixed[ph] = batch_choices("x", batch, t, mesh)
    return program.place(joint, mesh, fixed, None, COSTS, buckets=True), model


def _lp_sizes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    import scipy.optimize

    sizes: list[tuple[int, int, int]] = []
    real = scipy.optimize.linprog

    def spy(c: Any, *a: Any, **k: Any) -> Any:
        sizes.append((len(c), k["A_eq"].shape[0], k["A_eq"].nnz))
        return real(c, *a, **k)

    monkeypatch.setattr(scipy.optimize, "linprog", spy)
    return sizes


def test_four_blocks_solve_no_larger_than_two(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = _lp_sizes(monkeypatch)
    two, _ = _placed(2)
    four, _ = _placed(4)
    (cols2, rows2, nnz2), (cols4, rows4, nnz4) = sizes
    assert len(four.table) > 1.8 * len(two.table) - 100  # the graph did grow
    assert cols4 <= cols2 + 100 and rows4 <= rows2 + 100 and nnz4 <= nnz2 + 200, sizes
    assert four.solution is not None
    assert four.solution.status.startswith("optimal (the LP relaxation is integral; "), (
        four.solution.status
    )


@pytest.mark.parametrize("plan", [None, GPT_PLAN], ids=["empty plan", "Megatron weights"])
def test_the_shared_choice_is_the_whole_graphs(monkeypatch, plan) -> None:  # type: ignore[no-untyped-def]
    shared, _ = _placed(2, plan)
    monkeypatch.setattr(program, "block_roots", lambda joint, table, activations: {})
    whole, _ = _placed(2, plan)
    assert shared.solution is not None and whole.solution is not None
    assert abs(shared.solution.objective_us - whole.solution.objective_us) <= 1e-6 * abs(
        whole.solution.objective_us
    ), (shared.solution.status, whole.solution.status)
    # the same program (free views may break an exact tie either way)
    assert shared.param_placements() == whole.param_placements()
    assert shared.input_placements() == whole.input_placements()
    mine, theirs = explain(shared), explain(whole)
    assert mine.bytes_by_dim_and_kind == theirs.bytes_by_dim_and_kind
    assert mine.collective_count == theirs.collective_count


def test_twins_are_later_blocks_namesakes_only() -> None:
    from vescale.plan.repeats import block_roots

    placed, model = _placed(3)
    joint = placed.joint
    roots = block_roots(joint, placed.table, program._derived_from_inputs(joint))
    owner = dict(zip(joint.placeholder_names, [n for n, _ in model.named_parameters()]))
    params = {n: owner[n.name] for n in placed.table if n.name in owner}
    for node, name in params.items():
        if name.startswith(("blocks.1.", "blocks.2.")):
            assert owner[roots[node].name] == "blocks.0." + name.split(".", 2)[2], name
        else:
            assert node not in roots, name
    tied = set(roots) | set(roots.values())
    outside = {"embedding", "embedding_dense_backward", "nll_loss_forward", "_log_softmax"}
    assert not {n.name for n in tied} & outside
    assert len(roots) >= 2 * (len(placed.table) - 150) // 3 - 50  # most of blocks 1 and 2
