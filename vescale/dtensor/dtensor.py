"""``vescale.DTensor``: upstream ``DTensor`` with veScale's conversion semantics.

The class and its conversions live here (one module, no import cycle):

* ``distribute_tensor``: data from coordinate 0; ``Partial`` puts the value on coordinate 0
  (identity elements elsewhere); the caller's tensor is never modified.
* ``from_local``: uneven shards by default (local sizes gathered along sharded mesh dims,
  rank i holding ``torch.chunk`` chunk i); ``run_check`` first checks every rank's metadata
  alike (one small all-gather, :mod:`vescale.dtensor.local_metadata`), then broadcasts
  Replicate data from coordinate 0 (``VESCALE_DISABLE_RUN_CHECK=1`` turns it off everywhere).
* ``to_local``/``redistribute`` with async collectives; ``Replicate -> Partial`` is local.
All are differentiable.

What is vescale's is marked on the spec: a ``vescale.DTensor`` carries a
:class:`VescaleSpec`, equal to the ``DTensorSpec`` with the same fields but hashed apart, so
upstream's sharding caches (C++ and Python) keep the results of ops on vescale DTensors
apart from those on upstream DTensors. An op with a vescale input gets ``VescaleSpec``
outputs (``propagation.py`` marks them after propagation), and :func:`wrap_output` (upstream's
``OpDispatcher.wrap``, replaced through ``vescale._patches``) builds a ``vescale.DTensor``
for those and exactly what upstream builds otherwise. On a cache hit this costs one type
check per output; upstream DTensors keep upstream's classes and behaviour.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor as _UpstreamDTensor
from torch.distributed.tensor import distribute_tensor as _upstream_distribute_tensor

from vescale._env import env_flag
from vescale._torch_compat import (
    DTensorSpec,
    OpDispatcher,
    _mesh_resources,
    are_we_tracing,
    compute_global_tensor_info,
    compute_local_shape_and_global_offset,
)
from vescale.dtensor._recording import ACTIVE as _RECORDING
from vescale.dtensor._recording import record_placements, record_redistribute
from vescale.dtensor.device_mesh import DeviceMesh
from vescale.dtensor.inflight import wait_local
from vescale.dtensor.layout import chunk_sizes, contiguous_strides, dense_strides
from vescale.dtensor.local_metadata import (
    LocalRecord,
    check_records,
    gather_records,
    gathered_shapes,
    mesh_coordinates,
)
from vescale.dtensor.placement_types import (
    Placement,
    Replicate,
    Shard,
    check_interleaved,
    make_spec,
    normalize_placements,
    spec_placements,
    user_placements,
)
from vescale.dtensor.ragged import find_ragged, replace_ragged
from vescale.dtensor.ragged_checkpoint import (
    ragged_chunks,
    ragged_shard_view,
    ragged_write_items,
)
from vescale.dtensor.ragged_dtensor import ragged_from_local_layout
from vescale.dtensor.redistribute import redistribute_local_tensor, replicate_to_partial

__all__ = [
    "DTensor",
    "VescaleSpec",
    "as_vescale_spec",
    "distribute_tensor",
    "from_local",
    "full_tensor",
    "is_vescale_spec",
    "new_dtensor",
    "redistribute_dtensor",
    "to_local",
    "upstream_init",
    "vescale_rules",
    "vescale_rules_active",
    "wrap_local",
    "wrap_output",
]


class VescaleSpec(DTensorSpec):
    """The spec of a ``vescale.DTensor``: equal only to a ``VescaleSpec`` with the same
    fields, hashed apart from the ``DTensorSpec`` with those fields, so sharding caches keep
    vescale's results apart (the C++ cache compares keys with ``==`` on a bucket collision,
    whatever their hashes: an equal upstream key got a vescale result by chance); AOTAutograd's
    stable hash tells the two apart too."""

    def __eq__(self, other: object, /) -> bool:
        # Python tries a subclass's __eq__ first, so DTensorSpec == VescaleSpec is False too
        return type(other) is VescaleSpec and self._check_equals(other)

    __hash__ = DTensorSpec.__hash__  # defining __eq__ would drop the inherited hash

    def _hash_impl(self) -> int:
        return hash((VescaleSpec, self._hash_key()))

    def _stable_hash(self) -> str:
        return "vescale:" + super()._stable_hash()

    def shallow_copy_with_tensor_meta(self, tensor_meta: Any) -> DTensorSpec:
        return as_vescale_spec(super().shallow_copy_with_tensor_meta(tensor_meta))


def as_vescale_spec(spec: DTensorSpec) -> VescaleSpec:
    """``spec`` marked as vescale's (the same object if it already is)."""
    if type(spec) is VescaleSpec:
        return spec
    out = object.__new__(VescaleSpec)
    out.__dict__.update(spec.__dict__)
    out.__dict__["_hash"] = None
    return out


