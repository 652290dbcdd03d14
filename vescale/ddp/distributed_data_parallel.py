"""``DistributedDataParallel``: every DTensor parameter's gradient in the parameter's placements.

A parameter replicated over the data-parallel mesh dim gets a ``Partial`` gradient from
backward (each dp rank saw its own part of the batch); the wrapper reduces it to the
parameter's placements (``Partial -> Replicate``: all-reduce; gradients already in the
parameter's placements, e.g. ZeRO-style sharded parameters gathered in the forward, are left
as they are).

* Eagerly: :class:`vescale.ddp.reducer.Reducer` hooks, bucketed (``bucket_cap_mb``) and issued
  asynchronously as gradients become ready, waited at the end of backward, like torch DDP.
  A gradient reduced over several mesh dims takes one all-reduce over their flattened group,
  made here, at construction, for each parameter's replicated mesh dims.
* Under ``torch.compile``: every DTensor parameter goes through an identity redistribution
  (``p -> p.placements``) in the forward, whose backward reduces its gradient; so the
  reductions are inside the traced backward graph, where the compiler's passes bucket and
  schedule them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale.ddp.reducer import DEFAULT_BUCKET_CAP_MB, Reducer
from vescale.dtensor.api import redistribute_dtensor
from vescale.dtensor.redistribute import flattened_mesh

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` (DTensor parameters) so that gradients arrive in parameter placements.

    Plain-tensor parameters are left alone. ``module`` stays reachable as ``.module``; its
    parameters are this wrapper's parameters (``ddp.parameters()`` feeds the optimizer).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        super().__init__()
        self.module = module
        self._synced = [
            name
            for name, p in module.named_parameters()
            if isinstance(p, _UpstreamDTensor) and p.requires_grad
        ]
        params: list[Any] = [module.get_parameter(n) for n in self._synced]
        for p in params:
            flattened_mesh(
                p.device_mesh, [i for i, q in enumerate(p.placements) if q.is_replicate()]
            )
        self._reducer = Reducer(params, bucket_cap_mb)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return self.module(*args, **kwargs)  # the reducer's hooks reduce the gradients
        synced = {name: grad_sync(self.module.get_parameter(name)) for name in self._synced}
        return torch.func.functional_call(self.module, synced, args, kwargs, strict=False)


@torch._dynamo.allow_in_graph  # one graph call: AOTAutograd traces its backward collectives
def grad_sync(param: _UpstreamDTensor) -> _UpstreamDTensor:
    """``param`` itself in the forward; its gradient redistributed to ``param.placements``."""
    return redistribute_dtensor(param, placements=param.placements)
