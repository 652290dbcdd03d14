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

import math
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._torch_compat import DTensorSpec
from vescale.dtensor.dtensor import wrap_local
from vescale.dtensor.explicit import redistribute_for
from vescale.dtensor.hooks import bypass_dispatch, python_dispatch
from vescale.dtensor.inflight import wait_local
from vescale.dtensor.layout import (
    chunk_sizes,
    contiguous_shards,
    local_range,
    sharding_mesh_dims,
    shards,
)
from vescale.dtensor.op_args import bind, unbind
from vescale.dtensor.ops._registry import (
    Collective,
    HandlerStrategy,
    declare_handler_strategies,
    handler_strategy,
    takes_over,
)
from vescale.dtensor.placement_types import Partial, Placement, Replicate, is_private_partial

__all__ = [
    "ELEMENTWISE_LOSSES",
    "global_mean_loss",
    "sharded_log_softmax",
    "sharded_log_softmax_backward",
    "sharded_nll_loss",
    "sharded_nll_loss_backward",
]

aten = torch.ops.aten
NONE, MEAN, SUM = 0, 1, 2  # torch's reduction enum
Placements = tuple[Placement, ...]

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
#
# Each handler's strategy (input layouts, output placements, collectives) is declared beside
# it (``declare_handler_strategies``): the handler runs exactly where one is declared, lays its
# inputs out as declared, and the planner prices the same strategy.


def _is_spec(a: object) -> bool:
    return isinstance(a, DTensorSpec)


def _sharded_dims(spec: Any, dim: int) -> list[int]:
    """Mesh dims sharding ``dim`` of ``spec`` (a non-scalar spec with no Partial), else []."""
    if not _is_spec(spec) or spec.ndim == 0 or any(p.is_partial() for p in spec.placements):
        return []
    return sharding_mesh_dims(spec.mesh, spec.placements, dim % spec.ndim)


def _row_bytes(spec: DTensorSpec, dim: int, dtype: torch.dtype) -> int:
    """Bytes of the largest local shard of ``spec``'s tensor reduced over ``dim`` (keepdim)."""
    shape = list(spec.shape)
    shape[dim] = 1
    for i, p in enumerate(spec.placements):
        if p.is_shard():
            d = p.dim  # type: ignore[attr-defined]
            shape[d] = chunk_sizes(shape[d], spec.mesh.size(i))[0]
    return math.prod(shape) * dtype.itemsize


