"""``DistributedDataParallel``: every parameter's gradient reduced over data parallelism.

A DTensor parameter replicated over the data-parallel mesh dim gets a ``Partial`` gradient
from backward (each dp rank saw its own part of the batch); the wrapper reduces it to the
parameter's placements (``Partial -> Replicate``: all-reduce; gradients already in the
parameter's placements, e.g. ZeRO-style sharded parameters gathered in the forward, are left
as they are). A plain-tensor parameter's gradient is averaged over ``dp_mesh`` (a 1-D mesh),
as torch DDP does; without ``dp_mesh`` plain parameters are an error at construction (there
is no group to reduce them over), and so is a module mixing DTensor and plain parameters
(a forward mixing them fails), unless ``dp_mesh`` says what the plain ones are.

* Eagerly: :class:`vescale.ddp.reducer.Reducer` hooks, bucketed (``bucket_cap_mb``) and issued
  asynchronously as gradients become ready, waited at the end of backward, like torch DDP.
  A gradient reduced over several mesh dims takes one all-reduce over their flattened group,
  made here, at construction, for each parameter's replicated mesh dims.
* Under ``torch.compile``: every parameter goes through an identity in the forward whose
  backward reduces its gradient as above; so the reductions are inside the traced backward
  graph, where the compiler's passes bucket and schedule them. The reductions are tagged with
  ``bucket_cap_mb`` when given, which the ``bucket`` pass applies to them (one bucket policy
  for eager and compiled: :mod:`vescale.ddp.bucketing`); by default (``None``) eager uses
  :data:`~vescale.ddp.bucketing.DEFAULT_BUCKET_CAP_MB` and compiled the backend's
  ``bucket_cap_mb`` option (same default).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._node_meta import set_bucket_cap_mb
from vescale._torch_compat import get_proxy_mode
from vescale.ddp.bucketing import DEFAULT_BUCKET_CAP_MB
from vescale.ddp.reducer import Reducer
from vescale.dtensor.dtensor import redistribute_dtensor
from vescale.dtensor.flat_groups import flattened_mesh
from vescale.dtensor.inflight import wait_local

__all__ = ["DistributedDataParallel"]


def _names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:6]) + (
        f" (+{len(names) - 6} more)" if len(names) > 6 else ""
    )


def _check_params(module: nn.Module, dp_mesh: DeviceMesh | None) -> None:
    """The parameters fit: plain ones need ``dp_mesh`` (a 1-D mesh); see the module doc."""
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    plain = [n for n, p in params if not isinstance(p, _UpstreamDTensor)]
    dtensors = [(n, p) for n, p in params if isinstance(p, _UpstreamDTensor)]
    if dp_mesh is not None and dp_mesh.ndim != 1:
        raise ValueError(
            f"DistributedDataParallel: dp_mesh must be the 1-D data-parallel mesh, got {dp_mesh} "
            f"(pass its data-parallel dim, e.g. mesh['dp'])"
        )
    if not plain or dp_mesh is not None:
        return
    if not dtensors:
        raise ValueError(
            f"DistributedDataParallel: parameters {_names(plain)} are plain tensors, whose "
            "gradients it can only reduce over a data-parallel group it is given: pass "
            "dp_mesh=<1-D data-parallel DeviceMesh> (their gradients are then averaged over "
            "it, as torch DDP does), or make them DTensors (vescale.distribute_tensor, "
            "vescale.materialize_module)"
        )
    name, p = dtensors[0]
    raise ValueError(
        f"DistributedDataParallel: parameters {_names(plain)} are plain tensors while "
        f"{name!r} and others are DTensors ({tuple(p.placements)} on {p.device_mesh}); a forward "
        f"mixing them fails. Make them DTensors on that mesh (e.g. Replicate() on every dim, "
        f"or a '*' entry in the vescale.materialize_module plan), or, if they never meet a "
        f"DTensor, pass dp_mesh=<1-D data-parallel DeviceMesh> to average their gradients"
    )


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that every gradient arrives reduced over data parallelism: a DTensor
    parameter's in its placements, a plain parameter's averaged over ``dp_mesh`` (see the
    module doc). ``bucket_cap_mb``: bucket size in MiB, eager and compiled (``None``: 25
    eagerly, the backend's option compiled). ``module`` stays reachable as ``.module``; its
    parameters are this wrapper's parameters (``ddp.parameters()`` feeds the optimizer)."""

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float | None = None,
        *,
        dp_mesh: DeviceMesh | None = None,
    ) -> None:
        super().__init__()
        _check_params(module, dp_mesh)
        self.module = module
        self.bucket_cap_mb = bucket_cap_mb
        self.dp_mesh = dp_mesh
        self._synced = [
            name
            for name, p in module.named_parameters()
            if p.requires_grad and (isinstance(p, _UpstreamDTensor) or dp_mesh is not None)
        ]
        params: list[Any] = [module.get_parameter(n) for n in self._synced]
        for p in params:
            if isinstance(p, _UpstreamDTensor):
                replicated = [i for i, q in enumerate(p.placements) if q.is_replicate()]
                flattened_mesh(p.device_mesh, replicated)
        cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        self._reducer = Reducer(params, cap, dp_mesh)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return self.module(*args, **kwargs)  # the reducer's hooks reduce the gradients
        synced = {
            name: grad_sync(self.module.get_parameter(name), self.dp_mesh, self.bucket_cap_mb)
            for name in self._synced
        }
        return torch.func.functional_call(self.module, synced, args, kwargs, strict=False)


@torch._dynamo.allow_in_graph  # one graph call: AOTAutograd traces its backward collectives
def grad_sync(param: torch.Tensor, dp_mesh: Any, cap_mb: float | None) -> torch.Tensor:
    """``param`` itself in the forward; its gradient reduced in the backward (see module doc)."""
    return _GradSync.apply(param, dp_mesh, cap_mb)  # type: ignore[no-any-return]


class _GradSync(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, param: torch.Tensor, dp_mesh: Any, cap_mb: float | None
    ) -> torch.Tensor:
        ctx.placements = param.placements if isinstance(param, _UpstreamDTensor) else None
        ctx.dp_mesh, ctx.cap_mb = dp_mesh, cap_mb
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        out: torch.Tensor
        with _tag_collectives(ctx.cap_mb):
            if isinstance(grad, _UpstreamDTensor):
                out = redistribute_dtensor(grad, placements=ctx.placements)
            else:
                out = wait_local(funcol.all_reduce(grad, "avg", (ctx.dp_mesh, 0)))
        return out, None, None


@contextlib.contextmanager
def _tag_collectives(cap_mb: float | None) -> Iterator[None]:
    """While tracing, tag the collectives traced in the block with ``cap_mb`` (``None``: no tag)."""
    mode = get_proxy_mode()
    if cap_mb is None or mode is None:
        yield
        return
    graph = mode.tracer.graph
    last = next(iter(reversed(graph.nodes)), None)
    yield
    node = last.next if last is not None else next(iter(graph.nodes), None)
    while node is not None and node.op != "root":
        if "_c10d_functional" in str(node.target) and "wait_tensor" not in str(node.target):
            set_bucket_cap_mb(node, cap_mb)
        node = node.next
