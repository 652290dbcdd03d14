"""FLOPs of a graph node by ``torch.utils.flop_counter``'s formulas (the ones
``FlopCounterMode`` counts with): matrix products, convolutions and every fused attention
kernel (flash, efficient, cuDNN, flex; forward and backward), on the node's ``meta["val"]``
arguments. A causal attention (``is_causal=True``) computes half of the dense score matrix:
half the formula's count. Every other op: 0."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.fx.operator_schemas import normalize_function
from torch.utils.flop_counter import flop_registry

__all__ = ["flop_formula", "node_flops"]

_aten = torch.ops.aten
# CPU's fused attention kernels, which upstream's registry lacks: their arguments lead as the
# flash kernels' do (query, key, value, ...; backward: grad_out, query, key, value, ...)
_SAME_AS: dict[Any, Any] = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        _aten._scaled_dot_product_flash_attention_backward
    ),
}


def flop_formula(target: object) -> Callable[..., Any] | None:
    """The registry's formula for ``target`` (an op overload, its packet or a higher-order op)."""
    packet = getattr(target, "overloadpacket", target)
    return flop_registry.get(_SAME_AS.get(packet, packet))


def _val(a: torch.fx.Node) -> Any:
    return a.meta.get("val")


def _is_causal(target: Any, args: Any, kwargs: Any) -> bool:
    if not hasattr(target, "overloadpacket"):  # an op overload has a schema to bind to
        return False
    bound = normalize_function(target, args, kwargs, normalize_to_only_use_kwargs=True)
    return bool(bound is not None and bound.kwargs.get("is_causal", False))


def node_flops(node: torch.fx.Node) -> float:
    """FLOPs of ``node`` (see module docstring); a symbolic count at its size hint."""
    formula = flop_formula(node.target)
    if formula is None:
        return 0.0
    args = torch.fx.node.map_arg(node.args, _val)
    kwargs = torch.fx.node.map_arg(node.kwargs, _val)
    flops = formula(*args, **kwargs, out_val=_val(node))
    count = float(optimization_hint(flops) if isinstance(flops, torch.SymInt) else flops)
    return count / 2 if _is_causal(node.target, args, kwargs) else count