def is_vescale_spec(specs: Iterable[Any]) -> bool:
    """Whether any of ``specs`` (specs, or lists of specs, as in an ``OpSchema``) is vescale's."""
    for s in specs:
        if type(s) is VescaleSpec:
            return True
        if isinstance(s, list | tuple) and any(type(x) is VescaleSpec for x in s):
            return True
    return False


class _ThreadFlag(threading.local):
    """A per-thread boolean (``.on``, False in a new thread) set for a scope by ``scope``."""

    on = False

    @contextlib.contextmanager
    def scope(self, on: bool) -> Iterator[None]:
        prev, self.on = self.on, on
        try:
            yield
        finally:
            self.on = prev


_rules = _ThreadFlag()


def vescale_rules_active() -> bool:
    """Whether the sharding propagation running now is for an op with a vescale input, so
    vescale-only strategy rules apply (upstream's rules otherwise)."""
    return _rules.on


def vescale_rules(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """Propagate with vescale's rules (``on``) or upstream's in this scope and thread; the
    dispatcher sets it per op, and direct callers of strategies (the plan path) use it."""
    return _rules.scope(on)


# ---- conversions (differentiable) ---------------------------------------------------


def _mesh(device_mesh: Any, what: str) -> Any:
    if device_mesh is not None:
        return device_mesh
    if not _mesh_resources.mesh_stack:
        raise ValueError(f"{what}: no device_mesh given and none active (use `with mesh:`)")
    return _mesh_resources.get_current_mesh()


def _grad_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """Default gradient layout for a tensor laid out as ``placements``: Partial -> Replicate."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def _comm_device(mesh: Any) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(
        mesh.device_type, torch.get_device_module(mesh.device_type).current_device()
    )


def _gathered_global_shape(
    local: torch.Tensor, mesh: Any, placements: Sequence[Placement]
) -> list[int]:
    """Global shape from the local sizes on every rank (innermost mesh dim first): one host
    all-gather of every rank's local shape (:func:`gathered_shapes`), else (a sub-mesh on
    device-only groups) one device all-gather per sharded mesh dim."""
    shape = list(local.shape)
    everyone = gathered_shapes(shape, mesh)
    coords = mesh_coordinates(mesh) if everyone is not None else {}
    me = mesh.get_coordinate()
    for mesh_dim in reversed(range(mesh.ndim)):
        p = placements[mesh_dim]
        n = mesh.size(mesh_dim)
        if not isinstance(p, Shard) or n == 1:
            continue
        if everyone is None:
            mine = torch.tensor([shape[p.dim]], dtype=torch.int64, device=_comm_device(mesh))
            sizes = funcol.all_gather_single(mine, 0, (mesh, mesh_dim)).tolist()
        else:  # each line along this mesh dim (the other coordinates fixed): its sizes
            lines: dict[tuple[int, ...], list[int]] = {}
            for r, c in coords.items():
                lines.setdefault(_other(c, mesh_dim), [0] * n)[c[mesh_dim]] = everyone[r][p.dim]
            sizes = lines[_other(me, mesh_dim)]
            for r, c in coords.items():  # each rank's size from now on: its line's total
                dims = everyone[r]
                everyone[r] = (*dims[: p.dim], sum(lines[_other(c, mesh_dim)]), *dims[p.dim + 1 :])
        total = sum(sizes)
        if sizes != chunk_sizes(total, n):
            raise ValueError(
                f"from_local: local sizes {sizes} of tensor dim {p.dim} along mesh dim "
                f"{mesh_dim} of {mesh} are not the torch.chunk split of {total} over {n} "
                f"ranks ({chunk_sizes(total, n)}); rank i must hold chunk i"
            )
        shape[p.dim] = total
    return shape


def _other(coordinate: Sequence[int], mesh_dim: int) -> tuple[int, ...]:
    """A mesh coordinate without ``mesh_dim``: the line along ``mesh_dim`` it lies on."""
    return (*coordinate[:mesh_dim], *coordinate[mesh_dim + 1 :])


def _broadcast_replicated(
    local: torch.Tensor, mesh: Any, placements: Sequence[Placement]
) -> torch.Tensor:
    """``local`` made identical along Replicate mesh dims (coordinate 0's data); never in place."""
    out = wait_local(local)
    for mesh_dim, p in enumerate(placements):
        if p.is_replicate() and mesh.size(mesh_dim) > 1:
            src = mesh.get_local_rank(mesh_dim) == 0
            buf = (
                out.contiguous()
                if src
                else torch.empty_like(out, memory_format=torch.contiguous_format)
            )
            dist.broadcast(buf, group=mesh.get_group(mesh_dim), group_src=0)
            out = buf
    return out


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        local: torch.Tensor,
        spec: DTensorSpec,
        grad_placements: tuple[Placement, ...] | None,
        run_check: bool,
    ) -> DTensor:
        ctx.spec = spec
        ctx.grad_placements = grad_placements
        ctx.set_materialize_grads(False)
        data = _broadcast_replicated(local, spec.mesh, spec.placements) if run_check else local
        if data is local:
            data = local.view_as(local)  # a fresh tensor object sharing the caller's memory
        return new_dtensor(data, spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: _UpstreamDTensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        if grad is None:
            return None, None, None, None
        target = ctx.grad_placements or _grad_placements(ctx.spec.placements)
        local = grad._local_tensor
        if tuple(grad._spec.placements) != tuple(target):
            dst = DTensorSpec(grad._spec.mesh, tuple(target), tensor_meta=grad._spec.tensor_meta)
            local = redistribute_local_tensor(local, grad._spec, dst)
        return wait_local(local), None, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        dt: DTensor,
        grad_placements: tuple[Placement, ...] | None,
        async_output: bool,
    ) -> torch.Tensor:
        ctx.spec = dt._spec
        ctx.grad_placements = grad_placements
        ctx.set_materialize_grads(False)
        local = dt._local_tensor if async_output else wait_local(dt._local_tensor)
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        if grad is None:
            return None, None, None
        spec: DTensorSpec = ctx.spec
        placements = ctx.grad_placements or _grad_placements(spec.placements)
        ragged = grad.ndim != len(spec.shape)  # a RaggedShard's 1-D slice
        strides = contiguous_strides(spec.shape) if ragged else dense_strides(spec.shape, grad)
        gspec = make_spec(spec.mesh, placements, spec.shape, strides, grad.dtype)
        return new_dtensor(grad, gspec, requires_grad=grad.requires_grad), None, None


