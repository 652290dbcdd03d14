"""``fully_shard(module, *, mesh=...)``: FSDP over one flat buffer per module (see :mod:`.group`).

Call it on each block, then on the root (as upstream's ``torch.distributed.fsdp.fully_shard``);
each call takes the parameters of ``module`` not already taken by an inner call, and turns
``module`` into an :class:`FSDPModule` (its class becomes ``FSDP<Class>``). Hooks:

* forward pre-hook: wait for this module's all-gather (issued now if no one prefetched it),
  issue the next modules' (``set_modules_to_forward_prefetch``, else the order of the previous
  forward), swap the unsharded views in;
* forward post-hook: swap the sharded parameters back; free the gathered buffer
  (``reshard_after_forward``, default ``True`` except for the root, whose buffer backward
  needs first; an int ``k`` keeps it sharded over groups of ``k`` ranks, as upstream's) and arm a hook on the outputs that re-gathers it when their gradient arrives
  and prefetches the module(s) before it;
* backward: one reduce-scatter per module (``_Unshard.backward``), then the buffer is freed.

Under ``torch.compile`` the hooks stay eager (``torch.compiler.disable``): the module's
compute compiles into graphs between them, and the collectives are issued by the hooks as in
eager (the backend's passes see none of them).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor as _UpstreamDTensor
from torch.utils._pytree import tree_flatten, tree_map

from vescale.dtensor.device_mesh import init_device_mesh
from vescale.fsdp.group import FlatGroup, Owners

__all__ = ["FSDPModule", "MixedPrecisionPolicy", "UnshardHandle", "flat_group", "fully_shard"]


@dataclass
class _Schedule:
    """Groups in the order their forward began (recorded anew each forward, used next)."""

    order: list[FlatGroup] = field(default_factory=list)
    recording: list[FlatGroup] = field(default_factory=list)

    def after(self, group: FlatGroup, step: int) -> list[FlatGroup]:
        if group not in self.order:
            return []
        i = self.order.index(group) + step
        return [self.order[i]] if 0 <= i < len(self.order) else []


_ACTIVE: list[_Schedule] = []  # the root's schedule while a forward runs


def flat_group(module: nn.Module) -> FlatGroup:
    """The :class:`FlatGroup` ``fully_shard`` made for ``module``."""
    return _state_of(module, "flat_group").group


def _state_of(module: nn.Module, what: str) -> _State:
    state = getattr(module, "_vescale_fsdp_state", None)
    if state is None:
        raise ValueError(f"{what}: {type(module).__name__} was not passed to fully_shard")
    return state  # type: ignore[no-any-return]


def _groups_within(module: nn.Module) -> list[FlatGroup]:
    return [
        s.group
        for sub in module.modules()
        if (s := getattr(sub, "_vescale_fsdp_state", None)) is not None
    ]


def _default_mesh() -> Any:
    """Upstream's default: every rank, on the accelerator if there is one."""
    kind = torch.accelerator.current_accelerator()
    return init_device_mesh(kind.type if kind else "cpu", (dist.get_world_size(),))


def _check_options(
    reshard_after_forward: Any, offload_policy: OffloadPolicy, mp: MixedPrecisionPolicy
) -> None:
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise TypeError(
            "fully_shard: reshard_after_forward must be a bool, an int or None, got "
            f"{reshard_after_forward!r}"
        )
    if type(offload_policy) is not OffloadPolicy:
        raise NotImplementedError(
            f"fully_shard: offload_policy={offload_policy} is not supported; leave the default"
        )
    if mp.output_dtype is not None:
        raise ValueError("fully_shard: mp_policy.output_dtype is not supported; leave it None")


