"""``fully_shard(module, mesh)``: FSDP over one flat buffer per module (see :mod:`.group`).

Call it on each block, then on the root (as upstream's ``torch.distributed.fsdp.fully_shard``);
each call takes the parameters of ``module`` not already taken by an inner call. Hooks:

* forward pre-hook: wait for this module's all-gather (issued now if no one prefetched it),
  issue the next module's (the order of the previous forward), swap the unsharded views in;
* forward post-hook: swap the sharded parameters back; free the gathered buffer
  (``reshard_after_forward``, default ``True`` except for the root, whose buffer backward
  needs first) and arm a hook on the outputs that re-gathers it when their gradient arrives
  and prefetches the module before it;
* backward: one reduce-scatter per module (``_Unshard.backward``), then the buffer is freed.

Under ``torch.compile`` the hooks stay eager (``torch.compiler.disable``): the module's
compute compiles into graphs between them, and the collectives are issued by the hooks as in
eager (the backend's passes see none of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor as _UpstreamDTensor
from torch.utils._pytree import tree_flatten, tree_map

from vescale.fsdp.group import FlatGroup

__all__ = ["MixedPrecisionPolicy", "flat_group", "fully_shard"]


@dataclass
class _Schedule:
    """Groups in the order their forward began (recorded anew each forward, used next)."""

    order: list[FlatGroup] = field(default_factory=list)
    recording: list[FlatGroup] = field(default_factory=list)

    def after(self, group: FlatGroup, step: int) -> FlatGroup | None:
        if group not in self.order:
            return None
        i = self.order.index(group) + step
        return self.order[i] if 0 <= i < len(self.order) else None


_ACTIVE: list[_Schedule] = []  # the root's schedule while a forward runs


def flat_group(module: nn.Module) -> FlatGroup:
    """The :class:`FlatGroup` ``fully_shard`` made for ``module``."""
    group = getattr(module, "_vescale_flat_group", None)
    if group is None:
        raise ValueError(f"flat_group: {type(module).__name__} was not passed to fully_shard")
    return group  # type: ignore[no-any-return]


def _taken(module: nn.Module) -> set[int]:
    """Ids of the parameters inner ``fully_shard`` calls took."""
    out: set[int] = set()
    for sub in module.modules():
        group = getattr(sub, "_vescale_flat_group", None)
        if group is not None:
            out.update(id(p) for p in group.sharded)
    return out


def fully_shard(
    module: nn.Module,
    mesh: Any,
    *,
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters (those no inner ``fully_shard`` took) over the 1-D
    ``mesh`` in one flat buffer (in place; returns ``module``). Every rank must hold the same
    full parameters. ``reshard_after_forward``: free the gathered buffer after forward
    (default: ``True``, ``False`` for the module whose forward runs outermost).
    ``mp_policy``: ``param_dtype`` (compute dtype of the gathered parameters; the shard stays
    the master copy) and ``reduce_dtype`` (of the gradient reduce-scatter); its
    ``output_dtype`` and ``cast_forward_inputs`` are not supported."""
    if mesh.ndim != 1:
        raise ValueError(
            f"fully_shard: mesh must be 1-D, got {mesh}; pass the data-parallel sub-mesh "
            "(mesh['dp'])"
        )
    if getattr(module, "_vescale_flat_group", None) is not None:
        raise ValueError(f"fully_shard: {type(module).__name__} is already fully_shard-ed")
    policy = mp_policy or MixedPrecisionPolicy()
    if policy.output_dtype is not None:
        raise ValueError("fully_shard: mp_policy.output_dtype is not supported; leave it None")
    taken = _taken(module)
    owners: list[tuple[nn.Module, str, nn.Parameter]] = []
    names: list[str] = []
    seen: set[int] = set()
    for mod_name, sub in module.named_modules():
        for attr, p in sub.named_parameters(recurse=False):
            if id(p) in taken:
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            if id(p) in seen:
                raise ValueError(
                    f"fully_shard: parameter {name!r} is shared with another module attribute "
                    "(tied weights are not supported); untie it"
                )
            if isinstance(p, _UpstreamDTensor):
                raise ValueError(
                    f"fully_shard: parameter {name!r} is already a DTensor "
                    f"({p.placements}); fully_shard takes plain parameters"
                )
            seen.add(id(p))
            owners.append((sub, attr, p))
            names.append(name)
    if not owners:
        raise ValueError(f"fully_shard: {type(module).__name__} has no parameters left to shard")
    group = FlatGroup(
        owners,
        names,
        mesh,
        param_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
    )
    module._vescale_flat_group = group  # type: ignore[assignment]
    state = _State(group, reshard_after_forward, policy.cast_forward_inputs)
    module.register_forward_pre_hook(state.pre_forward, with_kwargs=True)
    module.register_forward_hook(state.post_forward, always_call=True)
    return module


class _State:
    """The hooks of one ``fully_shard`` module."""

    def __init__(self, group: FlatGroup, reshard: bool | None, cast_inputs: bool) -> None:
        self.group = group
        self.reshard = reshard
        self.cast_inputs = cast_inputs and group.compute_dtype != group.shard.dtype
        self.schedule = _Schedule()
        self.is_root = False

    @torch.compiler.disable  # eager collectives between compiled graphs (see the module doc)
    def pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        self.is_root = not _ACTIVE
        if self.is_root:
            _ACTIVE.append(self.schedule)
        schedule = _ACTIVE[0]
        schedule.recording.append(self.group)
        self.group.check_storage()
        views = self.group.unshard()
        following = schedule.after(self.group, 1)
        if following is not None:
            following.gather()
        for (owner, attr), view in zip(self.group.owners, views):
            owner._parameters[attr] = view  # type: ignore[assignment]
        if self.cast_inputs:
            dtype = self.group.compute_dtype
            args, kwargs = tree_map(
                lambda x: x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x,
                (args, kwargs),
            )
        return args, kwargs

    @torch.compiler.disable
    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        group = self.group
        for (owner, attr), p in zip(group.owners, group.sharded):
            owner._parameters[attr] = p
        schedule = _ACTIVE[0]
        if self.is_root:
            _ACTIVE.clear()
            schedule.order, schedule.recording = schedule.recording, []
        reshard = self.reshard if self.reshard is not None else not self.is_root
        if output is None or not torch.is_grad_enabled():  # None: forward raised
            group.free()
            return output
        if reshard:
            group.free()
        tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _grads: self.pre_backward(schedule), mode="any"
            )
        return output

    def pre_backward(self, schedule: _Schedule) -> None:
        self.group.wait()
        previous = schedule.after(self.group, -1)
        if previous is not None:
            previous.gather()