class _Redistribute(torch.autograd.Function):
    """``dt`` as ``placements``, the collective run in ``op_dtype`` (the result's dtype); its
    gradient's collective runs in ``grad_dtype`` and the gradient returns in ``dt``'s dtype."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        dt: _UpstreamDTensor,
        placements: tuple[Placement, ...],
        async_op: bool,
        op_dtype: torch.dtype,
        grad_dtype: torch.dtype,
    ) -> DTensor:
        src = dt._spec
        ctx.src_placements = src.placements
        ctx.async_op = async_op
        ctx.dtypes = (grad_dtype, dt.dtype)
        local = dt._local_tensor
        if op_dtype != local.dtype:
            local = local.to(op_dtype)
            meta = src.tensor_meta
            assert meta is not None
            src = DTensorSpec(src.mesh, src.placements, tensor_meta=meta._replace(dtype=op_dtype))
        dst = DTensorSpec(src.mesh, placements, tensor_meta=src.tensor_meta)
        out = redistribute_local_tensor(local, src, dst, async_op=async_op)
        if out is dt._local_tensor:
            out = out.view_as(out)
        if _RECORDING[0]:
            record_redistribute(out, src.placements, placements)
        return new_dtensor(out, dst, requires_grad=dt.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: _UpstreamDTensor) -> tuple[Any, ...]:  # type: ignore[override]
        # A gradient is never turned back into a Partial it does not already have.
        target = tuple(
            Replicate() if s.is_partial() and not g.is_partial() else s
            for s, g in zip(ctx.src_placements, grad.placements)
        )
        grad_dtype, input_dtype = ctx.dtypes
        out = _Redistribute.apply(grad, target, ctx.async_op, grad_dtype, grad_dtype)
        return (out if out.dtype == input_dtype else out.to(input_dtype)), None, None, None, None


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: Any = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Distribute a global ``tensor`` (taken from coordinate 0) over ``device_mesh``."""
    mesh = _mesh(device_mesh, "distribute_tensor")
    if isinstance(tensor, _UpstreamDTensor):
        if tensor.device_mesh != mesh:
            raise ValueError(
                f"distribute_tensor: cannot distribute a DTensor on {tensor.device_mesh} to a "
                f"different device mesh {mesh}"
            )
        want = normalize_placements(
            placements, mesh, tensor.ndim, what="distribute_tensor", shape=tensor.shape
        )
        if tuple(want) != tuple(tensor.placements):
            raise ValueError(
                f"distribute_tensor: cannot distribute a DTensor with placements "
                f"{tensor.placements} to a different placements {want}; use .redistribute()"
            )
        raise TypeError(
            f"distribute_tensor: input is already a DTensor (placements {tensor.placements} "
            f"on {tensor.device_mesh}); use .redistribute() to change its placements"
        )
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"distribute_tensor: expected a torch.Tensor, got {type(tensor).__name__}")
    pl = normalize_placements(
        placements, mesh, tensor.ndim, what="distribute_tensor", shape=tensor.shape
    )
    if not tensor.is_leaf:
        raise RuntimeError(
            f"distribute_tensor: only leaf tensors can be distributed (got a non-leaf, made by "
            f"{type(tensor.grad_fn).__name__}, for {pl} on {mesh}): gradients would not reach "
            f"its source; distribute leaf tensors: the leaf, or tensor.detach()"
        )
    if find_ragged(pl) is not None:  # laid out with it as Replicate, then the local slice
        whole = distribute_tensor(
            tensor.detach(), mesh, replace_ragged(pl, Replicate()), src_data_rank=src_data_rank
        )
        if mesh.get_coordinate() is None:  # off the mesh: the empty local tensor
            spec = make_spec(mesh, pl, tensor.shape, tensor.stride(), tensor.dtype)
            return new_dtensor(whole._local_tensor, spec, requires_grad=tensor.requires_grad)
        out = redistribute_dtensor(whole, mesh, pl, async_op=False).detach()
        return out.requires_grad_(tensor.requires_grad)  # type: ignore[return-value]
    # Partial dims: first replicate, then partition locally
    upstream_pl = spec_placements(_grad_placements(pl))
    src = tensor.detach()
    if any(not p.is_shard() and mesh.size(i) > 1 for i, p in enumerate(upstream_pl)):
        src = src.clone()  # upstream broadcasts into its input on non-source ranks
    local = _upstream_distribute_tensor(
        src, mesh, upstream_pl, src_data_rank=src_data_rank
    )._local_tensor
    for mesh_dim, p in enumerate(pl):
        if p.is_partial() and mesh.get_coordinate() is not None:  # off the mesh: empty
            local = replicate_to_partial(local, p.reduce_op, mesh._sym_get_coordinate(mesh_dim))  # type: ignore[attr-defined]
    spec = make_spec(mesh, pl, tensor.shape, tensor.stride(), tensor.dtype)
    return new_dtensor(local.detach(), spec, requires_grad=tensor.requires_grad)


