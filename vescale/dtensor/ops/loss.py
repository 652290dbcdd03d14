"""Element-wise losses: operands laid out alike, and ``reduction="mean"`` over a sharded input
the mean of the global tensor, forward and backward.

Upstream has no strategy for these ops; its fallback runs the local kernel, whose mean
divides by the *local* element count: the backward is then off by the shard factor and the
forward is wrong for uneven shards; on operands of different layouts (a Replicate input, a
sharded target) its gradients are wrong too, also on upstream's own DTensors. Here every
operand of the input's shape (input, target, weight, per-element gradient) is first laid
out as one common layout: per mesh dim the first ``Shard`` among them (input first), else
``Replicate`` (a Replicate operand is then sliced locally; a Partial one, the loss being
nonlinear, is reduced; explicit mode applies). Then ``mean`` over a sharded input runs with
``reduction="sum"`` (a ``Partial`` sum forward, exact local gradients backward) scaled by
``1 / numel`` of the global input: exact for uneven shards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale.dtensor.dtensor import wrap_local
from vescale.dtensor.explicit import redistribute_for
from vescale.dtensor.hooks import bypass_dispatch, python_dispatch
from vescale.dtensor.inflight import wait_local
from vescale.dtensor.layout import contiguous_shards, local_range, sharding_mesh_dims
from vescale.dtensor.op_args import bind, unbind
from vescale.dtensor.placement_types import Partial, Placement, Replicate

__all__ = [
    "ELEMENTWISE_LOSSES",
    "global_mean_loss",
    "sharded_log_softmax",
    "sharded_log_softmax_backward",
    "sharded_nll_loss",
    "sharded_nll_loss_backward",
]

aten = torch.ops.aten
MEAN, SUM = 1, 2  # torch's reduction enum (none=0)

ELEMENTWISE_LOSSES = [
    aten.mse_loss.default,
    aten.mse_loss_backward.default,
    aten.smooth_l1_loss.default,
    aten.smooth_l1_loss_backward.default,
    aten.huber_loss.default,
    aten.huber_loss_backward.default,
    aten.soft_margin_loss.default,
    aten.soft_margin_loss_backward.default,
    aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_backward.default,
]


def _sharded(t: object) -> bool:
    return isinstance(t, _UpstreamDTensor) and any(
        p.is_shard() and t.device_mesh.size(i) > 1 for i, p in enumerate(t.placements)
    )


def _common_layout(layouts: list[tuple[Placement, ...]]) -> list[Placement]:
    """Per mesh dim, the first ``Shard`` of ``layouts``, else ``Replicate``."""
    return [next((p for p in dim if p.is_shard()), Replicate()) for dim in zip(*layouts)]


@bypass_dispatch(
    ELEMENTWISE_LOSSES,
    when=lambda op, a, kw: isinstance(bind(op, a, kw)["self"], _UpstreamDTensor),
)
def global_mean_loss(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``op`` on operands laid out alike, its mean over the global input (module docstring)."""
    bound = bind(op, args, kwargs)
    inp = bound["self"]
    alike = [
        n for n, a in bound.items() if isinstance(a, _UpstreamDTensor) and a.shape == inp.shape
    ]
    layout = _common_layout([tuple(bound[n].placements) for n in alike])
    for n in alike:
        bound[n] = redistribute_for(op, bound[n], layout)
    if bound["reduction"] != MEAN or not _sharded(bound["self"]):
        return python_dispatch(op, *unbind(op, bound))
    bound["reduction"] = SUM
    return python_dispatch(op, *unbind(op, bound)) * (1.0 / inp.numel())


# ---- log_softmax and nll_loss on class-sharded input ------------------------------------
#
# ``F.cross_entropy`` is ``_log_softmax`` + ``nll_loss_forward``. Upstream gathers logits
# sharded over the class dim to Replicate (a vocabulary-sized all-gather). Here:
#
# * ``_log_softmax`` over a sharded dim: local max and sum of exponentials, all-reduced (MAX,
#   then SUM) over the mesh dims sharding it: two all-reduces of the output size without that
#   dim. The output keeps the input's placements. Its backward all-reduces one sum likewise.
# * ``nll_loss_forward`` on ``(N, C)`` / ``(C,)`` input, sharded or ``Partial`` (linear): each
#   rank picks the targets inside its class range (others count as ignored), so the loss is
#   ``Partial`` over the class-sharding, batch-sharding and Partial mesh dims, with no
#   communication for ``sum``/``none``. ``mean`` divides by the *global* total weight: one
#   scalar all-reduce over the batch-sharding mesh dims (upstream averaged local means, wrong
#   when ranks hold different numbers of ignored targets, and refused uneven batches).
#   ``total_weight`` is that global weight for ``mean`` (``Partial`` otherwise).
# * ``nll_loss_backward``: local, with the local target range and the global total weight.