def _reshard_world(reshard_after_forward: bool | int | None, world: int) -> bool | int | None:
    """Upstream's reading of ``reshard_after_forward``: an int ``k`` (a factor of the shard
    world ``world``) keeps the gathered parameters sharded over ``k`` ranks after forward;
    ``k == world`` is ``True``, ``k == 1`` (keep them whole) is ``False``."""
    if isinstance(reshard_after_forward, bool) or reshard_after_forward is None:
        return reshard_after_forward
    k = reshard_after_forward
    if k < 1 or k > world or world % k:
        raise ValueError(
            f"fully_shard: reshard_after_forward as an int is the group size to reshard to "
            f"after forward, a factor of the shard world {world}; got {k}"
        )
    return True if k == world else (False if k == 1 else k)


def _parameters(
    module: nn.Module, ignored: set[int]
) -> tuple[list[tuple[Owners, nn.Parameter]], list[str]]:
    """``module``'s parameters no inner call took and not ``ignored``, each with every
    ``(module, attribute)`` holding it (tied weights), in order of first appearance."""
    inner = _groups_within(module)
    taken = {id(p) for g in inner for p in g.sharded}
    originals = {i for g in inner for i in g.originals}
    found: dict[int, tuple[list[tuple[nn.Module, str]], nn.Parameter]] = {}
    names: list[str] = []
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for attr, p in list(sub._parameters.items()):
            if p is None or id(p) in taken or id(p) in ignored:
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            if id(p) in originals:
                raise ValueError(
                    f"fully_shard: parameter {name!r} is tied to a parameter an inner "
                    "fully_shard call took; call fully_shard on a module holding every use "
                    "of it (e.g. the root for a tied embedding and head)"
                )
            if isinstance(p, _UpstreamDTensor):
                raise ValueError(
                    f"fully_shard: parameter {name!r} is already a DTensor "
                    f"({p.placements}); fully_shard takes plain parameters"
                )
            if id(p) not in found:
                found[id(p)] = ([], p)
                names.append(name)
            if (sub, attr) not in found[id(p)][0]:
                found[id(p)][0].append((sub, attr))
    return list(found.values()), names


def fully_shard(
    module: nn.Module,
    *args: Any,
    mesh: Any = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> FSDPModule:
    """Shard ``module``'s parameters (those no inner ``fully_shard`` took, less
    ``ignored_params``) over ``mesh`` in one flat buffer, in place; returns ``module``, now
    an :class:`FSDPModule`. Upstream FSDP2's call: ``mesh`` (default: every rank, on the
    accelerator if any) 1-D shards, 2-D replicates over dim 0 and shards over dim 1 (HSDP).
    Parameters may be on the meta device (then ``module.to_empty(device=...)`` and an
    in-place init, on each rank's share) or ``vescale.deferred_init``-ed (each rank
    keeps its share, equal to eager init); otherwise every rank must hold the same
    full parameters. Tied parameters must all be in one call.
    ``reshard_after_forward``: free the gathered buffer after forward (default: ``True``,
    ``False`` for the module whose forward runs outermost); an int ``k`` (a factor of the
    shard world) keeps it sharded over groups of ``k`` consecutive ranks, from which
    backward gathers it (upstream's meaning: e.g. the ranks of a node).
    ``mp_policy``: ``param_dtype`` (compute dtype of the gathered parameters; the shard stays
    the master copy) and ``reduce_dtype`` (of the gradient reduce-scatter); ``output_dtype``
    is not supported. ``shard_placement_fn`` and a non-default ``offload_policy`` are not
    supported. The positional ``fully_shard(module, mesh)`` is deprecated."""
    if args:
        if len(args) > 1 or mesh is not None:
            raise TypeError("fully_shard: pass the mesh once, as mesh=")
        warnings.warn(
            "fully_shard(module, mesh) is deprecated; pass mesh= (upstream FSDP2's call)",
            DeprecationWarning,
            stacklevel=2,
        )
        mesh = args[0]
    policy = mp_policy or MixedPrecisionPolicy()
    _check_options(reshard_after_forward, offload_policy or OffloadPolicy(), policy)
    if shard_placement_fn is not None:
        raise NotImplementedError(
            "fully_shard: shard_placement_fn is not supported (every parameter is "
            "RaggedShard(dims=(0,)) in the flat buffer)"
        )
    mesh = _default_mesh() if mesh is None else mesh
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard: mesh must be 1-D (shard) or 2-D (replicate, shard: HSDP), got "
            f"{mesh}; pass the data-parallel sub-mesh (mesh['dp'])"
        )
    if getattr(module, "_vescale_fsdp_state", None) is not None:
        raise ValueError(f"fully_shard: {type(module).__name__} is already fully_shard-ed")
    params, names = _parameters(module, {id(p) for p in ignored_params or ()})
    if not params:
        raise ValueError(f"fully_shard: {type(module).__name__} has no parameters left to shard")
    group = FlatGroup(
        params, names, mesh, param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype
    )
    reshard = _reshard_world(reshard_after_forward, group.world)
    if not isinstance(reshard, bool) and reshard is not None:
        group.set_post_forward_world(reshard)
    state = _State(group, reshard, policy.cast_forward_inputs)
    module._vescale_fsdp_state = state  # type: ignore[assignment]
    module.register_forward_pre_hook(state.pre_forward, with_kwargs=True)
    module.register_forward_hook(state.post_forward, always_call=True)
    cls = module.__class__
    module.__class__ = _FSDP_CLASSES.setdefault(
        cls, type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    )
    return module  # type: ignore[return-value]