def from_local(
    local_tensor: torch.Tensor,
    device_mesh: Any = None,
    placements: Sequence[Placement] | None = None,
    *,
    run_check: bool = True,
    shape: torch.Size | Sequence[int] | None = None,
    stride: Sequence[int] | None = None,
    support_uneven: bool = True,
    async_input: bool = True,
    grad_placements: Sequence[Placement] | None = None,
) -> DTensor:
    """Build a DTensor from each rank's local shard (differentiable).

    Without ``shape``/``stride`` the global shape is the sum of the local sizes along every
    sharded mesh dim. ``run_check`` (default): one small all-gather of every rank's metadata
    (local shape, dtype, device type, placements, ``shape``/``stride``, its own argument
    errors) before any data collective; every rank applies the same checks and raises the
    same error naming the ranks that differ, then Replicate data is made consistent by
    broadcasting coordinate 0's local tensor (never in place). Without it, ``support_uneven``
    gathers the local sizes (one small all-gather per sharded mesh dim) and
    ``support_uneven=False`` assumes even shards (no communication); each rank checks only
    its own shard. ``async_input=False`` waits an in-flight async collective input first.
    Inside ``torch.compile`` nothing is communicated: shards are assumed even unless
    ``shape`` and ``stride`` are given, and ``run_check`` is skipped (the vescale backend's
    rank check compares each ``from_local`` call's local metadata across ranks before the
    graph's first run). A rank outside ``device_mesh`` gets an empty local tensor and
    communicates nothing (the global shape assumes even shards).
    """
    mesh = _mesh(device_mesh, "from_local")
    if isinstance(placements, Sequence) and find_ragged(placements) is not None:
        tracing = are_we_tracing()
        run_check = run_check and not env_flag("VESCALE_DISABLE_RUN_CHECK", False)
        run_check = run_check and not tracing and mesh.get_coordinate() is not None
        pl, gp, gshape, gstride = ragged_from_local_layout(
            local_tensor, mesh, placements, run_check=run_check, tracing=tracing, shape=shape,
            stride=stride, grad_placements=grad_placements,
            check_arguments=_from_local_arguments, device=_comm_device(mesh),
        )  # fmt: skip
        if not async_input:
            local_tensor = wait_local(local_tensor)
        spec = make_spec(mesh, pl, gshape, gstride, local_tensor.dtype)
        return _FromLocal.apply(local_tensor, spec, gp, run_check)  # type: ignore[no-any-return]
    tracing = are_we_tracing()  # no data-dependent communication inside a compiled graph
    outside = not tracing and mesh.get_coordinate() is None
    run_check = run_check and not env_flag("VESCALE_DISABLE_RUN_CHECK", False)
    run_check = run_check and mesh.device_type != "meta" and not tracing and not outside
    if run_check and dist.get_backend(mesh.get_group(0)) != "fake":
        return _checked_from_local(
            local_tensor, mesh, placements, shape, stride, grad_placements, async_input
        )
    pl, gp = _from_local_arguments(local_tensor, mesh, placements, shape, stride, grad_placements)
    if not async_input:
        local_tensor = wait_local(local_tensor)
    if shape is not None:
        gshape, gstride = torch.Size(shape), tuple(stride)  # type: ignore[arg-type]
    elif (
        support_uneven
        and not tracing
        and not outside
        and mesh.device_type != "meta"
        and any(p.is_shard() for p in pl)
    ):
        gshape = torch.Size(_gathered_global_shape(local_tensor, mesh, pl))
        gstride = dense_strides(gshape, local_tensor)
    else:
        s, st = compute_global_tensor_info(local_tensor, mesh, pl)
        gshape, gstride = torch.Size(s), tuple(st)
    check_interleaved(gshape, mesh, pl, what="from_local")
    spec = make_spec(mesh, pl, gshape, gstride, local_tensor.dtype)
    if not tracing and mesh.get_coordinate() is not None:
        expected = _local_shape(spec)
        if tuple(local_tensor.shape) != expected:
            raise ValueError(
                f"from_local: local shape {tuple(local_tensor.shape)} does not match the "
                f"shard {expected} of global shape {tuple(gshape)} with placements {pl} on {mesh}"
            )
    if outside:  # upstream's rule: an empty local tensor, no communication
        local_tensor = local_tensor.new_empty(0, requires_grad=local_tensor.requires_grad)
    return _FromLocal.apply(local_tensor, spec, gp, run_check)  # type: ignore[no-any-return]