def _mesh_dims_sharding(t: _UpstreamDTensor, dim: int) -> list[int]:
    return sharding_mesh_dims(t.device_mesh, t.placements, dim)


def _shard_only(t: object) -> bool:
    return isinstance(t, _UpstreamDTensor) and not any(p.is_partial() for p in t.placements)


def _all_reduce(t: torch.Tensor, op: str, mesh: Any, mesh_dims: list[int]) -> torch.Tensor:
    """``t`` all-reduced over ``mesh_dims`` in turn; unchanged on a meta mesh (shapes only)."""
    if mesh.device_type == "meta":
        return t
    for mesh_dim in mesh_dims:
        t = wait_local(funcol.all_reduce(t, op, (mesh, mesh_dim)))
    return t


def _over_sharded_dim(x: Any, dim: int) -> bool:
    """``x`` a non-scalar DTensor, none of its placements Partial, sharded along ``dim``."""
    return _shard_only(x) and x.ndim > 0 and bool(_mesh_dims_sharding(x, dim % x.ndim))


def _log_softmax_applies(op: torch._ops.OpOverload, args: Any, kwargs: Any) -> bool:
    a = bind(op, args, kwargs)
    return _over_sharded_dim(a["self"], a["dim"]) and not a["half_to_float"]


@bypass_dispatch(aten._log_softmax.default, when=_log_softmax_applies)
def sharded_log_softmax(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``_log_softmax`` over a sharded dim without gathering it (see above)."""
    a = bind(op, args, kwargs)
    x = a["self"]
    dim = a["dim"] % x.ndim
    mesh, mesh_dims = x.device_mesh, _mesh_dims_sharding(x, dim)
    local = wait_local(x._local_tensor)
    empty = local.shape[dim] == 0
    shift = (
        torch.full_like(local.sum(dim, keepdim=True), float("-inf"))
        if empty
        else local.amax(dim, keepdim=True)
    )
    shift = _all_reduce(shift, "max", mesh, mesh_dims)
    total = _all_reduce((local - shift).exp().sum(dim, keepdim=True), "sum", mesh, mesh_dims)
    return wrap_local(local - shift - total.log(), x.device_mesh, x.placements, x.shape)


def _log_softmax_backward_applies(op: torch._ops.OpOverload, args: Any, kwargs: Any) -> bool:
    a = bind(op, args, kwargs)
    out = a["output"]
    return _over_sharded_dim(out, a["dim"]) and out.dtype == a["input_dtype"]


@bypass_dispatch(aten._log_softmax_backward_data.default, when=_log_softmax_backward_applies)
def sharded_log_softmax_backward(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``grad - exp(out) * sum(grad, dim)`` with the sum all-reduced over the sharding mesh dims."""
    a = bind(op, args, kwargs)
    grad, out = a["grad_output"], a["output"]
    dim = a["dim"] % out.ndim
    grad = redistribute_for(op, grad, out.placements)
    g, o = wait_local(grad._local_tensor), wait_local(out._local_tensor)
    total = _all_reduce(
        g.sum(dim, keepdim=True), "sum", out.device_mesh, _mesh_dims_sharding(out, dim)
    )
    return wrap_local(g - o.exp() * total, out.device_mesh, out.placements, out.shape)


def _nll_layout(x: _UpstreamDTensor) -> tuple[list[int], list[int], int]:
    """(class-sharding mesh dims, batch-sharding mesh dims, global offset of the local classes)."""
    class_dim = 1 if x.ndim == 2 else 0
    start, _ = local_range(x.shape, x.device_mesh, x.placements, class_dim)
    batch = _mesh_dims_sharding(x, 0) if x.ndim == 2 else []
    return _mesh_dims_sharding(x, class_dim), batch, start


def _local_target(
    target: torch.Tensor, offset: int, n_local: int, ignore_index: int
) -> torch.Tensor:
    local = target - offset
    inside = (local >= 0) & (local < n_local) & (target != ignore_index)
    return torch.where(inside, local, torch.full_like(local, ignore_index))


def _nll_inputs(
    op: torch._ops.OpOverload, x: _UpstreamDTensor, target: Any, weight: Any
) -> tuple[torch.Tensor, torch.Tensor | None, list[Placement]]:
    """(target, full class weight or None, target placements): the target follows the batch
    placements of ``x`` and is replicated over its class-sharding mesh dims."""
    want = [p if x.ndim == 2 and p.is_shard(0) else Replicate() for p in x.placements]
    target = redistribute_for(op, target, want)
    if weight is not None:
        weight = wait_local(
            redistribute_for(op, weight, [Replicate()] * x.device_mesh.ndim)._local_tensor
        )
    return wait_local(target._local_tensor), weight, want


def _nll_applies(op: torch._ops.OpOverload, args: Any, kwargs: Any) -> bool:
    """Sharded or Partial (nll is linear in its input) ``(N, C)`` / ``(C,)`` input."""
    a = bind(op, args, kwargs)
    x, target = a["self"], a["target"]
    return (
        isinstance(x, _UpstreamDTensor)
        and isinstance(target, _UpstreamDTensor)
        and x.ndim in (1, 2)
        and contiguous_shards(x.placements)
        and any(
            not p.is_replicate() and x.device_mesh.size(i) > 1 for i, p in enumerate(x.placements)
        )
    )


@bypass_dispatch(aten.nll_loss_forward.default, when=_nll_applies)
def sharded_nll_loss(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``nll_loss_forward`` on batch- and/or class-sharded input (see above)."""
    x, target, weight, reduction, ignore_index = bind(op, args, kwargs).values()
    class_dims, batch_dims, offset = _nll_layout(x)
    t, w, t_placements = _nll_inputs(op, x, target, weight)
    local = wait_local(x._local_tensor)
    n_local = local.shape[-1 if x.ndim == 2 else 0]
    w_local = None if w is None else w[offset : offset + n_local]
    lt = _local_target(t, offset, n_local, ignore_index)
    kernel_reduction = SUM if reduction == MEAN else reduction
    out, _ = torch.ops.aten.nll_loss_forward(local, lt, w_local, kernel_reduction, ignore_index)
    counted = t != ignore_index
    picked = (
        torch.ones_like(t, dtype=local.dtype)
        if w is None
        else w[torch.where(counted, t, 0)].to(local.dtype)
    )
    total = (picked * counted).sum()
    mesh = x.device_mesh
    partial_dims = [i for i, p in enumerate(x.placements) if p.is_partial()]
    loss_dims = set(class_dims) | set(batch_dims) | set(partial_dims)
    partial = [Partial() if i in loss_dims else Replicate() for i in range(mesh.ndim)]
    if reduction == MEAN:
        total = _all_reduce(total, "sum", mesh, batch_dims)
        out = out / total
        total_placements: list[Placement] = [Replicate()] * mesh.ndim
    else:
        total_placements = [Partial() if i in batch_dims else Replicate() for i in range(mesh.ndim)]
    if reduction == 0:  # none: per-sample losses, sharded like the target over the batch
        out_placements = [
            Partial() if i in loss_dims and i not in batch_dims else p
            for i, p in enumerate(t_placements)
        ]
        out_t = wrap_local(out, x.device_mesh, out_placements, target.shape)
    else:
        out_t = wrap_local(out, x.device_mesh, partial, ())
    return out_t, wrap_local(total, x.device_mesh, total_placements, ())


@bypass_dispatch(aten.nll_loss_backward.default, when=_nll_applies)
def sharded_nll_loss_backward(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Local ``nll_loss_backward`` with the local class range and the global total weight."""
    grad, x, target, weight, reduction, ignore_index, total = bind(op, args, kwargs).values()
    _, _, offset = _nll_layout(x)
    t, w, t_placements = _nll_inputs(op, x, target, weight)
    mesh = x.device_mesh
    grad_placements = t_placements if reduction == 0 else [Replicate()] * mesh.ndim
    g = wait_local(redistribute_for(op, grad, grad_placements)._local_tensor)
    if isinstance(total, _UpstreamDTensor):  # global for mean; unused by sum and none
        total = wait_local(total._local_tensor)
    local = wait_local(x._local_tensor)
    n_local = local.shape[-1 if x.ndim == 2 else 0]
    w_local = None if w is None else w[offset : offset + n_local]
    lt = _local_target(t, offset, n_local, ignore_index)
    out = torch.ops.aten.nll_loss_backward(g, local, lt, w_local, reduction, ignore_index, total)
    return wrap_local(
        out, x.device_mesh, [Replicate() if p.is_partial() else p for p in x.placements], x.shape
    )
