"""The plan path on Hugging Face ``LlamaForCausalLM`` from a tiny random ``LlamaConfig``
(nothing downloaded) on a (dp=2, tp=2) gloo mesh, with a plan naming only the attention and
MLP linear weights, the embeddings, the head and the batch: 3 SGD steps equal one device,
with the global solver (the LP relaxation over the joint graph's edge pairs, integral). One decoder
layer by default (336-node joint graph); two (594 nodes) with ``pytest --full``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import vescale
from tests.plan.gpt_cases import ALPHA_BETA, gpt_mesh, train
from vescale import Replicate, Shard

transformers = pytest.importorskip("transformers")

TP0, TP1 = {"tp": Shard(0)}, {"tp": Shard(1)}
PLAN = {
    "*.self_attn.[qkv]_proj.weight": TP0,
    "*.self_attn.o_proj.weight": TP1,
    "*.mlp.gate_proj.weight": TP0,
    "*.mlp.up_proj.weight": TP0,
    "*.mlp.down_proj.weight": TP1,
    "*.embed_tokens.weight": (Replicate(), Replicate()),
    "*.lm_head.weight": TP0,
}
BATCH = {"dp": Shard(0)}


class LlamaLoss(nn.Module):
    """The causal-LM loss of a tiny Llama; the causal mask and positions are built here (a
    4-D mask skips transformers' data-dependent mask preprocessing, which cannot be traced)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        cfg = transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attn_implementation="eager",
        )
        torch.manual_seed(0)
        self.llama = transformers.LlamaForCausalLM(cfg)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None].expand(b, 1, t, t)
        pos = torch.arange(t)[None].expand(b, t)
        out = self.llama(
            input_ids=ids, labels=labels, attention_mask=causal, position_ids=pos, use_cache=False
        )
        return out.loss


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three batches of two sequences, one per dp rank: four would also let the batch split
    over both mesh dims, which offers the solver ~35% more edge pairs (2.7x its CPU time per
    rank, 15 LPs instead of 7) and exercises no other path."""
    g = torch.Generator().manual_seed(7)
    return [
        (ids, ids.clone()) for ids in (torch.randint(0, 256, (2, 8), generator=g) for _ in range(3))
    ]


def _check_llama_trains_like_one_device(layers: int) -> None:
    batches = _batches()
    ref_losses, ref_params = train(LlamaLoss(layers), batches)
    model = vescale.parallelize(
        LlamaLoss(layers),
        gpt_mesh(),
        PLAN,
        inputs=[BATCH, BATCH],
        example_inputs=batches[0],
        alpha_beta=ALPHA_BETA,
        compile=False,
    )
    losses, params = train(model, batches)
    assert all(abs(a - b) < 1e-5 for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    assert params.keys() == ref_params.keys()
    for k, v in params.items():
        torch.testing.assert_close(v, ref_params[k], atol=1e-5, rtol=0, msg=k)
    chosen = model.program.param_placements()
    assert chosen["llama.model.layers.0.self_attn.q_proj.weight"] == (Replicate(), Shard(0))
    solution = model.program.solution
    assert solution is not None and solution.status == "optimal (the LP relaxation is integral)", (
        solution
    )
    assert solution.greedy_us is not None and solution.objective_us < solution.greedy_us
    if dist.get_rank() == 0:
        print(f"\nLlama, {layers} layer(s):\n{model.explain().summary()}")


def test_plan_llama_trains_like_one_device(pool4):
    pool4.run(_check_llama_trains_like_one_device, 1, timeout_s=900)


@pytest.mark.full
def test_plan_llama_two_layers_trains_like_one_device(pool4):
    pool4.run(_check_llama_trains_like_one_device, 2, timeout_s=1800)
