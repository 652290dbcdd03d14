"""Optimizers built before :func:`vescale.parallelize`: refused at their first step.

``parallelize`` replaces a model's parameters by DTensors (or, deferred, by materialized
tensors): an optimizer built over the originals would update tensors the model no longer
uses and train only the parameters that stayed. :func:`record` keeps (weakly) each replaced
parameter and its name; a global optimizer step pre-hook (installed through
``vescale._patches``) raises :class:`StaleOptimizerError` naming the first replaced parameter
an optimizer holds, at that optimizer's first step, on every rank that built it so. An
optimizer is checked again only when its parameter count changes (``add_param_group``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from vescale._patches import set_entry
from vescale._torch_compat import global_optimizer_pre_hooks

__all__ = ["StaleOptimizerError", "record", "refuse_replaced"]

_replaced: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_names: dict[int, str] = {}
_checked: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


class StaleOptimizerError(RuntimeError):
    """An optimizer holds a parameter that :func:`vescale.parallelize` replaced."""


def params_of(model: nn.Module) -> dict[int, tuple[str, torch.Tensor]]:
    """``model``'s parameters by id, with their names."""
    return {id(p): (n, p) for n, p in model.named_parameters(remove_duplicate=False)}


def record(before: dict[int, tuple[str, torch.Tensor]], model: nn.Module) -> None:
    """Remember the parameters of ``before`` (:func:`params_of`) that ``model`` no longer has."""
    now = {id(p) for p in model.parameters()}
    for key, (name, p) in before.items():
        if key not in now:
            _replaced[key] = p
            _names[key] = name
    for key in [k for k in _names if k not in _replaced]:  # parameters since freed
        del _names[key]


def refuse_replaced(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The step pre-hook: :class:`StaleOptimizerError` if ``optimizer`` holds a replaced
    parameter."""
    if not _replaced:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if _checked.get(optimizer) == len(params):
        return
    for p in params:
        if _replaced.get(id(p)) is p:
            raise StaleOptimizerError(
                f"{type(optimizer).__name__}.step: the optimizer holds parameter "
                f"{_names[id(p)]!r} as it was before vescale.parallelize, which replaced it "
                "(the model now trains its DTensor shards): build the optimizer after "
                "vescale.parallelize, from the returned module's parameters()"
            )
    _checked[optimizer] = len(params)


set_entry(
    global_optimizer_pre_hooks,
    "torch.optim.optimizer._global_optimizer_pre_hooks",
    "vescale_stale_parameters",
    refuse_replaced,
    "an optimizer step over parameters vescale.parallelize replaced raises StaleOptimizerError "
    "(nothing else: a no-op until parallelize replaced a parameter)",
)
