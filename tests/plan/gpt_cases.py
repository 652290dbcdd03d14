"""Shared pieces of the plan-path tests on the demo GPT (run inside pool workers)."""

from __future__ import annotations

import functools
from typing import Any

import torch

import vescale
from vescale import Replicate, Shard
from vescale.plan import AlphaBeta

# Only the weights of the attention and MLP linears, the embeddings and the head.
TP = {"tp": Shard(0)}
GPT_PLAN: dict[str, Any] = {
    "blocks.*.attn.[qkv].weight": TP,
    "blocks.*.mlp.fc.weight": TP,
    "blocks.*.attn.proj.weight": {"tp": Shard(1)},
    "blocks.*.mlp.proj.weight": {"tp": Shard(1)},
    "tok.weight": (Replicate(), Replicate()),
    "pos.weight": (Replicate(), Replicate()),
    "head.weight": TP,
}
BATCH = {"dp": Shard(0)}
# A vocabulary large enough that the vocabulary-parallel loss beats gathering the logits
# under the cost model below (with 64 classes one 8 KiB all-gather is cheaper than three
# latency-bound all-reduces, and the solver says so). One block: a second adds graph of the
# same ops and plan patterns (capture, propagation, solve and compile time about doubled);
# tests/plan/test_gpt_plan.py runs the two-block model with ``pytest --full``.
CFG = __import__("gpt").GPTConfig(vocab=1024, layers=1)
# Fixed costs (20 us, 1 GB/s, 10 GB/s compute) so the choice does not depend on this machine's load.
ALPHA_BETA = AlphaBeta((20e-6, 20e-6), (1e-9, 1e-9), 1e-10)


@functools.cache
def gpt_mesh() -> vescale.DeviceMesh:
    return vescale.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def train(
    model: torch.nn.Module,
    batches: list[tuple[torch.Tensor, ...]],
    scales: tuple[float, ...] | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """SGD steps (step ``i`` back-propagates ``loss * scales[i]``, default 1); losses and
    final parameters (full tensors)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i, inputs in enumerate(batches):
        loss = model(*inputs)
        opt.zero_grad()
        (loss if scales is None else loss * scales[i]).backward()
        opt.step()
        losses.append(
            loss.full_tensor().item() if isinstance(loss, vescale.DTensor) else loss.item()
        )
    params = {
        k.removeprefix("module."): (
            v.full_tensor() if isinstance(v, vescale.DTensor) else v
        ).detach()
        for k, v in model.named_parameters()
    }
    return losses, params


def meta_gpt_problem(cfg: Any, batch: Any) -> tuple[Any, Any, dict[str, Any], torch.nn.Module]:
    """The GPT of ``cfg`` captured for a meta (dp=2, tp=2) mesh, its inputs' choices those of
    the plan-path ``batch`` placement: (mesh, joint graph, free input choices, model)."""
    import gpt

    from vescale.plan.batch import batch_choices
    from vescale.plan.capture import capture_joint

    mesh = vescale.DeviceMesh("meta", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    example, model = gpt.batch(cfg, 0), gpt.build(cfg)
    joint = capture_joint(model, example)
    nparams = len(list(model.parameters()))
    free = {
        ph: batch_choices("x", batch, t, mesh)
        for ph, t in zip(joint.placeholder_names[nparams:], example)
    }
    return mesh, joint, free, model