def _from_local_arguments(
    local_tensor: Any,
    mesh: Any,
    placements: Sequence[Placement] | None,
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
    grad_placements: Sequence[Placement] | None,
    ndim: int | None = None,
) -> tuple[tuple[Placement, ...], tuple[Placement, ...] | None]:
    """``from_local``'s checks of its own arguments: (placements, grad placements) for a
    tensor of ``ndim`` dims (the local tensor's by default)."""
    if isinstance(local_tensor, _UpstreamDTensor):
        raise TypeError(
            f"from_local: expected the local torch.Tensor shard, got a DTensor (placements "
            f"{local_tensor.placements} on {local_tensor.device_mesh})"
        )
    if not isinstance(local_tensor, torch.Tensor):
        raise TypeError(f"from_local: expected a torch.Tensor, got {type(local_tensor).__name__}")
    if (shape is None) != (stride is None):
        raise ValueError(
            f"from_local: pass both shape and stride or neither (got shape={shape}, "
            f"stride={stride}); Please pass both shape and stride at the same time!"
        )
    ndim = local_tensor.ndim if ndim is None else ndim
    pl = normalize_placements(placements, mesh, ndim, what="from_local")
    if grad_placements is None:
        return pl, None
    gp = normalize_placements(grad_placements, mesh, ndim, what="from_local")
    return pl, spec_placements(gp)


