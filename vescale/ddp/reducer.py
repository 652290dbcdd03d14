"""Eager gradient reduction for ``DistributedDataParallel``: bucketed, overlapped with backward.

Each parameter gets a post-accumulate-grad hook. When its gradient is accumulated, it is
assigned what to all-reduce over:

* a DTensor gradient: the mesh dims where the gradient is ``Partial("sum" | "avg")`` and the
  parameter is ``Replicate``, with that reduce op;
* a plain-tensor gradient (a plain parameter, given a data-parallel mesh): ``avg`` over that
  1-D mesh, as torch DDP does.

Gradients with the same mesh, dims, reduce op and dtype fill a bucket in the order they
become ready, under the one bucket rule (:mod:`vescale.ddp.bucketing`); a closed bucket is
flattened into one buffer and all-reduced asynchronously while backward goes on: one
functional all-reduce over the flattened group of its mesh dims (one per mesh dim where the
mesh cannot be flattened, see :func:`vescale.dtensor.flat_groups.flattened_mesh`). At the
end of backward (an autograd engine callback) the remaining buckets are issued, every bucket
is waited, and each DTensor parameter's ``.grad`` becomes a DTensor in the parameter's
placements (a plain one's a view of the reduced buffer). Any other DTensor gradient layout is
redistributed on its own to the parameter's placements.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale.ddp.bucketing import DEFAULT_BUCKET_CAP_MB, cap_bytes, joins
from vescale.dtensor.dtensor import from_local, redistribute_dtensor
from vescale.dtensor.flat_groups import flattened_mesh
from vescale.dtensor.inflight import wait_local

__all__ = ["DEFAULT_BUCKET_CAP_MB", "Reducer"]


@dataclass
class _Bucket:
    mesh: Any
    dims: tuple[int, ...]
    reduce_op: str
    params: list[Any] = field(default_factory=list)
    nbytes: int = 0
    flat: torch.Tensor | None = None  # the in-flight result once issued


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad._local_tensor if isinstance(grad, _UpstreamDTensor) else grad


class Reducer:
    """Bucketed asynchronous reduction of the gradients of ``params`` (see module docstring);
    plain-tensor gradients are averaged over the 1-D ``dp_mesh``."""

    def __init__(self, params: list[Any], bucket_cap_mb: float, dp_mesh: Any = None) -> None:
        self.cap_bytes = cap_bytes(bucket_cap_mb)
        self.dp_mesh = dp_mesh
        self.open: dict[tuple[Any, ...], _Bucket] = {}
        self.issued: list[_Bucket] = []
        self.armed = False
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in params]

    def _reduction(self, p: Any) -> tuple[Any, tuple[int, ...], str] | None:
        """``(mesh, dims, reduce op)`` to all-reduce ``p.grad`` over; ``None``: redistribute it
        on its own (or leave it, when already in the parameter's placements)."""
        grad = p.grad
        if not isinstance(grad, _UpstreamDTensor):
            return (self.dp_mesh, (0,), "avg") if self.dp_mesh is not None else None
        dims = tuple(
            i
            for i, (g, w) in enumerate(zip(grad.placements, p.placements))
            if g.is_partial() and w.is_replicate()
        )
        ops = {grad.placements[i].reduce_op for i in dims}  # type: ignore[attr-defined]
        rest_ok = all(
            g == w for i, (g, w) in enumerate(zip(grad.placements, p.placements)) if i not in dims
        )
        if not dims or len(ops) != 1 or not ops <= {"sum", "avg"} or not rest_ok:
            return None
        # the mesh by value: a cached sharding can hand a gradient an equal, other mesh object
        return grad.device_mesh, dims, ops.pop()

    def _ready(self, p: Any) -> None:
        grad = p.grad
        if grad is None:
            return
        if not self.armed:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.armed = True
        reduction = self._reduction(p)
        if reduction is None:
            if isinstance(grad, _UpstreamDTensor) and tuple(grad.placements) != tuple(p.placements):
                p.grad = redistribute_dtensor(grad, placements=p.placements, async_op=False)
            return
        key = (*reduction, grad.dtype)
        size = _local(grad).numel() * grad.element_size()
        bucket = self.open.get(key)
        if bucket is not None and not joins(bucket.nbytes, size, self.cap_bytes):
            self._issue(self.open.pop(key))
            bucket = None
        if bucket is None:
            bucket = self.open[key] = _Bucket(*reduction)
        bucket.params.append(p)
        bucket.nbytes += size
        if bucket.nbytes >= self.cap_bytes:  # full: nothing more joins it
            self._issue(self.open.pop(key))

    def _issue(self, bucket: _Bucket) -> None:
        flat = torch.cat([wait_local(_local(p.grad)).reshape(-1) for p in bucket.params])
        merged = flattened_mesh(bucket.mesh, bucket.dims)
        groups = [merged] if merged is not None else [(bucket.mesh, d) for d in bucket.dims]
        for group in groups:
            flat = funcol.all_reduce(flat, bucket.reduce_op, group)
        bucket.flat = flat
        self.issued.append(bucket)

    def _finish(self) -> None:
        for bucket in list(self.open.values()):
            self._issue(bucket)
        self.open.clear()
        for bucket in self.issued:
            flat = wait_local(bucket.flat)  # type: ignore[arg-type]
            offset = 0
            for p in bucket.params:
                grad = p.grad
                local = _local(grad)
                piece = flat[offset : offset + local.numel()].view(local.shape)
                offset += local.numel()
                if not isinstance(grad, _UpstreamDTensor):
                    p.grad = piece
                    continue
                p.grad = from_local(
                    piece,
                    bucket.mesh,
                    p.placements,
                    run_check=False,
                    shape=grad.shape,
                    stride=grad.stride(),
                )
        self.issued.clear()
        self.armed = False
