"""examples/merged_qkv_attention.py: the fused-QKV tensor-parallel attention layer (weight
InterleavedShard(0, 3)) equals single-device attention, forward and backward, eager and
compiled, and issues exactly the collectives of plain tensor-parallel attention (separate
column-parallel q/k/v): no extra gathers."""

from __future__ import annotations

import merged_qkv_attention as mqa
import pytest
import torch

from tests.dtensor.reference import mesh_of
from tests.harness.collectives import count_collectives
from vescale.backend import PASSES_OFF

TOL = 1e-10  # float64


def _check(world):
    mesh = mesh_of((world,))
    x, weights = mqa.inputs()
    ref_out, ref_dx, ref_grads = mqa.reference(mqa.build(), x, weights)
    compiled = torch.compile(
        mqa.forward, backend="vescale", options={"codegen": "fx", **PASSES_OFF}
    )
    counts = {}
    for name, make, plan in (
        ("merged", mqa.build, mqa.MERGED_PLAN),
        ("separate", lambda: mqa.separate_copy(mqa.build()), mqa.SEPARATE_PLAN),
    ):
        for mode, fwd in (("eager", mqa.forward), ("compiled", compiled)):
            model = mqa.parallelize(make(), mesh, plan)
            if mode == "compiled":  # trace once; count a warm call
                dx, dw = mqa.shard_inputs(model, x, weights)
                mqa.step(fwd, model, dx, dw)
                model.zero_grad(set_to_none=True)
            dx, dw = mqa.shard_inputs(model, x, weights)
            with count_collectives() as counts[name, mode]:
                out = mqa.step(fwd, model, dx, dw)
            out, grad_x, grads = mqa.results(model, out, dx)
            case = (name, mode)
            assert torch.allclose(out, ref_out, atol=TOL, rtol=0), case
            assert torch.allclose(grad_x, ref_dx, atol=TOL, rtol=0), case
            assert grads.keys() == ref_grads.keys(), case
            for k in ref_grads:
                assert torch.allclose(grads[k], ref_grads[k], atol=TOL, rtol=0), (case, k)
        if name == "merged":
            for p in ("qkv.weight", "qkv.bias"):
                assert model.get_parameter(p).grad.placements == tuple(mqa.MERGED_PLAN["qkv.*"])
    # plain TP attention: the output projection's all-reduce, nothing else (the input
    # gradient stays Partial: full_tensor() reduces it, outside the counted step)
    plain = {"all_reduce": 1}
    assert {k: dict(v) for k, v in counts.items()} == dict.fromkeys(counts, plain), counts


def test_merged_qkv_matches_single_device_with_plain_tp_collectives(pool4):
    """4 ranks: one head per rank, each of Q, K and V split in 4 (the interleaved layout's
    every path; 2 ranks, two heads each, run the same code: ``pytest --full``)."""
    pool4.run(_check, 4)


@pytest.mark.full
def test_merged_qkv_on_two_ranks(pool2):
    pool2.run(_check, 2)