def _checked_from_local(
    local_tensor: Any,
    mesh: Any,
    placements: Sequence[Placement] | None,
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
    grad_placements: Sequence[Placement] | None,
    async_input: bool,
) -> DTensor:
    """``from_local`` with ``run_check`` on a rank of ``mesh``: every rank's metadata in one
    small all-gather first (:mod:`vescale.dtensor.local_metadata`), the same checks and the
    same error everywhere, then the broadcast of Replicate data."""
    error: Exception | None = None
    pl: tuple[Placement, ...] | None = None
    gp = None
    try:
        pl, gp = _from_local_arguments(
            local_tensor, mesh, placements, shape, stride, grad_placements
        )
        given = (tuple(shape), tuple(stride)) if shape is not None else None  # type: ignore[arg-type]
    except Exception as e:  # raised on every rank after the exchange below, never here alone
        error, given = e, None
    mine = LocalRecord.of(local_tensor, pl if pl is not None else placements, given, error)
    records = gather_records(mine, mesh, _comm_device(mesh))

    def layout(gshape: tuple[int, ...]) -> tuple[Placement, ...]:
        check_interleaved(gshape, mesh, pl, what="from_local")  # type: ignore[arg-type]
        return spec_placements(pl)  # type: ignore[arg-type]

    gshape = torch.Size(check_records(records, mesh, pl, layout, own_error=error))
    assert pl is not None  # check_records raised otherwise
    if not async_input:
        local_tensor = wait_local(local_tensor)
    gstride = tuple(stride) if stride is not None else dense_strides(gshape, local_tensor)
    spec = make_spec(mesh, pl, gshape, gstride, local_tensor.dtype)
    return _FromLocal.apply(local_tensor, spec, gp, True)  # type: ignore[no-any-return]


def _local_shape(spec: DTensorSpec) -> tuple[int, ...]:
    shape, _ = compute_local_shape_and_global_offset(
        spec.shape, spec.mesh, spec.placements, skip_offset=True
    )
    return tuple(shape)


def to_local(
    dtensor: _UpstreamDTensor,
    *,
    grad_placements: Sequence[Placement] | None = None,
    async_output: bool = True,
) -> torch.Tensor:
    """The local shard (differentiable). ``async_output=False`` returns a waited plain tensor."""
    if not isinstance(dtensor, _UpstreamDTensor):
        raise TypeError(f"to_local: expected a DTensor, got {type(dtensor).__name__}")
    gp = (
        normalize_placements(grad_placements, dtensor.device_mesh, dtensor.ndim, what="to_local")
        if grad_placements is not None
        else None
    )
    return _ToLocal.apply(dtensor, gp, async_output)  # type: ignore[no-any-return]


def redistribute_dtensor(
    dtensor: _UpstreamDTensor,
    device_mesh: Any = None,
    placements: Sequence[Placement] | None = None,
    async_op: bool = True,
    *,
    forward_dtype: torch.dtype | None = None,
    backward_dtype: torch.dtype | None = None,
) -> DTensor:
    """``dtensor`` laid out as ``placements`` (differentiable; any pair of placements).

    ``async_op`` (veScale's positional default ``True``): the result may hold an in-flight
    collective, waited at its first use. As upstream's: ``forward_dtype`` casts the local
    tensor before the collective (the result has that dtype); ``backward_dtype`` is the dtype
    of the gradient's collective (default: ``dtensor``'s dtype, not ``forward_dtype``), the
    gradient always returned in ``dtensor``'s dtype."""
    if not isinstance(dtensor, _UpstreamDTensor):
        raise TypeError(f"redistribute: expected a DTensor, got {type(dtensor).__name__}")
    if placements is None:
        raise ValueError(
            f"redistribute: placements is required (DTensor has {dtensor.placements} on "
            f"{dtensor.device_mesh})"
        )
    mesh = device_mesh if device_mesh is not None else dtensor.device_mesh
    if mesh != dtensor.device_mesh:
        raise ValueError(
            f"redistribute: cannot move a DTensor from {dtensor.device_mesh} to another mesh {mesh}"
        )
    pl = normalize_placements(
        placements, mesh, dtensor.ndim, what="redistribute", shape=dtensor.shape
    )
    input_dtype = dtensor.dtype
    return _Redistribute.apply(  # type: ignore[no-any-return]
        dtensor,
        spec_placements(pl),
        async_op,
        forward_dtype or input_dtype,
        backward_dtype or input_dtype,
    )


