"""Strategies for CPU ``scaled_dot_product_attention`` (``_scaled_dot_product_flash_attention_for_cpu``
and its backward), registered into upstream's sharding propagator so eager and compiler share them.

Per mesh dim, attention on ``(batch, heads, seq, head_dim)`` inputs runs without
communication when q, k, v (and the output, logsumexp and gradients) are all

* ``Replicate``;
* ``Shard(1)``: tensor parallelism over heads;
* ``Shard(0)``: data parallelism over the batch;
* forward only: ``Partial`` v (q, k replicated) gives a ``Partial`` output, attention being
  linear in v; logsumexp, which does not depend on v, stays replicated.

An ``attn_mask`` follows the sharded dim when it has that dim with size > 1 and is
replicated when it broadcasts over it. Any other input layout is redistributed to the
cheapest of these (or raises in explicit mode). A sharding that would leave some rank an
empty shard (5 heads on 4 ranks: 2, 2, 1, 0) is not offered: the CPU kernel dies of a
floating-point exception on empty inputs.

The math path (``sdpa_kernel(SDPBackend.MATH)``, ``aten._scaled_dot_product_attention_math``)
is a CompositeImplicitAutograd decomposition that DTensor's dispatch never sees whole: with
``is_causal`` it builds a plain causal mask and adds it to the DTensor scores. For vescale
DTensors :func:`sdpa_math`, an autograd-level kernel in the seam, passes that mask as a
replicated DTensor, and refuses a plain ``attn_mask`` with an error naming the layout.
(Inference mode skips autograd kernels; upstream DTensor's matmul fails there anyway.)

Dropout's random state: on CPU (the math path) the mask is a DTensor random op, one device's
values; the CUDA flash / memory-efficient kernels draw each (batch, head) shard's mask at its
own Philox offsets (:mod:`vescale.dtensor.random`, ``sdpa_dropout_spec``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._torch_compat import (
    DTensorSpec,
    OpSchema,
    OpStrategy,
    expand_to_full_mesh_op_strategy,
)
from vescale.dtensor.dtensor import DTensor, wrap_local
from vescale.dtensor.layout import empty_shard_dims
from vescale.dtensor.ops._registry import register_kernel, register_strategy
from vescale.dtensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["no_empty_shard", "sdpa_cpu_backward_strategy", "sdpa_cpu_strategy", "sdpa_math"]

aten = torch.ops.aten


def _mask_placement(schema: OpSchema, dim: int) -> list[Placement]:
    """Placement of ``attn_mask`` when q/k/v are sharded on ``dim`` of their 4 dims ([] if
    there is no mask)."""
    mask = schema.kwargs_schema.get("attn_mask")
    if not isinstance(mask, OpStrategy):
        return []
    shape = mask.shape
    mask_dim = dim - (4 - len(shape))
    if mask_dim >= 0 and shape[mask_dim] > 1:
        return [Shard(mask_dim)]
    return [Replicate()]


def no_empty_shard(input_specs: list[DTensorSpec], _outputs: object) -> bool:
    """No rank of the mesh holds an empty shard of any input."""
    return not any(s.tensor_meta is not None and empty_shard_dims(s) for s in input_specs)


def _sharded(schema: OpSchema, dim: int, n: int) -> list[Placement | None]:
    """``n`` outputs/inputs sharded on ``dim``, then the mask's placement."""
    return [*[Shard(dim)] * n, *_mask_placement(schema, dim)]


def _replicated(schema: OpSchema, n: int) -> list[Placement | None]:
    return [*[Replicate()] * n, *([Replicate()] if _mask_placement(schema, 0) else [])]


@register_strategy(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_cpu_strategy(schema: OpSchema) -> Any:
    """(out, logsumexp) from (q, k, v[, attn_mask])."""
    strategies = [
        _replicated(schema, 5),
        _sharded(schema, 1, 5),
        _sharded(schema, 0, 5),
        [Partial(), Replicate(), Replicate(), Replicate(), Partial(), *_replicated(schema, 0)],
    ]
    return expand_to_full_mesh_op_strategy(
        schema.get_mesh_from_args(),
        schema,
        strategies,
        input_index=2,
        is_valid_strategy_cb=no_empty_shard,
    )


@register_strategy(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def sdpa_cpu_backward_strategy(schema: OpSchema) -> Any:
    """(grad_q, grad_k, grad_v) from (grad_out, q, k, v, out, logsumexp[, attn_mask])."""
    strategies = [
        _replicated(schema, 9),
        _sharded(schema, 1, 9),
        _sharded(schema, 0, 9),
    ]
    return expand_to_full_mesh_op_strategy(
        schema.get_mesh_from_args(validate=False),
        schema,
        strategies,
        input_index=3,
        is_valid_strategy_cb=no_empty_shard,
    )


_MATH = aten._scaled_dot_product_attention_math.default


def _causal_mask(query: torch.Tensor, key: torch.Tensor, on: _UpstreamDTensor) -> DTensor:
    """The math kernel's causal mask (0 on and below the diagonal, -inf above, in the query's
    dtype) as a DTensor replicated on ``on``'s mesh, built locally."""
    length, source = query.shape[-2], key.shape[-2]
    device = on._local_tensor.device
    keep = torch.ones(length, source, dtype=torch.bool, device=device).tril()
    mask = torch.zeros(length, source, dtype=query.dtype, device=device)
    mask.masked_fill_(keep.logical_not(), float("-inf"))
    mesh = on.device_mesh
    return wrap_local(mask, mesh, [Replicate()] * mesh.ndim, mask.shape)


def _plain_mask_error(qkv: tuple[torch.Tensor, ...], mask: torch.Tensor, on: Any) -> RuntimeError:
    layout = ", ".join(
        f"{name} {tuple(t.placements) if isinstance(t, _UpstreamDTensor) else 'torch.Tensor'}"
        for name, t in zip(("query", "key", "value"), qkv)
    )
    return RuntimeError(
        f"{_MATH}: attn_mask of shape {tuple(mask.shape)} is a torch.Tensor while {layout} on "
        f"{on.device_mesh}; make the mask a DTensor on that mesh (e.g. "
        "vescale.distribute_tensor(mask, mesh, [Replicate()]))"
    )


def sdpa_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    dropout_mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    """``aten._scaled_dot_product_attention_math``: upstream's decomposition, with the causal
    mask a replicated DTensor when q, k or v is a vescale DTensor (results equal one device's).
    A plain ``attn_mask`` of more than one element next to those raises."""
    qkv = (query, key, value)
    on = next((t for t in qkv if isinstance(t, DTensor)), None)
    if on is not None:
        if (
            isinstance(attn_mask, torch.Tensor)
            and not isinstance(attn_mask, _UpstreamDTensor)
            and attn_mask.numel() > 1
        ):
            raise _plain_mask_error(qkv, attn_mask, on)
        if is_causal and attn_mask is None:
            attn_mask, is_causal = _causal_mask(query, key, on), False
    return _MATH.decompose(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        dropout_mask,
        scale=scale,
        enable_gqa=enable_gqa,
    )


register_kernel(
    _MATH,
    ("AutogradCPU", "AutogradCUDA", "AutogradMeta"),
    sdpa_math,
    "vescale DTensors: the math SDPA decomposition adds its causal mask as a replicated "
    "DTensor (upstream adds a plain tensor: 'got mixed torch.Tensor and DTensor'); all "
    "other inputs run the decomposition unchanged",
)
