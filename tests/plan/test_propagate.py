"""Propagation reuses a repeated layer's strategies (``propagate._signature``): on a
two-block GPT with free parameters and a free batch (a meta (2, 2) mesh), every node's
strategies equal those asked of the registry node by node, and the reuse is taken."""

from __future__ import annotations

import pytest
import torch

import vescale
import vescale.plan.propagate as prop_module
from vescale.plan import Batch
from vescale.plan.batch import batch_choices
from vescale.plan.capture import capture_joint


def test_reused_strategies_equal_the_registry_node_by_node(monkeypatch: pytest.MonkeyPatch):
    import gpt

    cfg = gpt.GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2)
    mesh = vescale.DeviceMesh("meta", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    model, example = gpt.build(cfg), gpt.batch(cfg, 0)
    joint = capture_joint(model, example)
    nparams = len(list(model.parameters()))
    fixed = {
        ph: batch_choices("x", Batch("dp", "tp"), t, mesh)
        for ph, t in zip(joint.placeholder_names[nparams:], example)
    }
    asked = []
    node_strategies = prop_module._node_strategies
    monkeypatch.setattr(
        prop_module, "_node_strategies", lambda n, *a: asked.append(n) or node_strategies(n, *a)
    )
    reused = prop_module.propagate(joint.gm, mesh, fixed)
    ops = [n for n, ns in reused.items() if n.op == "call_function" and ns.source != "constant"]
    n_asked = len(asked)
    monkeypatch.setattr(prop_module, "_signature", lambda *a: None)
    asked.clear()
    fresh = prop_module.propagate(joint.gm, mesh, fixed)
    assert fresh.keys() == reused.keys()
    for node, ns in fresh.items():
        got = reused[node]
        assert (got.inputs, got.outputs, got.input_placements, got.source, got.internal) == (
            ns.inputs,
            ns.outputs,
            ns.input_placements,
            ns.source,
            ns.internal,
        ), node.name
    assert len(asked) == len(ops)  # without reuse every op is asked
    assert n_asked < 0.6 * len(ops), (n_asked, len(ops))  # the second block's ops reused


class _Heads(torch.nn.Module):
    """A projection's output viewed as heads: ``(8, 32, 32) -> (8, 32, 2, 16)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 32, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w.view(8, 32, -1, 16) * x).sum()


def test_a_view_keeps_the_strategies_its_rule_accepts():
    """The view rule raises for a layout the view cannot take (dim 2, 32 rows, split 4 ways
    into heads of 16: ``(S(2), S(2))``); the node keeps every other layout's strategies
    (asked one at a time) instead of falling back to replicated: the batch split over both
    mesh dims among them."""
    from vescale.plan.capture import capture_joint

    mesh = vescale.DeviceMesh("meta", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    joint = capture_joint(_Heads(), [torch.randn(8, 32, 2, 16)])
    rep = (vescale.Replicate(), vescale.Replicate())
    table = prop_module.propagate(joint.gm, mesh, {joint.placeholder_names[1]: rep})
    (view,) = [  # the forward's view of the weight
        n
        for n in table
        if n.target is torch.ops.aten.view.default and n.args[0].op == "placeholder"
    ]
    ns = table[view]
    assert ns.source == "registry", ns.source
    layouts = {ins[0] for ins in ns.input_placements}
    s0, s2 = vescale.Shard(0), vescale.Shard(2)
    assert {(s0, s0), rep} <= layouts and (s2, s2) not in layouts, layouts