def full_tensor(
    dtensor: _UpstreamDTensor, *, grad_placements: Sequence[Placement] | None = None
) -> torch.Tensor:
    """The global tensor on every rank, waited (differentiable)."""
    replicated = redistribute_dtensor(
        dtensor, placements=(Replicate(),) * dtensor.device_mesh.ndim, async_op=False
    )
    return to_local(replicated, grad_placements=grad_placements, async_output=False)


torch._dynamo.allow_in_graph(from_local)  # like upstream DTensor.from_local: one graph call


class DTensor(_UpstreamDTensor):
    """A distributed tensor; accepted everywhere an upstream ``DTensor`` is."""

    def __new__(cls, *args: Any, **kwargs: Any) -> DTensor:
        """Upstream's ``(local, spec, *, requires_grad)`` or veScale legacy's ``(local, mesh,
        placements, *, shape, dtype, requires_grad, stride)``: wraps ``local`` as this rank's
        shard (no communication, no check)."""
        return _construct(cls, *args, **kwargs)  # type: ignore[no-any-return]

    @property
    def placements(self) -> tuple[Placement, ...]:  # type: ignore[override]
        """The placements as users see them (``InterleavedShard`` where the spec has its layout)."""
        return user_placements(self._spec)

    from_local = staticmethod(from_local)  # type: ignore[assignment]

    def to_local(  # type: ignore[override]
        self,
        *,
        grad_placements: Sequence[Placement] | None = None,
        async_output: bool = True,
    ) -> torch.Tensor:
        """The local shard; ``async_output=False`` waits any in-flight collective first."""
        return to_local(self, grad_placements=grad_placements, async_output=async_output)

    def redistribute(  # type: ignore[override]
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        async_op: bool = True,
        *,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        """See :func:`vescale.redistribute_dtensor`."""
        return redistribute_dtensor(
            self,
            device_mesh,
            placements,
            async_op,
            forward_dtype=forward_dtype,
            backward_dtype=backward_dtype,
        )

    def full_tensor(  # type: ignore[override]
        self, *, grad_placements: Sequence[Placement] | None = None
    ) -> torch.Tensor:
        """The whole global tensor on every rank, waited."""
        return full_tensor(self, grad_placements=grad_placements)

    def tolist(self) -> Any:
        """veScale legacy's ``tolist``: this rank's local values as a (nested) list."""
        return self._local_tensor.tolist()

    def data_ptr(self) -> int:
        """The local shard's ``data_ptr()`` (for pointer-taking plug-in kernels); 0, as
        upstream's, while torch copies or pickles a DTensor (see ``__deepcopy__``)."""
        if _copying.on:
            return 0
        return wait_local(self._local_tensor).data_ptr()

    def __deepcopy__(self, memo: dict[int, Any]) -> DTensor:
        """torch's ``copy.deepcopy`` of a tensor subclass, which takes the wrapper-subclass
        path only for a ``data_ptr()`` of 0 (upstream's DTensor); the result is a
        ``vescale.DTensor`` (an ``nn.Parameter``'s stays a parameter)."""
        with _copying.scope(True):
            return super().__deepcopy__(memo)  # type: ignore[no-any-return]

    def __reduce_ex__(self, proto: Any) -> Any:
        """Pickling (``torch.save``): torch's, on the wrapper-subclass path as for
        ``__deepcopy__``; the local shard, spec and mesh are pickled with it."""
        with _copying.scope(True):
            return super().__reduce_ex__(proto)

    def __create_write_items__(self, fqn: str, object: Any) -> Any:
        """DCP save: a RaggedShard's slice as the boxes it covers (upstream's otherwise)."""
        if find_ragged(self._spec.placements) is None:
            return super().__create_write_items__(fqn, object)
        return ragged_write_items(fqn, self)

    def __create_chunk_list__(self) -> Any:
        """DCP load: the chunks of a RaggedShard's slice (upstream's otherwise)."""
        if find_ragged(self._spec.placements) is None:
            return super().__create_chunk_list__()
        return ragged_chunks(self)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        """DCP: the local data of chunk ``index`` (a view of a RaggedShard's slice)."""
        if find_ragged(self._spec.placements) is None:
            return super().__get_tensor_shard__(index)  # type: ignore[no-any-return]
        return ragged_shard_view(self, index)

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, Any], flatten_spec: Any, outer_size: Any, outer_stride: Any
    ) -> DTensor:
        out = _UpstreamDTensor.__tensor_unflatten__(
            inner_tensors, flatten_spec, outer_size, outer_stride
        )
        out.__class__ = DTensor
        out._spec = as_vescale_spec(out._spec)
        return out  # type: ignore[return-value]


