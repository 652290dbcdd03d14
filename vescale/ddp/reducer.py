"""Eager gradient reduction for ``DistributedDataParallel``: bucketed, overlapped with backward.

Buckets are fixed at the end of the first synced backward, the same on every rank whatever
a later backward computes (the first one's reductions are agreed by one object all-gather;
its buckets are issued at its end): parameters in reverse registration order, grouped by what
their gradient is all-reduced over, then cut by the one bucket rule
(:mod:`vescale.ddp.bucketing`):

* a DTensor parameter: the mesh dims where it is ``Replicate`` (its gradient arrives
  ``Partial("sum")`` there), summed; a parameter replicated on no dim is not bucketed (its
  gradient, if not in the parameter's placements, is redistributed on its own);
* a plain parameter (a data-parallel mesh given): summed over that 1-D mesh, then divided by
  its size (the average, as torch DDP).

A post-accumulate-grad hook puts each gradient in its slot; a bucket whose slots are all
filled is flattened and all-reduced asynchronously, buckets strictly in index order, so every
rank issues the same collectives in the same order. At the end of backward (an engine
callback, armed by the first hook or by a gradient reaching the wrapper's outputs) the
remaining buckets go out with zeros in the slots of parameters that got no gradient, every
bucket is waited, and each ``.grad`` becomes the reduced slice (a DTensor in the parameter's
placements).

Each bucket's buffer ends in a few flag elements per parameter, reduced with the gradients:

* ``find_unused_parameters=False``: per parameter, ``1`` on a rank where it got no gradient
  and that rank's number in base-16 digits times the same flag. All zero in the common path;
  otherwise they name the parameter and (when one rank) the rank, identically on every rank
  of the bucket's group. The flags' host copy is checked at the next forward
  (:meth:`Reducer.check`), which raises there on every rank: no host read inside a step.
* ``find_unused_parameters=True``: per parameter, ``1`` on a rank that used it. A parameter
  with no gradient on this rank keeps ``.grad`` untouched when no rank used it, else gets the
  reduced gradient; only then (a rank that missed a parameter) are the flags read at the end
  of backward.

While ``sync`` is off (``no_sync``) the hooks only record which parameters got gradients, which
accumulate locally; the next synced backward reduces the accumulated sums (a parameter that
got a gradient only in the unsynced backwards is reduced from its ``.grad`` at the end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._watchdog import collective
from vescale.ddp.bucketing import DEFAULT_BUCKET_CAP_MB, cap_bytes, joins
from vescale.dtensor.dtensor import from_local, redistribute_dtensor
from vescale.dtensor.flat_groups import flattened_mesh
from vescale.dtensor.inflight import wait_local

__all__ = ["DEFAULT_BUCKET_CAP_MB", "Reducer", "UnusedParameterError"]


class UnusedParameterError(RuntimeError):
    """A parameter got no gradient on some rank in a backward with
    ``find_unused_parameters=False``."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, _UpstreamDTensor) else t


@dataclass
class _Bucket:
    index: int
    mesh: Any
    dims: tuple[int, ...]
    divisor: int  # 1: sum; the group size: average
    dtype: torch.dtype
    params: list[Any] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    nbytes: int = 0
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # slot -> local gradient
    own: set[int] = field(default_factory=set)  # slots whose gradient was reduced on its own
    flat: torch.Tensor | None = None  # the in-flight result once issued


_Key = tuple[Any, tuple[int, ...], int]  # (mesh, mesh dims, divisor: 1 or the group size)


