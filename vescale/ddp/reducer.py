"""Eager gradient reduction for ``DistributedDataParallel``: bucketed, overlapped with backward.

Each DTensor parameter gets a post-accumulate-grad hook. When its gradient is accumulated,
the mesh dims where the gradient is ``Partial("sum" | "avg")`` and the parameter is
``Replicate`` are the dims to all-reduce. Gradients with the same dims, reduce op, mesh and
dtype fill a bucket in the order they become ready; a bucket over ``bucket_cap_mb`` is
flattened into one buffer and all-reduced asynchronously while backward goes on: one
functional all-reduce over the flattened group of its mesh dims (one per mesh dim where the
mesh cannot be flattened, see :func:`vescale.dtensor.redistribute.flattened_mesh`). At the
end of backward (an autograd engine callback) the remaining buckets are issued, every bucket
is waited, and each parameter's ``.grad`` becomes a DTensor in the parameter's placements. Any other gradient layout is redistributed on its
own to the parameter's placements.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale.dtensor.api import from_local, redistribute_dtensor, wait_local
from vescale.dtensor.redistribute import flattened_mesh

__all__ = ["DEFAULT_BUCKET_CAP_MB", "Reducer"]

# torch DDP's bucket size; also the default of the compiled ``bucket`` pass (BackendOptions).
DEFAULT_BUCKET_CAP_MB = 25.0


@dataclass
class _Bucket:
    mesh: Any
    dims: tuple[int, ...]
    reduce_op: str
    params: list[Any] = field(default_factory=list)  # DTensor parameters
    nbytes: int = 0
    flat: torch.Tensor | None = None  # the in-flight result once issued


class Reducer:
    """Bucketed asynchronous reduction of the gradients of ``params`` (see module docstring)."""

    def __init__(self, params: list[Any], bucket_cap_mb: float) -> None:
        self.cap_bytes = int(bucket_cap_mb * 2**20)
        self.open: dict[tuple[Any, ...], _Bucket] = {}
        self.issued: list[_Bucket] = []
        self.armed = False
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in params]

    def _ready(self, p: Any) -> None:
        grad = p.grad
        if not isinstance(grad, _UpstreamDTensor):
            return
        if not self.armed:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.armed = True
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
            if tuple(grad.placements) != tuple(p.placements):
                p.grad = redistribute_dtensor(grad, placements=p.placements, async_op=False)
            return
        # the mesh by value: a cached sharding can hand a gradient an equal, other mesh object
        key = (grad.device_mesh, dims, ops.pop(), grad.dtype)
        bucket = self.open.setdefault(key, _Bucket(grad.device_mesh, dims, key[2]))
        bucket.params.append(p)
        bucket.nbytes += grad._local_tensor.numel() * grad._local_tensor.element_size()
        if bucket.nbytes >= self.cap_bytes:
            self._issue(self.open.pop(key))

    def _issue(self, bucket: _Bucket) -> None:
        locals_ = [wait_local(p.grad._local_tensor).reshape(-1) for p in bucket.params]  # type: ignore[union-attr]
        flat = torch.cat(locals_)
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
                assert isinstance(grad, _UpstreamDTensor)
                local = grad._local_tensor
                piece = flat[offset : offset + local.numel()].view(local.shape)
                offset += local.numel()
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