# .on: DTensor.data_ptr() reads 0 (torch copying or pickling), so torch's copy and pickle code
# treats vescale DTensors as the wrapper subclasses they are
_copying = _ThreadFlag()


_upstream_wrap = OpDispatcher.wrap
_new_dtensor = _UpstreamDTensor.__new__  # C++ ``_dtensor__new__``: sets _local_tensor and _spec


_upstream_init = _UpstreamDTensor.__init__


def upstream_init(self: _UpstreamDTensor, *args: Any, **kwargs: Any) -> None:
    """Upstream ``DTensor.__init__``; a DTensor built around a vescale DTensor's spec (FSDP2
    rewraps a vescale parameter's shards so) is a ``vescale.DTensor``, as the outputs of its
    ops are (``nn.Parameter`` then keeps its class through ``detach``)."""
    _upstream_init(self, *args, **kwargs)
    if type(self) is _UpstreamDTensor and type(self._spec) is VescaleSpec:
        self.__class__ = DTensor


def new_dtensor(local: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool) -> DTensor:
    """A ``vescale.DTensor`` holding ``local`` laid out as ``spec`` (marked vescale's)."""
    spec = as_vescale_spec(spec)
    if torch.compiler.is_exporting():
        return DTensor(local, spec, requires_grad=requires_grad)  # type: ignore[call-arg]
    return _new_dtensor(DTensor, local, spec, requires_grad=requires_grad)  # type: ignore[return-value]


def wrap_output(res: object, spec: object) -> object:
    """Upstream's ``OpDispatcher.wrap``, producing ``vescale.DTensor`` for vescale specs.

    Outside ``torch.export`` a vescale output is built by ``__new__`` alone: upstream's
    ``__init__`` does nothing but pass through two Python wrappers (dynamo-disable and the
    export constructor hook), which cost ~1.2 us per op output.
    """
    if _RECORDING[0]:
        record_placements(res, spec)
    if isinstance(res, torch.Tensor):
        if type(spec) is VescaleSpec:
            return new_dtensor(res, spec, requires_grad=res.requires_grad)
        return _upstream_wrap(res, spec)
    if isinstance(res, list | tuple) and isinstance(spec, list | tuple):
        out = [wrap_output(r, s) for r, s in zip(res, spec)]
        return tuple(out) if isinstance(res, tuple) else out
    return _upstream_wrap(res, spec)


def wrap_local(local: torch.Tensor, mesh: Any, placements: Any, shape: Any) -> DTensor:
    """An op handler's local result as a DTensor of global ``shape`` (contiguous strides),
    with no communication (no shape gathering, no run check)."""
    return from_local(
        local,
        mesh,
        list(placements),
        run_check=False,
        shape=torch.Size(shape),
        stride=contiguous_strides(shape),
    )


def _construct(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``cls(...)`` with upstream's arguments, or legacy's ``(local, device_mesh, placements,
    *, shape, dtype, requires_grad, stride)``."""
    if (len(args) > 1 and isinstance(args[1], DTensorSpec)) or "spec" in kwargs:
        return _UpstreamDTensor.__new__(cls, *args, **kwargs)  # type: ignore[call-overload]
    return _construct_legacy(cls, *args, **kwargs)


def _construct_legacy(
    cls: type,
    local_tensor: torch.Tensor,
    device_mesh: Any,
    placements: Sequence[Any],
    *,
    shape: Sequence[int],
    dtype: torch.dtype,
    requires_grad: bool,
    stride: Sequence[int],
) -> Any:
    if requires_grad and not local_tensor.requires_grad:  # upstream warns the other way round
        warnings.warn(
            "To construct DTensor from torch.Tensor, it's recommended to use "
            "local_tensor.detach() and make requires_grad consistent.",
            stacklevel=3,
        )
    pl = normalize_placements(placements, device_mesh, len(shape), what="DTensor", shape=shape)
    spec = as_vescale_spec(make_spec(device_mesh, pl, shape, stride, dtype))
    return _UpstreamDTensor.__new__(cls, local_tensor, spec, requires_grad=requires_grad)  # type: ignore[call-overload]
