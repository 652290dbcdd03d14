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
  ``bucket_cap_mb`` option (same default). Steps with ``find_unused_parameters=True``, inside
  :meth:`~DistributedDataParallel.no_sync` and the first synced step after it run the
  module's compiled graphs with the eager :class:`~vescale.ddp.reducer.Reducer` instead
  (its hooks run after the compiled backward; its host steps between graphs), so they have
  eager DDP's semantics, as upstream's compiled DDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._node_meta import set_bucket_cap_mb
from vescale._torch_compat import get_proxy_mode, pytree
from vescale.ddp.bucketing import DEFAULT_BUCKET_CAP_MB
from vescale.ddp.reducer import Reducer
from vescale.dtensor.device_mesh import DeviceMesh as _Mesh
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


def _check_devices(module: nn.Module, device_ids: Any, output_device: Any) -> None:
    """torch DDP's ``device_ids`` / ``output_device``: ignored for a CPU module; for an
    accelerator module, the one device its parameters are on."""
    if device_ids is not None and (
        isinstance(device_ids, (str, bytes)) or not isinstance(device_ids, Sequence)
    ):
        raise TypeError(
            f"DistributedDataParallel: device_ids must be a list of device indices or devices "
            f"(e.g. [local_rank]), got {device_ids!r}; bucket_cap_mb is a keyword argument"
        )
    devices = {_local_device(p) for p in module.parameters()}
    if all(d.type == "cpu" for d in devices):
        return
    asked = [*(device_ids or []), *([] if output_device is None else [output_device])]
    if len(devices) > 1 or (device_ids is not None and len(device_ids) != 1):
        raise ValueError(
            f"DistributedDataParallel: device_ids={device_ids!r} must name the one device of "
            f"the module's parameters, which are on {sorted(map(str, devices))}"
        )
    (device,) = devices
    for d in asked:
        want = d if isinstance(d, torch.device) else torch.device(device.type, d)
        if want != device:
            raise ValueError(
                f"DistributedDataParallel: device_ids={device_ids!r}, output_device="
                f"{output_device!r} must be the module's device {device}, got {want}"
            )


def _local_device(t: torch.Tensor) -> torch.device:
    return t._local_tensor.device if isinstance(t, _UpstreamDTensor) else t.device


def _data_parallel_mesh(
    module: nn.Module, device_mesh: Any, dp_mesh: Any, process_group: Any
) -> DeviceMesh | None:
    """The 1-D data-parallel mesh of plain parameters: ``device_mesh`` (torch's keyword),
    ``dp_mesh`` (veScale's) or a mesh over ``process_group``; for a module of plain parameters
    only, the default group's (as torch DDP)."""
    given = [m for m in (device_mesh, dp_mesh, process_group) if m is not None]
    if len(given) > 1:
        raise ValueError(
            "DistributedDataParallel: pass one of device_mesh, dp_mesh (veScale's name for "
            "it) and process_group"
        )
    params = list(module.parameters())
    device = _local_device(params[0]).type if params else "cpu"
    if process_group is not None:
        return _Mesh.from_group(process_group, device)
    if given:
        return given[0]  # type: ignore[no-any-return]
    plain = bool(params) and not any(isinstance(p, _UpstreamDTensor) for p in params)
    if plain and dist.is_initialized():
        return _Mesh.from_group(dist.group.WORLD, device)
    return None


