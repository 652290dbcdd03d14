"""``DistributedDataParallel``: every DTensor parameter's gradient in the parameter's placements.

A parameter replicated over the data-parallel mesh dim gets a ``Partial`` gradient from
backward (each dp rank saw its own part of the batch). The wrapper routes every DTensor
parameter through an identity redistribution (``p`` -> ``p.placements``) in the forward;
its backward brings the gradient to the parameter's placements: ``Partial -> Replicate`` is an
all-reduce, ``Partial -> Shard`` (ZeRO-style sharded parameters) a reduce-scatter. The
reduction is part of the autograd graph, so eager runs it as soon as the gradient exists
(async, overlapping the rest of backward) and ``torch.compile`` traces it into the backward
graph, where the compiler's passes bucket and schedule it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale.dtensor.api import redistribute_dtensor

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` (DTensor parameters) so that gradients arrive in parameter placements.

    Plain-tensor parameters are left alone. ``module`` stays reachable as ``.module``; its
    parameters are this wrapper's parameters (``ddp.parameters()`` feeds the optimizer).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._synced = [
            name
            for name, p in module.named_parameters()
            if isinstance(p, _UpstreamDTensor) and p.requires_grad
        ]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        synced = {name: grad_sync(self.module.get_parameter(name)) for name in self._synced}
        return torch.func.functional_call(self.module, synced, args, kwargs, strict=False)


@torch._dynamo.allow_in_graph  # one graph call: AOTAutograd traces its backward collectives
def grad_sync(param: _UpstreamDTensor) -> _UpstreamDTensor:
    """``param`` itself in the forward; its gradient redistributed to ``param.placements``."""
    return redistribute_dtensor(param, placements=param.placements)