def _all_gather_object(obj: Any, group: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _what(bucket: _Bucket) -> str:
    """The bucket's all-reduce, for the heartbeat."""
    return (
        f"vescale.ddp all-reduce of gradient bucket {bucket.index} ({len(bucket.params)} "
        f"parameters, {bucket.dtype}) over mesh dims {list(bucket.dims)}"
    )


def _digits(n: int) -> int:
    """Base-16 digits of the largest rank below ``n`` (at least one)."""
    return max(1, math.ceil(math.log(max(n, 2), 16)))


class Reducer:
    """Bucketed asynchronous reduction of the gradients of ``named`` (see module docstring)."""

    def __init__(
        self,
        named: list[tuple[str, Any]],
        bucket_cap_mb: float,
        dp_mesh: Any = None,
        find_unused_parameters: bool = False,
    ) -> None:
        self.cap_bytes = cap_bytes(bucket_cap_mb)
        self.dp_mesh = dp_mesh
        self.find_unused = find_unused_parameters
        self.sync = True  # set by the wrapper's forward: False under no_sync
        self.active = True  # False after a compiled forward (its backward reduces in-graph)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.ndigits = _digits(world)
        self.named = named
        self.buckets: list[_Bucket] = []  # built at the end of the first synced backward
        self.built = False
        self.slot: dict[int, tuple[_Bucket, int]] = {}
        self.first: dict[int, torch.Tensor] = {}  # the first synced backward's gradients
        self.next = 0  # the first bucket not issued this backward
        self.armed = False
        self.accumulated: set[int] = set()  # params with a gradient in the unsynced backwards
        self.pending: list[tuple[list[_Bucket], torch.Tensor, Any]] = []  # flags to check
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for _, p in named]

    # ---- layout ------------------------------------------------------------------------

    def _key(self, p: Any) -> _Key | None:
        """What ``p.grad`` is all-reduced over: ``(mesh, dims, divisor)``; ``None``: nothing
        (a gradient already in ``p``'s placements) or a layout reduced on its own."""
        grad = p.grad
        if not isinstance(grad, _UpstreamDTensor):
            if isinstance(p, _UpstreamDTensor) or self.dp_mesh is None:
                return None
            return self.dp_mesh, (0,), self.dp_mesh.size()
        if not isinstance(p, _UpstreamDTensor):
            return None
        pairs = list(zip(grad.placements, p.placements))
        dims = tuple(i for i, (g, w) in enumerate(pairs) if g.is_partial() and w.is_replicate())
        ops = {grad.placements[i].reduce_op for i in dims}  # type: ignore[attr-defined]
        rest_ok = all(g == w for i, (g, w) in enumerate(pairs) if i not in dims)
        if not dims or len(ops) != 1 or not ops <= {"sum", "avg"} or not rest_ok:
            return None
        divisor = math.prod(p.device_mesh.size(d) for d in dims) if ops == {"avg"} else 1
        return p.device_mesh, dims, divisor

    def _agree(self) -> dict[int, tuple[tuple[int, ...], int]]:
        """Every parameter's reduction ``(dims, divisor)`` as the ranks that gave it a gradient
        in the first synced backward saw it (one object all-gather over the group of the first
        parameter's mesh, once); the same on every rank, or a ``RuntimeError`` on every rank."""
        mine = {}
        for i, (_, p) in enumerate(self.named):
            seen_here = id(p) in self.first or id(p) in self.accumulated
            key = self._key(p) if seen_here else None
            if key is not None:
                mine[i] = key[1:]
        seen: dict[int, set[tuple[tuple[int, ...], int]]] = {}
        with collective("vescale.ddp: the first backward's agreement on the reductions"):
            everyone = _all_gather_object(mine, self._agreement_group())
        for theirs in everyone:
            for i, key in theirs.items():
                seen.setdefault(i, set()).add(key)
        clash = {self.named[i][0]: sorted(keys) for i, keys in seen.items() if len(keys) > 1}
        if clash:
            raise RuntimeError(
                "DistributedDataParallel: parameters' gradients need different reductions "
                f"(mesh dims, divisor) on different ranks: {clash}; every rank's backward must "
                "give a parameter's gradient the same placements"
            )
        return {i: keys.pop() for i, keys in seen.items()}

    def _agreement_group(self) -> Any:
        for _, p in self.named:
            mesh = p.device_mesh if isinstance(p, _UpstreamDTensor) else self.dp_mesh
            if mesh is None:
                continue
            if mesh.ndim == 1:
                return mesh.get_group(0)
            flat = flattened_mesh(mesh, range(mesh.ndim))
            return flat.get_group(0) if flat is not None else None
        return None

    def _build(self) -> None:
        """The buckets: parameters in reverse registration order by their agreed reduction,
        cut by the bucket rule; the same on every rank."""
        agreed = self._agree() if dist.is_initialized() else {}
        open_: dict[tuple[Any, ...], _Bucket] = {}
        for i in reversed(range(len(self.named))):
            name, p = self.named[i]
            if i not in agreed:
                continue
            mesh = p.device_mesh if isinstance(p, _UpstreamDTensor) else self.dp_mesh
            key = (mesh, *agreed[i], p.dtype)
            size = _local(p).numel() * p.element_size()
            bucket = open_.get(key)
            if bucket is not None and not joins(bucket.nbytes, size, self.cap_bytes):
                bucket = None
            if bucket is None:
                bucket = open_[key] = _Bucket(len(self.buckets), *key)
                self.buckets.append(bucket)
            self.slot[id(p)] = (bucket, len(bucket.params))
            bucket.params.append(p)
            bucket.names.append(name)
            bucket.nbytes += size
            if bucket.nbytes >= self.cap_bytes:  # full: nothing more joins it
                del open_[key]

    def _flag_width(self) -> int:
        return 1 if self.find_unused else 1 + self.ndigits

    # ---- backward ----------------------------------------------------------------------

    def arm(self) -> None:
        """Queue the end-of-backward callback (once per backward)."""
        if not self.armed and self.active and self.sync:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.armed = True

    def _fits(self, p: Any, bucket: _Bucket) -> bool:
        """Whether ``p.grad`` is what its slot in ``bucket`` reduces."""
        return self._key(p) == (bucket.mesh, bucket.dims, bucket.divisor)

    def _ready(self, p: Any) -> None:
        if p.grad is None or not self.active:
            return
        if not self.sync:
            self.accumulated.add(id(p))
            return
        self.arm()
        where = self.slot.get(id(p))
        if not self.built and self._key(p) is not None:  # the first synced backward
            self.first[id(p)] = p.grad
            return
        if where is not None and self._fits(p, where[0]):
            bucket, i = where
            bucket.grads[i] = _local(p.grad)
            self._issue_ready()
            return
        grad = p.grad
        if isinstance(grad, _UpstreamDTensor) and tuple(grad.placements) != tuple(p.placements):
            p.grad = redistribute_dtensor(grad, placements=p.placements, async_op=False)
        if where is not None:  # reduced on its own: its slot holds zeros, flagged as used
            bucket, i = where
            bucket.grads[i] = torch.zeros_like(_local(p))
            bucket.own.add(i)
            self._issue_ready()

    def _issue_ready(self) -> None:
        while self.next < len(self.buckets):
            bucket = self.buckets[self.next]
            if len(bucket.grads) < len(bucket.params):
                return
            self._issue(bucket)
            self.next += 1

    def _flags(self, bucket: _Bucket, device: torch.device) -> torch.Tensor:
        width = self._flag_width()
        if len(bucket.grads) == len(bucket.params) and not self.find_unused:
            return torch.zeros(len(bucket.params) * width, dtype=bucket.dtype, device=device)
        rows = []
        digits = [(self.rank >> (4 * k)) & 15 for k in range(self.ndigits)]
        for i in range(len(bucket.params)):
            used = i in bucket.grads
            if self.find_unused:
                rows.append([float(used)])
            else:
                rows.append([0.0] * (1 + self.ndigits) if used else [1.0, *map(float, digits)])
        return torch.tensor(rows, dtype=bucket.dtype).reshape(-1).to(device, non_blocking=True)

    def _issue(self, bucket: _Bucket) -> None:
        with torch.profiler.record_function(f"vescale.ddp::bucket{bucket.index}"):
            device = _local(bucket.params[0]).device
            pieces = [
                wait_local(bucket.grads[i]).reshape(-1)
                if i in bucket.grads
                else torch.zeros(_local(p).numel(), dtype=bucket.dtype, device=device)
                for i, p in enumerate(bucket.params)
            ]
            pieces.append(self._flags(bucket, device))
            flat = torch.cat(pieces)
            merged = flattened_mesh(bucket.mesh, bucket.dims)
            groups = [merged] if merged is not None else [(bucket.mesh, d) for d in bucket.dims]
            with collective(_what(bucket)):
                for group in groups:
                    flat = funcol.all_reduce(flat, "sum", group)
            bucket.flat = flat

    def _finish(self) -> None:
        if not self.built:
            self._build()
            self.built = True
            self.accumulated |= set(self.first)
            self.first.clear()
        for bucket in self.buckets[self.next :]:
            for i, p in enumerate(bucket.params):  # gradients only from unsynced backwards
                late = i not in bucket.grads and id(p) in self.accumulated
                if late and p.grad is not None and self._fits(p, bucket):
                    bucket.grads[i] = _local(p.grad)
            self._issue(bucket)
        checked: list[torch.Tensor] = []
        for bucket in self.buckets:
            with collective(_what(bucket)):
                flat = wait_local(bucket.flat)  # type: ignore[arg-type]
            n = flat.numel() - len(bucket.params) * self._flag_width()
            flags = flat[n:]
            used_somewhere: list[float] = []
            if not self.find_unused:
                checked.append(flags)
            elif len(bucket.grads) < len(bucket.params):
                used_somewhere = flags.tolist()  # only on a rank that missed a parameter
            offset = 0
            for i, p in enumerate(bucket.params):
                numel = _local(p).numel()
                piece = flat[offset : offset + numel].view(_local(p).shape)
                offset += numel
                if i in bucket.own:
                    continue
                if i not in bucket.grads and (not self.find_unused or not used_somewhere[i]):
                    continue  # strict: raised at the next forward; no rank used it: untouched
                if bucket.divisor != 1:
                    piece = piece.div_(bucket.divisor)
                if not isinstance(p, _UpstreamDTensor):
                    p.grad = piece
                else:
                    p.grad = from_local(
                        piece,
                        bucket.mesh,
                        p.placements,
                        run_check=False,
                        shape=p.shape,
                        stride=p.stride(),
                    )
            bucket.grads.clear()
            bucket.own.clear()
            bucket.flat = None
        if checked:
            self._stash(checked)
        self.next = 0
        self.armed = False
        self.accumulated.clear()

    # ---- the lazy check ----------------------------------------------------------------

    def _stash(self, flags: list[torch.Tensor]) -> None:
        """Copy this backward's flags to the host without waiting (pinned memory and an event
        on an accelerator); :meth:`check` reads them."""
        src = torch.cat(flags)
        event = None
        if src.device.type == "cpu":
            host = src
        else:
            host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            host.copy_(src, non_blocking=True)
            event = torch.Event(src.device.type)
            event.record()
        self.pending.append((list(self.buckets), host, event))

    def check(self) -> None:
        """Raise :class:`UnusedParameterError` (the same text on every rank of a bucket's
        group) when a parameter got no gradient on some rank in an earlier backward. Waits
        only for that backward's reductions (on an accelerator: an event the device normally
        passed while the host queued the optimizer step); reads the flags' host bytes, and
        decodes them only when one is non-zero."""
        pending, self.pending = self.pending, []
        for buckets, host, event in pending:
            if event is not None:
                event.synchronize()
            if any(host.untyped_storage()[: host.numel() * host.element_size()]):
                raise UnusedParameterError(self._describe(buckets, host.tolist()))

    def _describe(self, buckets: list[_Bucket], flags: list[float]) -> str:
        width = 1 + self.ndigits
        missed = []
        for bucket in buckets:
            for name in bucket.names:
                row, flags = flags[:width], flags[width:]
                count = round(row[0])
                if count == 1:
                    rank = sum(round(d) << (4 * k) for k, d in enumerate(row[1:]))
                    missed.append(f"{name!r} on rank {rank}")
                elif count > 1:
                    missed.append(f"{name!r} on {count} ranks")
        return (
            f"DistributedDataParallel: parameters got no gradient in the last backward: "
            f"{', '.join(missed)}. With find_unused_parameters=False every rank's backward must "
            "reach every parameter (their gradient buckets were reduced with zeros for them, "
            "and this is raised at the next forward on every rank); pass "
            "find_unused_parameters=True to reduce a missing gradient as zero, or use every "
            "parameter on every rank (e.g. no rank-dependent branch)"
        )