def _laid_out(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[dict[str, Any], HandlerStrategy]:
    """``op``'s arguments by name, each tensor laid out as the handler's declared strategy
    says, and that strategy."""
    strategy = handler_strategy(op, args, kwargs)
    assert strategy is not None, f"{op}: its handler runs only where it declares a strategy"
    a = bind(op, args, kwargs)
    for name, placements in strategy.inputs.items():
        if placements is not None and tuple(a[name]._spec.placements) != placements:
            a[name] = redistribute_for(op, a[name], placements)
    return a, strategy


def _all_reduce(t: torch.Tensor, op: str, mesh: Any, mesh_dims: list[int]) -> torch.Tensor:
    """``t`` all-reduced over ``mesh_dims`` in turn; unchanged on a meta mesh (shapes only)."""
    if mesh.device_type == "meta":
        return t
    for mesh_dim in mesh_dims:
        t = wait_local(funcol.all_reduce(t, op, (mesh, mesh_dim)))
    return t


@declare_handler_strategies(aten._log_softmax.default, layout_arg="self")
def _log_softmax_strategy(op: torch._ops.OpOverload, a: dict[str, Any]) -> HandlerStrategy | None:
    """Over a sharded dim (no Partial, not ``half_to_float``): the input's placements, two
    all-reduces (max, sum) of the rows per sharding mesh dim."""
    x = a["self"]
    dims = _sharded_dims(x, a["dim"])
    if not dims or a["half_to_float"]:
        return None
    rows = _row_bytes(x, a["dim"] % x.ndim, x.tensor_meta.dtype)
    steps = tuple(Collective("all_reduce", d, rows) for _ in ("max", "sum") for d in dims)
    return HandlerStrategy({"self": tuple(x.placements)}, (tuple(x.placements),), steps)


@bypass_dispatch(aten._log_softmax.default, when=takes_over)
def sharded_log_softmax(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``_log_softmax`` over a sharded dim without gathering it (see above)."""
    a, _ = _laid_out(op, args, kwargs)
    x = a["self"]
    dim = a["dim"] % x.ndim
    mesh, mesh_dims = x.device_mesh, _sharded_dims(x._spec, dim)
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


@declare_handler_strategies(aten._log_softmax_backward_data.default, layout_arg="output")
def _log_softmax_backward_strategy(
    op: torch._ops.OpOverload, a: dict[str, Any]
) -> HandlerStrategy | None:
    """Over a sharded dim of ``output`` (no Partial, same dtype as the input): the gradient
    laid out as ``output``, one all-reduce of its row sums per sharding mesh dim."""
    out, grad = a["output"], a["grad_output"]
    dims = _sharded_dims(out, a["dim"])
    if not dims or not _is_spec(grad) or out.tensor_meta.dtype != a["input_dtype"]:
        return None
    p = tuple(out.placements)
    rows = _row_bytes(out, a["dim"] % out.ndim, grad.tensor_meta.dtype)
    steps = tuple(Collective("all_reduce", d, rows) for d in dims)
    return HandlerStrategy({"grad_output": p, "output": p}, (p,), steps)


@bypass_dispatch(aten._log_softmax_backward_data.default, when=takes_over)
def sharded_log_softmax_backward(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``grad - exp(out) * sum(grad, dim)`` with the sum all-reduced over the sharding mesh dims."""
    a, _ = _laid_out(op, args, kwargs)
    grad, out = a["grad_output"], a["output"]
    dim = a["dim"] % out.ndim
    g, o = wait_local(grad._local_tensor), wait_local(out._local_tensor)
    total = _all_reduce(
        g.sum(dim, keepdim=True), "sum", out.device_mesh, _sharded_dims(out._spec, dim)
    )
    return wrap_local(g - o.exp() * total, out.device_mesh, out.placements, out.shape)


def _sum_partial(p: Placement) -> bool:
    """A pending sum: ``nll`` is linear in its input, so the handler makes a pending sum of
    losses of it (its outputs are ``Partial()``); another pending reduction (an average, a
    max) is reduced first, by upstream's strategies."""
    return getattr(p, "reduce_op", None) == "sum" and not is_private_partial(p)


@declare_handler_strategies(
    [aten.nll_loss_forward.default, aten.nll_loss_backward.default], layout_arg="self"
)
def _nll_strategy(
    op: torch._ops.OpOverload, a: dict[str, Any]
) -> tuple[HandlerStrategy, ...] | None:
    """On ``(N, C)`` / ``(C,)`` input sharded (the class dim in contiguous shards; the batch
    dim interleaved too, as a flattened ``(batch, seq)`` split over two mesh dims is) or
    Partial over some mesh dim, target and weight DTensors: the target follows the input's
    batch sharding and is replicated elsewhere, the weight replicated (see above for the
    outputs). Beside it, for a batch-sharded input in contiguous shards and ``mean``/``sum``:
    the whole target (replicated), its rows sliced locally and the total weight counted
    from all of it, so no collective."""
    x, weight, reduction = a["self"], a["weight"], a["reduction"]
    if not (
        _is_spec(x)
        and _is_spec(a["target"])
        and (weight is None or _is_spec(weight))
        and x.ndim in (1, 2)
        and contiguous_shards([p for p in x.placements if shards(p, x.ndim - 1)])
        and any(not p.is_replicate() and x.mesh.size(i) > 1 for i, p in enumerate(x.placements))
        and all(_sum_partial(p) for p in x.placements if p.is_partial())
    ):
        return None
    mesh = x.mesh
    rep: Placements = (Replicate(),) * mesh.ndim
    batch = sharding_mesh_dims(mesh, x.placements, 0) if x.ndim == 2 else []
    target = tuple(p if x.ndim == 2 and shards(p, 0) else Replicate() for p in x.placements)
    # the replicated-target alternative (rows sliced by offset) needs contiguous batch shards
    whole = bool(batch) and reduction != NONE and contiguous_shards(x.placements)
    inputs: dict[str, Placements | None] = {"self": tuple(x.placements), "target": target}
    if weight is not None:
        inputs["weight"] = rep
    if op == aten.nll_loss_backward.default:
        if not _is_spec(a["grad_output"]):
            return None
        inputs["grad_output"] = target if reduction == NONE else rep
        if _is_spec(a["total_weight"]):  # the global weight for mean; unused otherwise
            inputs["total_weight"] = rep if reduction == MEAN else None
        grad_in = (tuple(Replicate() if p.is_partial() else p for p in x.placements),)
        return (HandlerStrategy(inputs, grad_in),) + (
            (HandlerStrategy({**inputs, "target": rep}, grad_in),) if whole else ()
        )
    class_dims = sharding_mesh_dims(mesh, x.placements, x.ndim - 1)
    partial = {i for i, p in enumerate(x.placements) if p.is_partial()}
    loss_dims = set(class_dims) | set(batch) | partial
    loss: Placements = (
        tuple(Partial() if i in loss_dims and i not in batch else p for i, p in enumerate(target))
        if reduction == NONE  # per-sample losses, sharded like the target over the batch
        else tuple(Partial() if i in loss_dims else Replicate() for i in range(mesh.ndim))
    )
    if reduction == MEAN:
        steps = tuple(Collective("all_reduce", d, x.tensor_meta.dtype.itemsize) for d in batch)
        first = HandlerStrategy(inputs, (loss, rep), steps)
    else:
        total = tuple(Partial() if i in batch else Replicate() for i in range(mesh.ndim))
        first = HandlerStrategy(inputs, (loss, total))
    # the whole target: its total weight counted on every rank, replicated
    return (first,) + ((HandlerStrategy({**inputs, "target": rep}, (loss, rep)),) if whole else ())


def _local_nll_args(
    a: dict[str, Any], strategy: HandlerStrategy
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(local input, the targets the total weight counts, local target, full weight, local
    weight): targets outside this rank's class range count as ignored. With the whole target
    (the replicated-target strategy) the local rows are sliced from it and every row counts."""
    x, ignore_index = a["self"], a["ignore_index"]
    local = wait_local(x._local_tensor)
    t = wait_local(a["target"]._local_tensor)
    rows = t
    if x.ndim == 2 and all(p.is_replicate() for p in strategy.inputs["target"] or ()):
        start, n = local_range(x.shape, x.device_mesh, x.placements, 0)
        rows = t[start : start + n]
    offset, _ = local_range(x.shape, x.device_mesh, x.placements, x.ndim - 1)
    n_local = local.shape[-1]
    w = None if a["weight"] is None else wait_local(a["weight"]._local_tensor)
    lt = rows - offset
    inside = (lt >= 0) & (lt < n_local) & (rows != ignore_index)
    lt = torch.where(inside, lt, torch.full_like(lt, ignore_index))
    return local, t, lt, w, None if w is None else w[offset : offset + n_local]


@bypass_dispatch(aten.nll_loss_forward.default, when=takes_over)
def sharded_nll_loss(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``nll_loss_forward`` on batch- and/or class-sharded input (see above)."""
    a, strategy = _laid_out(op, args, kwargs)
    reduction, ignore_index = a["reduction"], a["ignore_index"]
    local, t, lt, w, w_local = _local_nll_args(a, strategy)
    kernel_reduction = SUM if reduction == MEAN else reduction
    out, _ = aten.nll_loss_forward(local, lt, w_local, kernel_reduction, ignore_index)
    counted = t != ignore_index
    picked = (
        torch.ones_like(t, dtype=local.dtype)
        if w is None
        else w[torch.where(counted, t, 0)].to(local.dtype)
    )
    total = (picked * counted).sum()
    mesh = a["self"].device_mesh
    if reduction == MEAN:
        total = _all_reduce(total, "sum", mesh, [c.mesh_dim for c in strategy.collectives])
        out = out / total
    loss, total_placements = strategy.outputs
    shape = a["target"].shape if reduction == NONE else ()
    return wrap_local(out, mesh, loss, shape), wrap_local(total, mesh, total_placements, ())


@bypass_dispatch(aten.nll_loss_backward.default, when=takes_over)
def sharded_nll_loss_backward(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Local ``nll_loss_backward`` with the local class range and the global total weight."""
    a, strategy = _laid_out(op, args, kwargs)
    local, _, lt, _, w_local = _local_nll_args(a, strategy)
    g = wait_local(a["grad_output"]._local_tensor)
    total = a["total_weight"]
    if isinstance(total, _UpstreamDTensor):  # global for mean; unused by sum and none
        total = wait_local(total._local_tensor)
    out = aten.nll_loss_backward(g, local, lt, w_local, a["reduction"], a["ignore_index"], total)
    x = a["self"]
    return wrap_local(out, x.device_mesh, strategy.outputs[0], x.shape)
