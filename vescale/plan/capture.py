"""Capture a plain model's joint graph (forward and backward) on global fake tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from vescale._torch_compat import FakeTensorMode

__all__ = ["JointGraph", "capture_joint"]


@dataclass
class JointGraph:
    """``gm(*params, *buffers, *args) -> (output, *grads)``: aten ops on global shapes, one
    gradient per parameter in ``param_names`` (``None`` outputs dropped: ``grad_of`` maps output
    positions to parameter names). Placeholders come in that order: ``placeholder_names``."""

    gm: torch.fx.GraphModule
    param_names: list[str]
    buffer_names: list[str]
    num_args: int
    grad_of: dict[int, str]
    placeholder_names: list[str]


def _fake_like(fake: FakeTensorMode, t: torch.Tensor, grad: bool) -> torch.Tensor:
    with fake:
        out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype)
    return out.requires_grad_(grad)


def capture_joint(model: nn.Module, example_args: Sequence[torch.Tensor]) -> JointGraph:
    """Trace ``model(*example_args)`` and, when it returns a scalar that requires grad, the
    gradients of every trainable parameter (``torch.autograd.grad``), with ``make_fx`` on
    fake tensors of the same shapes: no memory, no DTensor, deferred models included."""
    params = [(n, p) for n, p in model.named_parameters()]
    buffers = [(n, b) for n, b in model.named_buffers()]
    names = [n for n, _ in params] + [n for n, _ in buffers]
    trainable = [n for n, p in params if p.requires_grad]
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    fake_params = [_fake_like(fake, p, p.requires_grad) for _, p in params]
    fake_buffers = [_fake_like(fake, b, False) for _, b in buffers]
    fake_args = [_fake_like(fake, a, False) for a in example_args]
    grad_of: dict[int, str] = {}

    def joint(*flat: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        state = dict(zip(names, flat[: len(names)]))
        out = torch.func.functional_call(model, state, tuple(flat[len(names) :]))
        if not (
            isinstance(out, torch.Tensor) and out.ndim == 0 and out.requires_grad and trainable
        ):
            return (out,)
        wrt = [state[n] for n in trainable]
        grads = torch.autograd.grad(out, wrt, allow_unused=True)
        kept = [(n, g) for n, g in zip(trainable, grads) if g is not None]
        grad_of.update({i + 1: n for i, (n, _) in enumerate(kept)})
        return (out, *(g for _, g in kept))

    gm = make_fx(joint, record_stack_traces=True)(*fake_params, *fake_buffers, *fake_args)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return JointGraph(
        gm,
        [n for n, _ in params],
        [n for n, _ in buffers],
        len(example_args),
        grad_of,
        placeholders,
    )
