"""Compiled DTensor outputs that are views of the compiled function's inputs.

AOTAutograd returns an output that aliases an input by rebuilding it from that input at
run time (``input.as_strided(...)``, see ``vescale/dtensor/ops/as_strided.py``), so the
output's autograd history is ``AsStridedBackward``, whose formula scatters the gradient
into a zero buffer the size of the input's *storage*: a flat tensor no DTensor layout
describes. :func:`route_input_views` passes each such DTensor output that requires grad
through :class:`InputView`, an identity view with its own backward: AOTAutograd then keeps
the compiled forward's output (still a view of the input's shard) and its gradient flows
through the compiled backward like any other.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["InputView", "route_input_views"]


class InputView(torch.autograd.Function):
    """``x.view_as(x)``, gradient passed through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def _local_storage(node: torch.fx.Node) -> StorageWeakRef | None:
    val = node.meta.get("example_value")
    if not isinstance(val, DTensor):
        return None
    return StorageWeakRef(val._local_tensor.untyped_storage())


def route_input_views(gm: torch.fx.GraphModule) -> int:
    """Route DTensor outputs of ``gm`` (a Dynamo graph) that require grad and share an input's
    local storage through :class:`InputView`, in place; returns how many were routed."""
    inputs = {s for n in gm.graph.nodes if n.op == "placeholder" if (s := _local_storage(n))}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    routed: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in output.all_input_nodes:
        val = node.meta.get("example_value")
        if node in routed or not (isinstance(val, DTensor) and val.requires_grad):
            continue
        if _local_storage(node) in inputs:
            with gm.graph.inserting_before(output):
                routed[node] = gm.graph.call_function(InputView.apply, (node,))
            routed[node].meta.update(node.meta)
    if routed:
        output.args = torch.fx.node.map_arg(output.args, lambda n: routed.get(n, n))
        gm.recompile()
    return len(routed)
