"""One block's parameters in one flat buffer: sharded storage, one all-gather, one reduce-scatter.

``FlatGroup`` owns, for the parameters of one module (its block):

* ``shard``: this rank's share of the flat buffer (:mod:`vescale.fsdp.layout`). Each
  parameter becomes an ``nn.Parameter`` DTensor with placement
  ``RaggedShard(dims=(0,), local_units=<rows per rank>)`` (``(Replicate(), RaggedShard)`` on
  a 2-D mesh: HSDP, replicated over dim 0, sharded over dim 1) whose local tensor is a view
  of ``shard``: the optimizer updates the shard in place, nothing is copied back.
* ``full``: the gathered flat buffer (``world * share`` elements, in the compute dtype).
  :meth:`FlatGroup.gather` fills it with one ``all_gather_into_tensor`` (async) straight
  from ``shard`` (equal shares: no copy-in, no copy-out); every unsharded parameter is a
  view of it. :meth:`FlatGroup.free` drops its storage (``resize_(0)``); gathering again
  refills the same storage, so views saved by autograd see the values again in backward.
* backward (:class:`_Unshard`): every parameter's gradient is written once into its slot of
  one flat gradient buffer, which one async reduce-scatter sums into this rank's share while
  backward goes on (then, with HSDP, one all-reduce over the replicas); at the end of
  backward the share is divided by the number of data-parallel ranks and each parameter's
  ``.grad`` becomes a DTensor of the parameter's placements whose local tensor views it.

Every buffer lives on the mesh's device (``mesh.device_type``, the current device index
for an accelerator). Parameters on the meta device give a meta ``shard`` (materialized by
``module.to_empty``: :meth:`FlatGroup.apply`); ``vescale.deferred_init`` parameters are
materialized here, each rank keeping only its share (``materialize_dtensor`` computes a
``RaggedShard`` parameter whole, one parameter at a time). With a ``param_dtype`` the shard stays the master copy (its dtype) and the gather sends
a cast of it (one copy of the share: the cast itself); gradients are reduced in
``reduce_dtype`` and cast back to the master dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.placement_types import Placement, Replicate

from vescale._watchdog import collective
from vescale.dtensor.deferred_init import is_deferred, materialize_dtensor
from vescale.dtensor.dtensor import _comm_device, from_local, new_dtensor
from vescale.dtensor.layout import contiguous_strides
from vescale.dtensor.ragged import RaggedShard
from vescale.fsdp.layout import FlatLayout, plan_layout

__all__ = ["FlatGroup", "Owners"]

Owners = Sequence[tuple[nn.Module, str]]  # the (module, attribute) pairs holding one parameter
_record = torch.profiler.record_function


def _block(name: str, p: torch.Tensor) -> int:
    """Elements of one row of ``p`` (the RaggedShard ``dims=(0,)`` block)."""
    if p.dim() == 0 or p.numel() == 0:
        raise ValueError(
            f"fully_shard: parameter {name!r} of shape {tuple(p.shape)} cannot be "
            "RaggedShard(dims=(0,))-sharded (0-dim or empty); keep it out of the module "
            "or make it at least 1-D and non-empty"
        )
    return p.numel() // p.shape[0]


class FlatGroup:
    """The flat-buffer state of one ``fully_shard`` module (see the module docstring).

    ``params``: ``(owners, parameter)`` in layout order, ``owners`` every ``(module,
    attribute)`` holding it (more than one: tied weights); ``names``: their qualified names
    (for errors). ``mesh``: 1-D (shard) or 2-D (replicate over dim 0, shard over dim 1)."""

    def __init__(
        self,
        params: Sequence[tuple[Owners, nn.Parameter]],
        names: Sequence[str],
        mesh: Any,
        *,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
    ) -> None:
        dtypes = {p.dtype for _, p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"fully_shard: one flat buffer needs one dtype, parameters {list(names)} "
                f"have {sorted(map(str, dtypes))}; cast the module first"
            )
        self.mesh = mesh
        self.device = _comm_device(mesh)  # mesh.device_type, the current index for cuda
        self.shard_dim = mesh.ndim - 1
        self.world = mesh.size(self.shard_dim)
        self.rank = mesh.get_coordinate()[self.shard_dim]  # no process group on a meta mesh
        self.replicas = mesh.size(0) if mesh.ndim == 2 else 1
        self.names = list(names)
        self.owners = [list(owners) for owners, _ in params]
        self.shapes = [p.shape for _, p in params]
        self.originals = {id(p) for _, p in params}  # to refuse ties across fully_shard calls
        self.layout: FlatLayout = plan_layout(
            [(p.numel(), _block(n, p)) for n, (_, p) in zip(names, params)], self.world
        )
        self.param_dtype = param_dtype
        self.reduce_dtype_option = reduce_dtype
        self.requires_gradient_sync = True
        self.reshard_after_backward = True
        self.divide_factor: float | None = None
        self._work: tuple[Any, torch.Tensor] | None = None
        self._pending: tuple[Any, torch.Tensor, torch.Tensor] | None = None
        self._unsynced: torch.Tensor | None = None  # gradients kept by no gradient sync
        self._post_forward: tuple[Any, int, int] | None = None  # (group, coordinate, size)
        self._kept: torch.Tensor | None = None  # this rank's part of full after forward
        meta = [p.is_meta and not is_deferred(p) for _, p in params]
        if any(meta) and not all(meta):
            raise ValueError(
                f"fully_shard: parameters {[n for n, m in zip(names, meta) if m]} are on the "
                "meta device and others are not; put all of one module's on meta or none"
            )
        self._set_shard(
            torch.zeros(
                self.layout.share, dtype=dtypes.pop(), device="meta" if all(meta) else self.device
            )
        )
        self.sharded: list[nn.Parameter] = []
        with torch.no_grad():
            for i, (owners, p) in enumerate(params):
                local = self._view_of_shard(i)
                if is_deferred(p):
                    local.copy_(materialize_dtensor(p, mesh, self.placements(i)).to_local())
                elif not local.is_meta:
                    start, length = self.layout.local_range(i, self.rank)
                    lo = self.rank * self.layout.share + start - self.layout.slots[i].offset
                    local.copy_(p.detach().reshape(-1).narrow(0, lo if length else 0, length))
                sharded = nn.Parameter(self._dtensor(i, local), requires_grad=p.requires_grad)
                for module, attr in owners:
                    module._parameters[attr] = sharded
                self.sharded.append(sharded)
        self._locals = [p._local_tensor for p in self.sharded]  # type: ignore[attr-defined]

    def _set_shard(self, shard: torch.Tensor) -> None:
        """Adopt ``shard`` (this rank's share) and its dtype; forget the gathered buffer."""
        self.shard = shard
        self.compute_dtype = self.param_dtype or shard.dtype
        self.reduce_dtype = self.reduce_dtype_option or self.compute_dtype
        self.full = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        self._full_numel = self.world * self.layout.share

    # ---- layout ------------------------------------------------------------------------

    def placements(self, index: int) -> list[Placement]:
        """Parameter ``index``'s placements: its rows per rank as the RaggedShard's
        ``local_units`` (after a ``Replicate()`` on a 2-D mesh)."""
        ragged = RaggedShard(dims=(0,), local_units=self.layout.slots[index].units)
        return [Replicate(), ragged] if self.mesh.ndim == 2 else [ragged]

    def _view_of_shard(self, index: int) -> torch.Tensor:
        start, length = self.layout.local_range(index, self.rank)
        return self.shard.narrow(0, start, length)

    def _dtensor(self, index: int, local: torch.Tensor) -> Any:
        shape = self.shapes[index]
        return from_local(
            local,
            self.mesh,
            self.placements(index),
            run_check=False,
            shape=shape,
            stride=contiguous_strides(shape),
        )

    def check_storage(self) -> None:
        """Raise if a sharded parameter's local tensor no longer views ``shard`` (replaced by
        ``load_state_dict(assign=True)`` or ``.data =``), or if it is still on meta."""
        for name, p, local in zip(self.names, self.sharded, self._locals):
            if p._local_tensor is not local:  # type: ignore[attr-defined]
                raise RuntimeError(
                    f"fully_shard: parameter {name!r} no longer views its flat shard (its local "
                    "tensor was replaced); update parameters in place (copy_, optimizers)"
                )
        if self.shard.is_meta:
            raise RuntimeError(
                f"fully_shard: parameters {self.names} are on the meta device; materialize "
                f"them first (module.to_empty(device={str(self.device)!r}), then initialize)"
            )

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``nn.Module._apply``'s ``fn`` (``to_empty``, ``to``, ``double``, ...) on ``shard``;
        the parameters (same objects, swapped in place) then view the new shard, gradients
        are dropped. Call it resharded."""
        with torch.no_grad():
            self._set_shard(fn(self.shard))
            for i, p in enumerate(self.sharded):
                new = nn.Parameter(
                    self._dtensor(i, self._view_of_shard(i)), requires_grad=p.requires_grad
                )
                torch.utils.swap_tensors(p, new)
        self._locals = [p._local_tensor for p in self.sharded]  # type: ignore[attr-defined]

    # ---- all-gather ----------------------------------------------------------------------

    def _pg(self) -> Any:
        return self.mesh.get_group(self.shard_dim)

    def _what(self, kind: str) -> str:
        """``kind`` of this block's buffer over its group, for the heartbeat (host facts
        only: the heartbeat thread reads the text)."""
        return (
            f"vescale.fsdp {kind} of {len(self.names)} parameters from {self.names[0]!r} "
            f"({self._full_numel} elements) over mesh dim {self.shard_dim} ({self.world} ranks)"
        )

    def set_post_forward_world(self, k: int) -> None:
        """Reshard to groups of ``k`` consecutive ranks of the mesh after forward (makes the
        groups: every rank calls it at the same point)."""
        self._post_forward = _post_forward_group(self.mesh, k)

    def reshard_to_post_forward_world(self) -> None:
        """Keep this rank's ``1/k`` of ``full`` (the part :meth:`gather` then all-gathers over
        its group of ``k`` ranks) and free ``full``."""
        assert self._post_forward is not None
        self.wait()
        _, coordinate, k = self._post_forward
        part = self._full_numel // k
        self._kept = self.full.narrow(0, coordinate * part, part).clone()
        self.free()

    def gather(self, backward: bool = False) -> None:
        """Issue the all-gather of ``shard`` into ``full`` (async; in ``backward``, of the
        part kept after forward, over its group, if any); no-op if issued or done. A kept
        part not used by a backward is dropped (the parameters may have changed since)."""
        if self._work is not None or self.full.untyped_storage().nbytes() > 0:
            return
        if not backward:
            self._kept = None
        if self._kept is not None:
            assert self._post_forward is not None
            with _record("vescale.fsdp::all_gather"):
                self.full.untyped_storage().resize_(self._full_numel * self.full.element_size())
                kept, self._kept = self._kept, None
                work = dist.all_gather_single(
                    self.full.data, kept, group=self._post_forward[0], async_op=True
                )
                self._work = (work, kept)
            return
        with _record("vescale.fsdp::all_gather"):
            if self.full.numel() == 0:
                self.full = torch.empty(
                    self._full_numel, dtype=self.compute_dtype, device=self.device
                )
            else:
                self.full.untyped_storage().resize_(self._full_numel * self.full.element_size())
            src = (
                self.shard
                if self.compute_dtype == self.shard.dtype
                else self.shard.to(self.compute_dtype)
            )
            # ``.data``: a fresh version counter, so refilling ``full`` before backward does
            # not invalidate the views autograd saved in forward. ``src`` lives until the wait.
            self._work = (
                dist.all_gather_single(self.full.data, src, group=self._pg(), async_op=True),
                src,
            )

    def wait(self, backward: bool = False) -> None:
        """Gather (if not issued; ``backward``: as :meth:`gather`) and wait: ``full`` holds
        every rank's share."""
        self.gather(backward)
        if self._work is not None:
            with collective(self._what("all-gather")):
                self._work[0].wait()
            self._work = None

    def free(self) -> None:
        """Drop the gathered buffer's storage (the parameters are sharded again)."""
        if self._work is not None:
            self.wait()
        self.full.untyped_storage().resize_(0)

    def views(self) -> list[torch.Tensor]:
        """The unsharded parameters: views of ``full``."""
        return [
            self.full.narrow(0, s.offset, s.numel).view(shape)
            for s, shape in zip(self.layout.slots, self.shapes)
        ]

    def unshard(self) -> list[torch.Tensor]:
        """Wait for ``full`` and return the unsharded parameters, differentiable w.r.t. the
        sharded ones (backward: :meth:`reduce_grads`)."""
        self.wait()
        return list(_Unshard.apply(self, *self.sharded))

    # ---- reduce-scatter ----------------------------------------------------------------

    def reduce_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Lay every gradient in one flat buffer (one ``cat``: the only copy). Without
        gradient sync, add it to the kept unsharded gradients; else issue one reduce-scatter
        (async, a sum) of it and queue :meth:`finish_grads` for the end of this backward."""
        flat = torch.empty(self._full_numel, dtype=self.reduce_dtype, device=self.device)
        with _record("vescale.fsdp::reduce_scatter_copy_in"):
            torch.cat(self._pieces(grads), out=flat)
            if self._unsynced is not None:
                flat.add_(self._unsynced)
                self._unsynced = None
        if not self.requires_gradient_sync:
            self._unsynced = flat
            return
        reduced = torch.empty(self.layout.share, dtype=self.reduce_dtype, device=self.device)
        with _record("vescale.fsdp::reduce_scatter"):
            work = dist.reduce_scatter_single(reduced, flat, group=self._pg(), async_op=True)
        self._pending = (work, reduced, flat)
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_grads)

    def _pieces(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """The flat gradient buffer's contents in order: each gradient flattened, zeros for
        padding and for parameters that got no gradient."""
        pieces, end = [], 0
        for s, g in zip(self.layout.slots, grads):
            if s.offset > end:
                pieces.append(self._zeros(s.offset - end))
            pieces.append(self._zeros(s.numel) if g is None else g.reshape(-1))
            end = s.offset + s.numel
        if self._full_numel > end:
            pieces.append(self._zeros(self._full_numel - end))
        return pieces

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=self.reduce_dtype, device=self.device)

    def finish_grads(self) -> None:
        """Wait for the reduce-scatter (all-reduce the share over the replicas with HSDP);
        each parameter's ``.grad`` becomes (or accumulates) a DTensor whose local tensor
        views the reduced share, divided by the data-parallel size (or the divide factor)."""
        if self._pending is None:
            return
        work, reduced, _ = self._pending
        with collective(self._what("reduce-scatter")):
            work.wait()
        self._pending = None
        if self.replicas > 1:
            with _record("vescale.fsdp::all_reduce"), collective(self._what("replica all-reduce")):
                dist.all_reduce(reduced, group=self.mesh.get_group(0))
        factor = self.divide_factor or self.world * self.replicas
        reduced = reduced.to(self.shard.dtype).div_(factor)  # the sum over ranks -> mean
        for i, p in enumerate(self.sharded):
            if not p.requires_grad:
                continue
            start, length = self.layout.local_range(i, self.rank)
            local = reduced.narrow(0, start, length)
            if p.grad is None:
                p.grad = new_dtensor(local, p._spec, requires_grad=False)  # type: ignore[attr-defined]
            else:
                p.grad._local_tensor.add_(local)  # type: ignore[attr-defined]


_POST_FORWARD: dict[tuple[str, tuple[int, ...], int], tuple[Any, int, int]] = {}


def _post_forward_group(mesh: Any, k: int) -> tuple[Any, int, int]:
    """(group, this rank's coordinate in it, ``k``): the mesh's ranks in rows of ``k``
    (``mesh.mesh.view(-1, k)``, as upstream; with HSDP a row stays within a replica), one
    set of groups per mesh and ``k``."""
    rows = mesh.mesh.reshape(-1, k)
    key = (mesh.device_type, tuple(rows.flatten().tolist()), k)
    if key not in _POST_FORWARD:
        me = dist.get_rank()
        for row in rows.tolist():  # every rank makes every group, in the same order
            group = dist.new_group(row)
            if me in row:
                _POST_FORWARD[key] = (group, row.index(me), k)
    return _POST_FORWARD[key]


class _Unshard(torch.autograd.Function):
    """Sharded parameters -> views of the gathered flat buffer; backward: one reduce-scatter,
    whose result lands in the parameters' ``.grad`` at the end of backward (no gradient
    flows to them through autograd)."""

    @staticmethod
    def forward(ctx: Any, group: FlatGroup, *sharded: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.group = group
        return tuple(group.views())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:  # type: ignore[override]
        group: FlatGroup = ctx.group
        group.reduce_grads(grads)
        if group.reshard_after_backward:
            group.free()
        return (None,) * (len(grads) + 1)