_FSDP_CLASSES: dict[type, type] = {}


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: :meth:`wait` waits for the all-gather."""

    def __init__(self, group: FlatGroup) -> None:
        self._group = group

    def wait(self) -> None:
        self._group.wait()


class FSDPModule(nn.Module):
    """A ``fully_shard``-ed module: upstream ``FSDPModule``'s methods (those vescale.fsdp has
    a meaning for; the others raise ``NotImplementedError`` naming themselves)."""

    def _fsdp_modules(self, recurse: bool) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, FSDPModule)] if recurse else [self]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (not recursive); its next forward uses them
        with no collective. ``async_op``: return a handle to wait on (forward waits too)."""
        group = _state_of(self, "unshard").group
        group.gather()
        if async_op:
            return UnshardHandle(group)
        group.wait()
        return None

    def reshard(self) -> None:
        """Free this module's gathered parameters (not recursive)."""
        _state_of(self, "reshard").group.free()

    def set_reshard_after_forward(
        self, reshard_after_forward: bool | int, recurse: bool = True
    ) -> None:
        """Whether forward frees the gathered parameters (``False``: backward re-uses them;
        an int ``k``: keeps them sharded over ``k`` ranks, backward gathers over those)."""
        _check_options(reshard_after_forward, OffloadPolicy(), MixedPrecisionPolicy())
        for m in self._fsdp_modules(recurse):
            state = _state_of(m, "set_reshard_after_forward")
            reshard = _reshard_world(reshard_after_forward, state.group.world)
            if not isinstance(reshard, bool) and reshard is not None:
                state.group.set_post_forward_world(reshard)
            state.reshard = reshard

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward frees the gathered parameters (``False``: the next forward re-uses
        them with no all-gather; for gradient accumulation, call :meth:`reshard` before a
        forward that follows an optimizer step)."""
        for m in self._fsdp_modules(recurse):
            _state_of(
                m, "set_reshard_after_backward"
            ).group.reshard_after_backward = reshard_after_backward

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """``False``: backward keeps the unsharded gradients (no collective) and the next
        synced backward reduces their sum (gradient accumulation without communication)."""
        for m in self._fsdp_modules(recurse):
            _state_of(
                m, "set_requires_gradient_sync"
            ).group.requires_gradient_sync = requires_gradient_sync

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Issue these modules' all-gathers when this module's forward begins (instead of the
        next module of the previous forward)."""
        _state_of(self, "set_modules_to_forward_prefetch").forward_prefetch = [
            _state_of(m, "set_modules_to_forward_prefetch").group for m in modules
        ]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Issue these modules' all-gathers when this module's backward begins (instead of the
        module before it in the previous forward)."""
        _state_of(self, "set_modules_to_backward_prefetch").backward_prefetch = [
            _state_of(m, "set_modules_to_backward_prefetch").group for m in modules
        ]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the data-parallel size."""
        for m in self._fsdp_modules(True):
            _state_of(m, "set_gradient_divide_factor").group.divide_factor = factor

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``to_empty``/``to``/casts: ``fn`` runs once on this module's flat shard (the
        parameters keep their objects and view the new shard), everything else as usual."""
        state = _state_of(self, "_apply")
        group = state.group
        group.free()
        held = [(m, a, m._parameters.pop(a)) for owners in group.owners for m, a in owners]
        try:
            out = super()._apply(fn, recurse)
        finally:
            for m, a, p in held:
                m._parameters[a] = p
        group.apply(fn)
        return out


def _not_supported(name: str) -> Callable[..., None]:
    def method(self: FSDPModule, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"FSDPModule.{name} is not supported by vescale.fsdp")

    method.__name__ = name
    method.__doc__ = f"Upstream ``FSDPModule.{name}``: not supported (raises)."
    return method


for _name in (
    "reset_iter_state",
    "set_all_reduce_hook",
    "set_allocate_memory_from_process_group_for_comm",
    "set_custom_all_gather",
    "set_custom_reduce_scatter",
    "set_force_sum_reduction_for_comms",
    "set_is_last_backward",
    "set_post_optim_event",
    "set_reduce_scatter_divide_factor",
    "set_reduce_scatter_max_input_buffers",
    "set_reduce_scatter_unused_params",
    "set_requires_all_reduce",
    "set_separate_reduce_scatter_group",
    "set_symm_mem_for_comm",
    "set_unshard_in_backward",
):
    setattr(FSDPModule, _name, _not_supported(_name))


class _State:
    """The hooks of one ``fully_shard`` module."""

    def __init__(self, group: FlatGroup, reshard: bool | int | None, cast_inputs: bool) -> None:
        self.group = group
        self.reshard = reshard
        self.cast_inputs = cast_inputs
        self.schedule = _Schedule()
        self.is_root = False
        self.forward_prefetch: list[FlatGroup] | None = None
        self.backward_prefetch: list[FlatGroup] | None = None

    @torch.compiler.disable  # eager collectives between compiled graphs (see the module doc)
    def pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        self.is_root = not _ACTIVE
        if self.is_root:
            _ACTIVE.append(self.schedule)
        schedule = _ACTIVE[0]
        schedule.recording.append(self.group)
        self.group.check_storage()
        views = self.group.unshard()
        following = self.forward_prefetch
        for group in schedule.after(self.group, 1) if following is None else following:
            group.gather()
        for owners, view in zip(self.group.owners, views):
            for owner, attr in owners:
                owner._parameters[attr] = view  # type: ignore[assignment]
        dtype = self.group.compute_dtype
        if self.cast_inputs and dtype != self.group.shard.dtype:
            args, kwargs = tree_map(
                lambda x: x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x,
                (args, kwargs),
            )
        return args, kwargs

    @torch.compiler.disable
    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        group = self.group
        for owners, p in zip(group.owners, group.sharded):
            for owner, attr in owners:
                owner._parameters[attr] = p
        schedule = _ACTIVE[0]
        if self.is_root:
            _ACTIVE.clear()
            schedule.order, schedule.recording = schedule.recording, []
        reshard = self.reshard if self.reshard is not None else not self.is_root
        if output is None or not torch.is_grad_enabled():  # None: forward raised
            group.free()
            return output
        if reshard is True:
            group.free()
        elif reshard:
            group.reshard_to_post_forward_world()
        tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _grads: self.pre_backward(schedule), mode="any"
            )
        return output

    def pre_backward(self, schedule: _Schedule) -> None:
        self.group.wait(backward=True)
        previous = self.backward_prefetch
        for group in schedule.after(self.group, -1) if previous is None else previous:
            group.gather(backward=True)
