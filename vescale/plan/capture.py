"""Capture a plain model's joint graph (forward and backward) on global fake tensors.

The capture is a trace the way ``torch.export`` (non-strict) traces: ``make_fx`` in fake mode
(every tensor the model creates is a ``FakeTensor``, nothing is computed) with the compiling
and exporting flags set, so model code that asks ``torch.compiler.is_compiling()``,
``torch.compiler.is_exporting()`` or whether a tensor is fake (as Hugging Face models do
before data-dependent mask checks) takes its traceable branch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from vescale._torch_compat import FakeTensorMode, export_tracing_state
from vescale.fx.collectives import user_source

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

    with export_tracing_state():
        gm = make_fx(joint, tracing_mode="fake", record_stack_traces=True)(
            *fake_params, *fake_buffers, *fake_args
        )
    _rebuild_constants(gm, fake)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return JointGraph(
        gm,
        [n for n, _ in params],
        [n for n, _ in buffers],
        len(example_args),
        grad_of,
        placeholders,
    )


def _rebuild_constants(gm: torch.fx.GraphModule, fake: FakeTensorMode) -> None:
    """Each tensor constant the model made from data (``torch.tensor(...)``: a ``get_attr``)
    becomes the ``aten.full`` that recreates it, an op on no input (computed replicated on
    every rank). Only empty or single-valued constants can be rebuilt (e.g. the empty
    key/value cache Hugging Face models start from); any other raises a ``ValueError``
    naming its shape and source line."""
    for node in list(gm.graph.nodes):
        name = str(node.target)
        t = getattr(gm, name) if node.op == "get_attr" else None
        if not isinstance(t, torch.Tensor):
            continue
        flat = t.detach().reshape(-1)
        if flat.numel() and not bool((flat == flat[0]).all()):
            where = next((s for u in node.users if (s := user_source(u))), "")
            raise ValueError(
                f"vescale.parallelize: the model makes a {t.dtype} tensor constant of shape "
                f"{list(t.shape)} from data{f' ({where})' if where else ''}; the capture "
                "rebuilds only empty or single-valued constants: register it as a buffer "
                "(module.register_buffer) or compute it with torch ops"
            )
        value = flat[0].item() if flat.numel() else 0
        with gm.graph.inserting_before(node):
            full = gm.graph.call_function(
                torch.ops.aten.full.default,
                (list(t.shape), value),
                {"dtype": t.dtype, "device": t.device},
            )
        with fake:
            full.meta["val"] = torch.full(tuple(t.shape), value, dtype=t.dtype, device=t.device)
        full.meta["stack_trace"] = next(
            (u.meta["stack_trace"] for u in node.users if u.meta.get("stack_trace")), None
        )
        node.replace_all_uses_with(full)
        gm.graph.erase_node(node)
        delattr(gm, name)
    gm.recompile()
