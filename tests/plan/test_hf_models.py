"""The plan path on Hugging Face causal LMs as they are written: ``model(input_ids=ids,
labels=labels).loss``, no mask, no positions (the model builds them, with its data-dependent
mask checks and its key/value cache). Tiny random configs, nothing downloaded. On a (dp=2,
tp=2) gloo mesh the loss and one step's gradients equal one device in float64. GPT-2 by
default (a minute on a loaded CPU); Llama and Qwen2 (each a global solve of ~50 s more)
with ``pytest --full``.

The capture is a trace to model code (``torch.compiler.is_compiling()`` true, tensors fake),
so transformers skips ``find_packed_sequence_indices``' data-dependent check, which a plain
``make_fx`` trace cannot evaluate; constants it makes from data (the empty cache) are rebuilt
as ops on no input."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import vescale
from tests.plan.gpt_cases import ALPHA_BETA, BATCH, gpt_mesh
from tests.plan.test_llama_plan import PLAN as LLAMA_PLAN
from vescale import Replicate, Shard
from vescale.plan.capture import capture_joint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

TP0, TP1 = {"tp": Shard(0)}, {"tp": Shard(1)}
GPT2_PLAN = {  # Conv1D weights are (in, out)
    "*.attn.c_attn.weight": TP1,
    "*.attn.c_proj.weight": TP0,
    "*.mlp.c_fc.weight": TP1,
    "*.mlp.c_proj.weight": TP0,
    "*.wte.weight": (Replicate(), Replicate()),
    "*.wpe.weight": (Replicate(), Replicate()),
}


def _llama() -> nn.Module:
    """No cache (as in training): the mask code reaches ``find_packed_sequence_indices``."""
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def _qwen2() -> nn.Module:
    """The config's default cache: an empty key/value tensor constant per layer."""
    cfg = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.Qwen2ForCausalLM(cfg)


def _gpt2() -> nn.Module:
    """No cache: ``find_packed_sequence_indices`` too."""
    cfg = transformers.GPT2Config(
        vocab_size=256, n_embd=32, n_layer=1, n_head=4, n_positions=64, use_cache=False
    )
    return transformers.GPT2LMHeadModel(cfg)


MODELS: dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]] = {
    "llama": (_llama, LLAMA_PLAN),
    "qwen2": (_qwen2, LLAMA_PLAN),
    "gpt2": (_gpt2, GPT2_PLAN),
}


class LabelsOnly(nn.Module):
    """The causal-LM loss exactly as a training loop asks for it."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lm = MODELS[kind][0]().double()

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=labels).loss


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, vescale.DTensor) else t


def _check_labels_only_matches_one_device(kind: str) -> None:
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(3))
    ref = LabelsOnly(kind)
    ref_loss = ref(ids, ids)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    model = vescale.parallelize(
        LabelsOnly(kind),
        gpt_mesh(),
        MODELS[kind][1],
        inputs=[BATCH, BATCH],
        example_inputs=(ids, ids),
        alpha_beta=ALPHA_BETA,
        compile=False,
    )
    loss = model(ids, ids)
    loss.backward()
    torch.testing.assert_close(_full(loss), ref_loss.detach(), atol=1e-10, rtol=0)
    grads = {n.removeprefix("module."): _full(p.grad) for n, p in model.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-10, rtol=0, msg=name)
    placed = model.program.param_placements()
    sharded = next(n for n in placed if n.endswith(("q_proj.weight", "c_attn.weight")))
    assert Shard(0) in placed[sharded] or Shard(1) in placed[sharded], placed[sharded]


def test_gpt2_labels_only_equals_one_device(pool4):
    pool4.run(_check_labels_only_matches_one_device, "gpt2", timeout_s=900)


@pytest.mark.full
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_llama_qwen2_labels_only_equal_one_device(pool4, kind):
    pool4.run(_check_labels_only_matches_one_device, kind, timeout_s=900)


class _SeesTrace(nn.Module):
    """Records what model code sees while it is captured."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.seen: list[tuple[bool, bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        made = torch.arange(4.0)
        self.seen.append(
            (
                torch.compiler.is_compiling(),
                torch.compiler.is_exporting(),
                isinstance(made, torch._subclasses.FakeTensor),
            )
        )
        if not torch.compiler.is_compiling() and bool((made > 0).all()):  # eager-only check
            made = made + 1
        empty, two = torch.tensor([]), torch.tensor(2.0)  # constants made from data
        return (torch.cat([empty, x * self.w * made]) * two).sum()


def test_capture_is_a_trace_to_model_code():
    model = _SeesTrace()
    joint = capture_joint(model, (torch.ones(4),))
    assert model.seen == [(True, True, True)]
    assert not torch.compiler.is_compiling() and not torch.compiler.is_exporting()
    assert not [n for n in joint.gm.graph.nodes if n.op == "get_attr"]
    x = torch.randn(4)
    out, grad = joint.gm(model.w.detach(), x)
    w = model.w.detach().requires_grad_()
    expected = (x * w * torch.arange(4.0) * 2).sum()
    expected.backward()
    torch.testing.assert_close(out, expected.detach())
    torch.testing.assert_close(grad, w.grad)


class _DataConstant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w * torch.tensor([1.0, 3.0])).sum()


def test_constant_from_varied_data_is_refused_clearly():
    with pytest.raises(
        ValueError, match=r"float32 tensor constant of shape \[2\].*register_buffer"
    ):
        capture_joint(_DataConstant(), (torch.ones(2),))