def _broadcast_from_first(tensors: list[torch.Tensor], mesh: DeviceMesh) -> None:
    """Copy the first rank of ``mesh``'s values into ``tensors`` (plain ones), one flattened
    broadcast per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            dist.broadcast(flat, group=mesh.get_group(0), group_src=0)
            for t, piece in zip(group, flat.split([t.numel() for t in group])):
                t.copy_(piece.view_as(t))


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that every gradient arrives reduced over data parallelism: a DTensor
    parameter's in its placements, a plain parameter's averaged over the data-parallel mesh
    (see the module doc). torch DDP's arguments, where they mean the same:

    * ``device_ids`` / ``output_device``: ignored for a CPU module, else the module's device;
    * ``device_mesh`` (veScale's ``dp_mesh``; or ``process_group``): the 1-D data-parallel
      mesh of plain parameters (default for a module of plain parameters: the default group);
    * ``init_sync``: broadcast the first rank's plain parameters and buffers at construction;
      ``broadcast_buffers``: also broadcast the plain buffers at each eager forward;
    * ``bucket_cap_mb``: bucket size in MiB, eager and compiled (``None``: 25 eagerly, the
      backend's option compiled);
    * ``find_unused_parameters``: a parameter that got no gradient on a rank is reduced as zero
      there; without it such a parameter raises :class:`~vescale.ddp.reducer.
      UnusedParameterError` at the next forward on every rank.

    :meth:`no_sync` accumulates gradients locally. ``module`` stays reachable as ``.module``;
    its parameters are this wrapper's parameters (``ddp.parameters()`` feeds the optimizer)."""

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        *,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        device_mesh: DeviceMesh | None = None,
        dp_mesh: DeviceMesh | None = None,
    ) -> None:
        super().__init__()
        if isinstance(device_ids, DeviceMesh):  # veScale legacy: DDP(module, mesh or group)
            device_ids, dp_mesh = None, device_ids
        elif isinstance(device_ids, dist.ProcessGroup):
            device_ids, process_group = None, device_ids
        _check_devices(module, device_ids, output_device)
        dp_mesh = _data_parallel_mesh(module, device_mesh, dp_mesh, process_group)
        _check_params(module, dp_mesh)
        self.module = module
        self.bucket_cap_mb = bucket_cap_mb
        self.dp_mesh = dp_mesh
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self._sync_grads = True
        self._unsynced = False  # gradients of a no_sync step wait for the next synced one
        self._buffers_synced = (
            [b for b in module.buffers() if not isinstance(b, _UpstreamDTensor)]
            if dp_mesh is not None
            else []
        )
        self._synced = [
            name
            for name, p in module.named_parameters()
            if p.requires_grad and (isinstance(p, _UpstreamDTensor) or dp_mesh is not None)
        ]
        named: list[tuple[str, Any]] = [(n, module.get_parameter(n)) for n in self._synced]
        for _, p in named:
            if isinstance(p, _UpstreamDTensor):
                replicated = [i for i, q in enumerate(p.placements) if q.is_replicate()]
                flattened_mesh(p.device_mesh, replicated)
        if init_sync and dp_mesh is not None:
            plain = [p for p in module.parameters() if not isinstance(p, _UpstreamDTensor)]
            _broadcast_from_first(plain + self._buffers_synced, dp_mesh)
        cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        self._reducer = Reducer(named, cap, dp_mesh, find_unused_parameters)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients of the forwards inside accumulate locally, unreduced; the first forward
        after the block (and its backward) reduces the accumulated sums, as torch DDP."""
        saved, self._sync_grads = self._sync_grads, False
        try:
            yield
        finally:
            self._sync_grads = saved

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and not self._reducer_step():
            return self._compiled_forward(args, kwargs)
        self._start_reducer_step()
        out = self.module(*args, **kwargs)  # the reducer's hooks reduce the gradients
        self._arm_outputs(out)
        return out

    def _reducer_step(self) -> bool:
        """Whether this step's gradients go through the eager :class:`Reducer` (its hooks run
        after the backward, compiled or not): eagerly always; compiled under
        ``find_unused_parameters``, inside :meth:`no_sync`, and in the first synced step
        after it (which reduces the accumulated sums)."""
        return self.find_unused_parameters or not self._sync_grads or self._unsynced

    @torch.compiler.disable  # host work (flags, buffers' broadcast): eager, between graphs
    def _start_reducer_step(self) -> None:
        self._reducer.check()
        self._reducer.active, self._reducer.sync = True, self._sync_grads
        self._unsynced = not self._sync_grads
        if self.broadcast_buffers and self._buffers_synced:
            _broadcast_from_first(self._buffers_synced, self.dp_mesh)  # type: ignore[arg-type]

    @torch.compiler.disable
    def _arm_outputs(self, out: Any) -> None:
        if self._sync_grads and torch.is_grad_enabled():
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._arm)

    def _arm(self, grad: torch.Tensor) -> None:
        self._reducer.arm()  # a backward without any parameter's gradient still reduces

    def _compiled_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._reducer.active = False  # the gradients arrive reduced by the traced backward
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
