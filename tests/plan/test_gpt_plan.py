"""The plan path on the demo GPT (examples/gpt.py without ``parallelize``) on a (dp=2, tp=2)
gloo mesh, with a plan naming only the linear weights, the embeddings, the head and the batch:
training equals one device, the chosen placements equal the hand-written model's (compiled:
the planned weights do; the solver, pricing buckets and FLOPs, may shard a bias the expert
replicates), and a step issues no more collectives and bytes than the hand-written model (DDP). The eager
claims share one placed model (placing the GPT is most of their cost). One block by default
(``CFG``); two (a block feeding a block) with ``pytest --full``."""

from __future__ import annotations

import dataclasses
import fnmatch

import pytest
import torch

import vescale
from tests.harness.collectives import count_collectives
from tests.plan.gpt_cases import ALPHA_BETA, BATCH, CFG, GPT_PLAN, gpt_mesh, train
from vescale.plan import PlannedModule


def _trained_like_one_device(compile: bool, layers: int = CFG.layers) -> PlannedModule:
    """The placed GPT (``CFG`` with ``layers`` blocks) after 3 SGD steps, checked against
    one device."""
    import gpt

    torch._dynamo.reset()
    cfg = dataclasses.replace(CFG, layers=layers)
    batches = [gpt.batch(cfg, i) for i in range(3)]
    ref_losses, ref_params = train(gpt.build(cfg), batches)
    # eager: a deferred model (parameters materialized shard-only); compiled: an eager one
    built = gpt.build(cfg) if compile else gpt.build_deferred(cfg)
    model = vescale.parallelize(
        built,
        gpt_mesh(),
        GPT_PLAN,
        inputs=[BATCH, BATCH],
        example_inputs=batches[0],
        alpha_beta=ALPHA_BETA,
        compile=compile,
        options={"codegen": "fx", "strict": True},
    )
    losses, params = train(model, batches)
    initial = dict(gpt.build(cfg).named_parameters())
    assert not torch.equal(ref_params["head.weight"], initial["head.weight"])  # it trains
    assert all(abs(a - b) < 1e-5 for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    assert params.keys() == ref_params.keys()
    for k, v in params.items():
        torch.testing.assert_close(v, ref_params[k], atol=1e-5, rtol=0, msg=k)
    # the cross-check of the two paths: eager, every parameter placed as gpt.parallelize
    # places it; compiled, the solver prices buckets and computes (the bias of a row-parallel
    # projection may go sharded), so it is held to the outcome: communication no greater
    hand = gpt.parallelize(gpt.build(cfg), gpt_mesh())
    chosen = model.program.param_placements()
    for name, p in hand.named_parameters():
        if not compile or any(fnmatch.fnmatchcase(name, pat) for pat in GPT_PLAN):
            assert tuple(p.placements) == chosen[name], (name, p.placements, chosen[name])
    if compile and layers == CFG.layers:
        _check_no_more_communication_than_hand_written(model)
    state = model.state_dict()  # DTensors in the chosen placements (what DCP saves)
    head = state["module.head.weight"]
    assert isinstance(head, vescale.DTensor) and tuple(head.placements) == chosen["head.weight"]
    return model


def _check_trains_like_one_device(compile: bool, layers: int = CFG.layers) -> None:
    _trained_like_one_device(compile, layers)


def _check_eager() -> tuple[dict, dict]:
    """The eager claims on one placed model: it trains like one device (raises if not), then
    one step of it communicates no more than the hand-written model (the counts)."""
    return _check_no_more_communication_than_hand_written(_trained_like_one_device(False))


@pytest.fixture(scope="module")
def eager_plan(pool4):
    """The eager placed GPT's checks, run once for both eager tests (either failing fails both)."""
    return pool4.run(_check_eager, timeout_s=600)


def test_plan_gpt_trains_like_one_device_eager(eager_plan):
    assert len(eager_plan) == 4  # every rank trained it like one device


def test_plan_gpt_trains_like_one_device_compiled(pool4):
    pool4.run(_check_trains_like_one_device, True, timeout_s=600)


@pytest.mark.full
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_plan_gpt_two_blocks_trains_like_one_device(pool4, compile):
    pool4.run(_check_trains_like_one_device, compile, 2, timeout_s=1200)


def _check_no_more_communication_than_hand_written(model: PlannedModule) -> tuple[dict, dict]:
    """One step of the placed ``model`` (any parameter values: the counts depend on the
    placements) against the hand-written DDP model: no more collectives, no more bytes."""
    import gpt

    from vescale.ddp import DistributedDataParallel

    mesh = gpt_mesh()
    ids, tgt = gpt.batch(CFG, 0)
    hand = DistributedDataParallel(gpt.parallelize(gpt.build(CFG), mesh), bucket_cap_mb=0)
    inputs = gpt.shard_batch(mesh, ids, tgt)
    with count_collectives() as hand_counts:  # one step, and the loss value for the log
        hand(*inputs).backward()
        hand.module.zero_grad()
    loss = hand(*inputs)
    with count_collectives() as hand_log:
        loss.full_tensor()
    model.zero_grad(set_to_none=True)
    with count_collectives() as plan_counts:
        out = model(ids, tgt)
        out.backward()
        out.full_tensor()
    hand_total = hand_counts + hand_log
    hand_bytes = hand_counts.bytes + hand_log.bytes
    assert sum(plan_counts.values()) <= sum(hand_total.values()), (plan_counts, hand_total)
    assert sum(plan_counts.bytes.values()) <= sum(hand_bytes.values()), (
        plan_counts.bytes,
        hand_bytes,
    )
    return dict(plan_counts), dict(hand_total)


def test_plan_gpt_no_more_communication_than_hand_written(eager_plan):
    for plan_counts, hand_counts in eager_plan:
        assert sum(plan_counts.values()) <= sum(hand_counts.values()), (plan_counts, hand_counts)
