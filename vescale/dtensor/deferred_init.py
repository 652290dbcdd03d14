"""Deferred initialization: build a module without its memory, materialize only local shards.

``deferred_init(module_fn, *args, **kwargs)`` runs ``module_fn`` while a dispatch mode turns
every tensor factory into a *deferred tensor*: a storage-less tensor (reports its intended
device, holds no data) that records how it was made and every op applied to it afterwards.
Random ops are recorded with the generator state they start from, and the generator is
advanced exactly as the eager op would advance it (by walking the stream in bounded pieces,
see :mod:`vescale.dtensor.random`), so random ops after ``deferred_init`` see the same
generator state as after eager construction.

``materialize_dtensor`` / ``materialize_module`` replay the record for this rank's global
indices only: creation (empty/zeros/ones/full) allocates the local shard, random ops fill it
through :func:`vescale.dtensor.random.run_random` with the recorded generator state (which is
restored afterwards; on a CUDA (Philox) device a DTensor's shard draws alone at its shard's
offsets, O(shard): :mod:`vescale.dtensor.random`), and exact element-wise in-place ops (fill, zero, add, mul, clamp,
erfinv, copy from a constant, ...) run on the shard, through ``select``/``slice`` views too
(e.g. an embedding's ``padding_idx`` row). Everything else (ops mixing deferred tensors, other
views, other factories such as ``arange``) replays that one tensor in full and slices it:
exact, bounded by the size of that single tensor. No communication happens.
"""

from __future__ import annotations

import abc
import contextlib
import difflib
import fnmatch
import functools
import itertools
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor as _UpstreamDTensor
from torch.utils.hooks import RemovableHandle

from vescale._torch_compat import TorchDispatchMode, tree_map
from vescale.dtensor.dtensor import DTensor, from_local
from vescale.dtensor.layout import contiguous_strides, local_indices
from vescale.dtensor.placement_types import (
    Placement,
    Replicate,
    make_spec,
    normalize_placements,
)
from vescale.dtensor.ragged import find_ragged, ragged_local_range, replace_ragged
from vescale.dtensor.random import (
    RANDOM_OPS,
    Indices,
    RandomOp,
    default_generator,
    draw_on_shard,
    is_philox,
    philox_offsets,
    random_op_of,
    reserve_philox,
    run_random,
    shard_indices,
    take_local,
    uses_philox,
)

__all__ = ["deferred_init", "is_deferred", "materialize_dtensor", "materialize_module"]

aten = torch.ops.aten
OpOverload = torch._ops.OpOverload
M = TypeVar("M", bound=nn.Module)

_FILL_FACTORIES = {"empty": None, "empty_strided": None, "zeros": 0, "ones": 1, "full": "arg"}
_LIKE = {
    "empty_like": None, "new_empty": None, "new_empty_strided": None, "zeros_like": 0,
    "new_zeros": 0, "ones_like": 1, "new_ones": 1, "full_like": "arg", "new_full": "arg",
}  # fmt: skip
_RANDOM_FACTORIES = {
    aten.rand.default: (aten.uniform_.default, (0.0, 1.0)),
    aten.rand.generator: (aten.uniform_.default, (0.0, 1.0)),
    aten.randn.default: (aten.normal_.default, (0.0, 1.0)),
    aten.randn.generator: (aten.normal_.default, (0.0, 1.0)),
    aten.rand_like.default: (aten.uniform_.default, (0.0, 1.0)),
    aten.randn_like.default: (aten.normal_.default, (0.0, 1.0)),
}
# In-place ops that give bit-identical results on any subset of elements.
_LOCAL_INPLACE = {
    "fill_", "zero_", "add_", "sub_", "mul_", "div_", "clamp_", "clamp_min_", "clamp_max_",
    "erfinv_", "neg_", "abs_", "sqrt_", "copy_",
}  # fmt: skip
_IDENTITY_VIEWS = (aten.detach.default, aten.alias.default)
View = tuple[tuple[OpOverload, tuple[Any, ...]], ...]  # a view chain: (op, args after self)


@dataclass
class _Ref:
    """A deferred tensor inside a recorded op: its record, version and view chain."""

    record: _Record
    version: int
    view: View


class _Step(abc.ABC):
    """One recorded step of a storage: its creation (the first step) or an in-place op.

    ``full`` replays it on the whole tensor ``t`` and returns the tensor after it;
    ``local_ok`` says whether ``local`` gives this rank's shard of that bit for bit from
    the shard alone; ``local`` replays it on the shard ``local`` at global ``indices``
    (``at``: the shard's layout, when it becomes a DTensor's local tensor).
    """

    @abc.abstractmethod
    def full(self, t: torch.Tensor, record: _Record) -> torch.Tensor: ...

    def local_ok(self, record: _Record) -> bool:
        return False

    def local(
        self, local: torch.Tensor, record: _Record, indices: Indices, at: _OnMesh | None
    ) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} is replayed in full only")


@dataclass(frozen=True, eq=False)
class _OnMesh:
    """The DTensor a shard being materialized belongs to: its ``spec`` and this rank's mesh
    ``coordinate`` (a random step on a Philox device draws at the shard's offsets)."""

    spec: Any
    coordinate: tuple[int, ...]


@dataclass(eq=False)
class _Fill(_Step):
    """Creation by ``empty``/``zeros``/``ones``/``full`` (and ``*_like``, ``new_*``):
    uninitialized when ``value`` is None, else filled with it."""

    value: Any = None

    def full(self, t: torch.Tensor, record: _Record) -> torch.Tensor:
        out = torch.empty_strided(
            record.shape, record.stride, dtype=record.dtype, device=record.device
        )
        return out if self.value is None else out.fill_(self.value)

    def local_ok(self, record: _Record) -> bool:
        return True

    def local(
        self, local: torch.Tensor, record: _Record, indices: Indices, at: _OnMesh | None
    ) -> torch.Tensor:
        shape = [ix.numel() for ix in indices]
        out = torch.empty(shape, dtype=record.dtype, device=record.device)
        return out if self.value is None else out.fill_(self.value)


@dataclass(eq=False)
class _OpStep(_Step):
    """A step that runs a recorded op ``func(*args, **kwargs)`` (deferred operands as ``_Ref``)."""

    func: OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def run(self, bind: Callable[[Any], Any] | None = None) -> Any:
        """The op on its recorded operands, each passed through ``bind`` (default: deferred
        operands replayed in full)."""
        bind = bind or _resolve
        return self.func(*tree_map(bind, self.args), **tree_map(bind, self.kwargs))


@dataclass(eq=False)
class _Factory(_OpStep):
    """Creation by another factory (``arange``, ...): made in full, then sliced."""

    def full(self, t: torch.Tensor, record: _Record) -> torch.Tensor:
        return self.run()  # type: ignore[no-any-return]

    def local_ok(self, record: _Record) -> bool:
        return True

    def local(
        self, local: torch.Tensor, record: _Record, indices: Indices, at: _OnMesh | None
    ) -> torch.Tensor:
        return take_local(self.run(), indices)


@dataclass(eq=False)
class _Derived(_OpStep):
    """Creation as an op's output (number ``index`` of a multi-output op) from other
    deferred tensors: replayed in full only."""

    index: int | None = None

    def full(self, t: torch.Tensor, record: _Record) -> torch.Tensor:
        out = self.run()
        return out if self.index is None else out[self.index]  # type: ignore[no-any-return]

    def local_ok(self, record: _Record) -> bool:
        """A cast (``_to_copy``: ``.to(dtype)``, ``.double()``, ...) of one deferred tensor,
        not through a view, whose own steps replay on the shard: element-wise, so it does."""
        src = self.args[0] if self.args else None
        rest = [*self.args[1:], *self.kwargs.values()]
        return (
            self.func is aten._to_copy.default
            and isinstance(src, _Ref)
            and not src.view
            and not any(isinstance(a, _Ref | torch.Tensor) for a in rest)
            and _local_ok(src.record, src.version)
        )

    def local(
        self, local: torch.Tensor, record: _Record, indices: Indices, at: _OnMesh | None
    ) -> torch.Tensor:
        src = self.args[0]
        kwargs = {k: v for k, v in self.kwargs.items() if k != "memory_format"}
        value = _local_value(src.record, indices, src.version, at)
        return self.func(value, **kwargs)  # type: ignore[no-any-return]


@dataclass(eq=False)
class _InPlace(_OpStep):
    """A deterministic in-place op on the tensor (through ``view``). On the shard alone for
    the element-wise ops of ``_LOCAL_INPLACE`` with no deferred operand, through a
    ``select``/``slice`` view only with scalar operands."""

    view: View = ()

    def full(self, t: torch.Tensor, record: _Record) -> torch.Tensor:
        self.run(functools.partial(_bind, record=record, target=_apply_view(t, self.view)))
        return t

    def local_ok(self, record: _Record) -> bool:
        if self.func.overloadpacket.__name__ not in _LOCAL_INPLACE:
            return False
        rest = [*self.args[1:], *self.kwargs.values()]
        if any(isinstance(a, _Ref) for a in rest):
            return False
        tensors = [a for a in rest if isinstance(a, torch.Tensor) and a.dim() > 0]
        return not (self.view and (_view_positions(self.view, record.shape) is None or tensors))

    def local(
        self, local: torch.Tensor, record: _Record, indices: Indices, at: _OnMesh | None
    ) -> torch.Tensor:
        if self.view:
            pos = _view_positions(self.view, record.shape)
            assert pos is not None
            mine = tuple(torch.isin(ix, p).nonzero().flatten() for ix, p in zip(indices, pos))
            sel = torch.meshgrid(*mine, indexing="ij") if mine else ()
            sub = local[sel].contiguous()
            self.func(sub, *self.args[1:], **self.kwargs)
            local[sel] = sub
        else:
            args = tuple(_local_arg(a, record.shape, indices) for a in self.args[1:])
            kwargs = {k: _local_arg(v, record.shape, indices) for k, v in self.kwargs.items()}
            self.func(local, *args, **kwargs)
        return local


@dataclass(eq=False)
class _SeededInPlace(_InPlace):
    """Another in-place random op, from its recorded generator state: replayed in full only."""

    gen: torch.Generator = field(kw_only=True)
    state: torch.Tensor = field(kw_only=True)

    def full(self, t: torch.Tensor, record: _Record) -> torch.Tensor:
        with _rng_at(self.gen, self.state):
            return super().full(t, record)

    def local_ok(self, record: _Record) -> bool:
        return False


@dataclass(eq=False)
class _Random(_Step):
    """A modelled random op (``uniform_``/``normal_``/``bernoulli_``, see
    :mod:`vescale.dtensor.random`) from its recorded generator state; on the shard alone
    unless through a view. ``reserved``: on a Philox device, the offsets recording it moved
    the generator past (the shard of a DTensor draws at its offsets within them)."""

    rop: RandomOp
    gen: torch.Generator
    state: torch.Tensor
    view: View = ()
    reserved: int | None = None

    def full(self, t: torch.Tensor, record: _Record) -> torch.Tensor:
        target = _apply_view(t, self.view)
        with _rng_at(self.gen, self.state):
            self.rop.apply(target, self.gen)
        return t

    def local_ok(self, record: _Record) -> bool:
        return not self.view

    def local(
        self, local: torch.Tensor, record: _Record, indices: Indices, at: _OnMesh | None
    ) -> torch.Tensor:
        if at is not None and self.reserved is not None and uses_philox(record.device, at.spec):
            self._check_reserved(at)
            with _rng_at(self.gen, self.state):
                draw_on_shard(
                    at.spec, at.coordinate, self.rop.op, local, *self.rop.args, generator=self.gen
                )
            return local
        with _rng_at(self.gen, self.state):
            run_random(
                self.rop,
                record.shape,
                record.dtype,
                record.device,
                indices,
                stride=record.stride,
                out=local,
            )
        return local

    def _check_reserved(self, at: _OnMesh) -> None:
        end = philox_offsets(at.spec, at.coordinate)[1]
        if self.reserved is not None and end > self.reserved:
            spec = at.spec
            raise ValueError(
                f"materialize: the deferred {self.rop.op} of a tensor of shape "
                f"{tuple(spec.shape)} reserved {self.reserved} Philox offsets when recorded, "
                f"placements {tuple(spec.placements)} on {spec.mesh} draw from {end}: call "
                f"deferred_init after init_process_group (it reserves for the world size)"
            )


@dataclass(eq=False)
class _Record:
    """How one storage is produced: its creation, then in-place ops in order."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device  # where replay runs
    steps: list[_Step] = field(default_factory=list)
    shown: torch.device | None = None  # the device the tensor reports, when not ``device``


class _DeferredTensor(torch.Tensor):
    """A tensor without storage: its record (shared by aliases) and view chain."""

    _record: _Record
    _view: View

    @staticmethod
    def __new__(
        cls,
        meta: torch.Tensor,
        record: _Record,
        view: View,
        requires_grad: bool = False,
    ) -> _DeferredTensor:
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride(),
            dtype=meta.dtype,
            device=record.shown or record.device,
            requires_grad=requires_grad,
        )
        t._record, t._view = record, view
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self)  # type: ignore[attr-defined,no-any-return]

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``param.data = value`` (``nn.Module.to``/``.double()``/``.half()`` on parameters):
        the tensor takes ``value``'s record too, so the cast replays at materialization."""
        torch.Tensor.data.__set__(self, value)  # type: ignore[attr-defined]
        if isinstance(value, _DeferredTensor):
            self._record, self._view = value._record, value._view

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: OpOverload, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return _handle(func, tuple(args), dict(kwargs or {}), factories=False)

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"DeferredTensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"
        )


class _DeferMode(TorchDispatchMode):
    def __torch_dispatch__(
        self, func: OpOverload, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return _handle(func, tuple(args), dict(kwargs or {}), factories=True)


# ---- recording -------------------------------------------------------------------------


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _replay_device(device: torch.device) -> torch.device:
    """Where a deferred tensor asked for on ``device`` is replayed: a ``meta`` request
    (``torch.device("meta")`` around ``deferred_init``) is deferred like any other and
    materializes as the CPU tensor (CPU generator included)."""
    return torch.device("cpu") if device.type == "meta" else device


def _new(meta: torch.Tensor, device: torch.device, step: _Step) -> _DeferredTensor:
    shape, stride = tuple(meta.shape), tuple(meta.stride())
    replay = _replay_device(device)
    shown = device if replay != device else None
    record = _Record(shape, stride, meta.dtype, replay, [step], shown)
    return _DeferredTensor(meta, record, ())


def _ref(x: Any) -> Any:
    if isinstance(x, _DeferredTensor):
        return _Ref(x._record, len(x._record.steps), x._view)
    return x


def _device_of(kwargs: dict[str, Any]) -> torch.device:
    dev = kwargs.get("device")
    return torch.device(dev) if dev is not None else torch.get_default_device()


def _written(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The deferred tensor ``func`` writes to, if any."""
    for i, a in enumerate(func._schema.arguments):
        info = a.alias_info
        if info is None or not info.is_write:
            continue
        value = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
        if isinstance(value, _DeferredTensor):
            return value
    return None


def _snapshot(
    rop: RandomOp, device: torch.device
) -> tuple[RandomOp, torch.Generator, torch.Tensor]:
    gen = rop.generator or default_generator(device)
    return RandomOp(rop.op, rop.args, gen), gen, gen.get_state()


def _handle(
    func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], *, factories: bool
) -> Any:
    flat = [*args, *kwargs.values()]
    flat += [x for a in flat if isinstance(a, list | tuple) for x in a]
    deferred = [a for a in flat if isinstance(a, _DeferredTensor)]
    if not deferred:
        if factories and not any(isinstance(a, torch.Tensor) for a in flat):
            return _factory(func, args, kwargs)
        return func(*args, **kwargs)
    src = deferred[0]
    if func in _IDENTITY_VIEWS:
        return _DeferredTensor(_meta(src), src._record, src._view)
    name = func.overloadpacket.__name__
    if func in _RANDOM_FACTORIES or name in _LIKE:
        meta = func(*tree_map(_to_meta, args), **_meta_kwargs(kwargs))
        device = torch.device(kwargs.get("device") or src.device)
        return _create(func, args, kwargs, meta, device)
    target = _written(func, args, kwargs)
    if target is not None:
        return _record_inplace(func, args, kwargs, target)
    try:
        meta_out = func(*tree_map(_to_meta, args), **_meta_kwargs(kwargs))
    except (NotImplementedError, RuntimeError):  # data-dependent: compute it for real
        return func(*tree_map(_full_value, args), **tree_map(_full_value, kwargs))
    if func._schema._is_view_op() and isinstance(meta_out, torch.Tensor):
        rest = tuple(tree_map(_ref, args[1:]))
        if all(a is src for a in deferred):
            return _DeferredTensor(meta_out, src._record, (*src._view, (func, rest)))
    if isinstance(meta_out, torch.Tensor):
        return _new(meta_out, src.device, _Derived(func, _refs(args), _refs(kwargs)))
    if isinstance(meta_out, list | tuple) and all(isinstance(o, torch.Tensor) for o in meta_out):
        return type(meta_out)(
            _new(o, src.device, _Derived(func, _refs(args), _refs(kwargs), i))
            for i, o in enumerate(meta_out)
        )
    return func(*tree_map(_full_value, args), **tree_map(_full_value, kwargs))


def _refs(x: Any) -> Any:
    return tree_map(_ref, x)


def _to_meta(x: Any) -> Any:
    return _meta(x) if isinstance(x, torch.Tensor) else x


def _meta_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = {k: _to_meta(v) for k, v in kwargs.items() if k != "generator"}
    if "device" in out:
        out["device"] = "meta"
    return out


def _factory(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    device = _device_of(kwargs)
    returns = func._schema.returns
    if len(returns) != 1 or str(returns[0].type) != "Tensor":
        return func(*args, **kwargs)
    if torch.Tag.nondeterministic_seeded in func.tags and func not in _RANDOM_FACTORIES:
        return func(*args, **kwargs)  # an unmodelled random factory: run it eagerly
    meta = func(*args, **{**_meta_kwargs(kwargs), "device": "meta"})
    return _create(func, args, kwargs, meta, device)


def _create(
    func: OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    meta: torch.Tensor,
    device: torch.device,
) -> _DeferredTensor:
    name = func.overloadpacket.__name__
    if func in _RANDOM_FACTORIES:
        t = _new(meta, device, _Fill())
        op, op_args = _RANDOM_FACTORIES[func]
        _record_inplace(op, (t, *op_args), {"generator": kwargs.get("generator")}, t)
        return t
    fills = {**_FILL_FACTORIES, **_LIKE}
    if name in fills:
        value = fills[name]
        if value == "arg":
            names = [a.name for a in func._schema.arguments]
            at = names.index("fill_value")
            value = args[at] if at < len(args) else kwargs["fill_value"]
        return _new(meta, device, _Fill(value))
    if "device" in kwargs:  # replay where the record runs
        kwargs = {**kwargs, "device": _replay_device(device)}
    return _new(meta, device, _Factory(func, args, kwargs))


def _record_inplace(
    func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], target: _DeferredTensor
) -> _DeferredTensor:
    record = target._record
    step: _Step
    if func in RANDOM_OPS:
        rop, gen, state = _snapshot(random_op_of(func, args, kwargs), record.device)
        reserved = None
        if is_philox(record.device):  # nothing drawn: shards draw per shard
            reserved = reserve_philox(target.numel(), gen, record.device)
        else:
            run_random(rop, target.shape, target.dtype, record.device, None, stride=target.stride())
        step = _Random(rop, gen, state, target._view, reserved)
    elif torch.Tag.nondeterministic_seeded in func.tags:
        gen = kwargs.get("generator") or default_generator(record.device)
        step = _SeededInPlace(
            func, _refs(args), _refs(kwargs), target._view, gen=gen, state=gen.get_state()
        )
        eager = _apply_view(_full(record, len(record.steps)), target._view)
        real = lambda x: eager if x is target else _full_value(x)  # noqa: E731
        func(*tree_map(real, args), **tree_map(real, kwargs))  # advances the generator as eager
    else:
        step = _InPlace(func, _refs(args), _refs(kwargs), target._view)
    record.steps.append(step)
    return target


# ---- replay ----------------------------------------------------------------------------


@contextlib.contextmanager
def _rng_at(gen: torch.Generator, state: torch.Tensor) -> Iterator[None]:
    saved = gen.get_state()
    gen.set_state(state)
    try:
        yield
    finally:
        gen.set_state(saved)


def _apply_view(
    t: torch.Tensor, view: Sequence[tuple[OpOverload, tuple[Any, ...]]]
) -> torch.Tensor:
    for func, rest in view:
        t = func(t, *tree_map(_resolve, rest))
    return t


def _resolve(x: Any) -> Any:
    if isinstance(x, _Ref):
        return _apply_view(_full(x.record, x.version), x.view)
    return x


def _full(record: _Record, upto: int) -> torch.Tensor:
    """Replay the first ``upto`` steps of ``record`` on a full tensor."""
    t = torch.empty(0)
    for step in record.steps[:upto]:
        t = step.full(t, record)
    return t


def _bind(x: Any, record: _Record, target: torch.Tensor) -> Any:
    """A recorded argument during replay: ``target`` for ``record`` itself, else resolved."""
    return target if isinstance(x, _Ref) and x.record is record else _resolve(x)


def _full_value(x: Any) -> Any:
    if isinstance(x, _DeferredTensor):
        return _apply_view(_full(x._record, len(x._record.steps)), x._view)
    return x


def _view_positions(
    view: Sequence[tuple[OpOverload, tuple[Any, ...]]], shape: Sequence[int]
) -> list[torch.Tensor] | None:
    """Per base dim, the base indices a chain of ``select``/``slice`` views covers."""
    pos = [torch.arange(s) for s in shape]
    dims = list(range(len(shape)))
    for func, rest in view:
        if func is aten.select.int:
            d, i = dims.pop(rest[0]), rest[1]
            pos[d] = pos[d][i : i + 1 if i != -1 else None]
        elif func is aten.slice.Tensor:
            dim, start, end, step = (*rest, None, None, None, 1)[:4]
            d = dims[dim]
            pos[d] = pos[d][start:end:step]
        else:
            return None
    return pos


def _local_ok(record: _Record, upto: int | None = None) -> bool:
    """Whether every step of ``record`` (the first ``upto``) replays on a shard alone."""
    return all(step.local_ok(record) for step in record.steps[:upto])


def _local_value(
    record: _Record, indices: Indices, upto: int | None = None, at: _OnMesh | None = None
) -> torch.Tensor:
    """This rank's shard of ``record`` after its first ``upto`` steps (all by default):
    replayed on the shard when every step allows it, else replayed in full (this tensor
    only) and sliced. ``at``: the DTensor it is the local tensor of, if any."""
    upto = len(record.steps) if upto is None else upto
    if not _local_ok(record, upto):
        return take_local(_full(record, upto), indices)
    local = torch.empty(0)
    for step in record.steps[:upto]:
        local = step.local(local, record, indices, at)
    return local


def _local_arg(x: Any, shape: Sequence[int], indices: Indices) -> Any:
    if isinstance(x, torch.Tensor) and x.dim() > 0:
        return take_local(x.expand(shape), indices)
    return x


# ---- public API ------------------------------------------------------------------------


def deferred_init(module_fn: Callable[..., M], *args: Any, **kwargs: Any) -> M:
    """``module_fn(*args, **kwargs)`` with no parameter or buffer memory allocated: tensors it
    creates are deferred, recording their initialization (random ops with their generator
    state; the generator advances as in eager construction). Running the module (or any
    submodule) before :func:`materialize_module` raises ``RuntimeError`` naming the deferred
    tensor."""
    with _DeferMode():
        module = module_fn(*args, **kwargs)
    if isinstance(module, nn.Module):
        _guard_forward(module)
    return module


_GUARDS: weakref.WeakKeyDictionary[nn.Module, RemovableHandle] = weakref.WeakKeyDictionary()


def _first_deferred(module: nn.Module) -> tuple[str, torch.Tensor] | None:
    tensors = itertools.chain(module.named_parameters(), module.named_buffers())
    return next(((n, t) for n, t in tensors if isinstance(t, _DeferredTensor)), None)


def _guard_forward(root: nn.Module) -> None:
    """A forward pre-hook on every module of ``root`` holding deferred tensors: it raises
    while any is deferred, and removes itself once none is."""
    for prefix, mod in root.named_modules():
        if mod in _GUARDS or _first_deferred(mod) is None:
            continue
        what = f"{type(mod).__name__} {prefix!r}" if prefix else type(mod).__name__

        def check(m: nn.Module, _args: Any, prefix: str = prefix, what: str = what) -> None:
            found = _first_deferred(m)
            if found is None:
                _GUARDS.pop(m).remove()
                return
            name, t = found
            full = f"{prefix}.{name}" if prefix else name
            raise RuntimeError(
                f"{what} was built by vescale.deferred_init and its tensor {full!r} (shape "
                f"{tuple(t.shape)}) is still deferred (it holds no data): call "
                f"vescale.materialize_module(model, plan) before running the model"
            )

        _GUARDS[mod] = mod.register_forward_pre_hook(check)


def is_deferred(module_or_tensor: nn.Module | torch.Tensor) -> bool:
    """Whether a tensor, or any parameter or buffer of a module, is still deferred."""
    if isinstance(module_or_tensor, nn.Module):
        return any(
            isinstance(t, _DeferredTensor)
            for t in [*module_or_tensor.parameters(), *module_or_tensor.buffers()]
        )
    return isinstance(module_or_tensor, _DeferredTensor)


def _local_of(tensor: torch.Tensor, indices: Indices, at: _OnMesh | None = None) -> torch.Tensor:
    if not isinstance(tensor, _DeferredTensor):
        return take_local(tensor.detach(), indices)
    if tensor._view:
        return take_local(_full_value(tensor), indices)
    return _local_value(tensor._record, indices, at=at)


def materialize_dtensor(
    tensor: torch.Tensor, device_mesh: Any, placements: Sequence[Placement]
) -> DTensor:
    """A DTensor on ``device_mesh`` whose local shard is computed here (no communication), with
    the values eager single-device initialization gives; a non-deferred tensor is sliced."""
    pl = normalize_placements(placements, device_mesh, tensor.ndim, what="materialize_dtensor")
    coord = device_mesh.get_coordinate()
    shape = tuple(tensor.shape)
    stride = contiguous_strides(shape)
    if coord is None:
        local = torch.empty(0, dtype=tensor.dtype)
    else:
        indices = shard_indices(shape, device_mesh, pl, coord)
        if indices is not None:  # the shard alone (a RaggedShard's rows, flattened)
            at = _OnMesh(make_spec(device_mesh, pl, shape, stride, tensor.dtype), tuple(coord))
            local = _local_of(tensor, indices, at)
        else:  # a RaggedShard over several dims: the tensor it slices, then its slice
            inner = local_indices(shape, device_mesh, replace_ragged(pl, Replicate()), coord)
            local = _local_of(tensor, inner)
        if any(p.is_partial() and c != 0 for p, c in zip(pl, coord)):
            local.zero_()  # Partial: the value on coordinate 0, zeros elsewhere
        if find_ragged(pl) is not None:
            local = local.reshape(-1)
        if indices is None:
            local = local.narrow(0, *ragged_local_range(shape, device_mesh, pl))
    local = local.to(device_mesh.device_type if device_mesh.device_type != "meta" else "cpu")
    return from_local(local, device_mesh, pl, run_check=False, shape=shape, stride=stride)


def _materialize_tensor(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, _DeferredTensor):
        return tensor
    return _local_of(tensor, tuple(torch.arange(s) for s in tensor.shape))


def materialize_module(
    module: M, plan: Mapping[str, tuple[Any, Sequence[Placement]]] | None = None
) -> M:
    """Materialize ``module``'s deferred parameters and buffers in place.

    ``plan`` maps names (``fnmatch`` patterns, first match wins) to ``(device_mesh,
    placements)``: those become DTensors holding only this rank's shard; the rest become
    ordinary tensors. Casts recorded after ``deferred_init`` (``.to(dtype)``, ``.double()``,
    ``.half()``) are replayed: values equal one device doing the same. Tied tensors stay tied
    (a pattern matching any of their names applies). Tensors that already hold data are
    kept, or sliced when a plan entry takes a plain tensor; so a second call without a plan
    is a no-op. ``ValueError``, before anything is materialized: a pattern that takes no
    tensor (matching no name, or only names an earlier pattern took), a tied tensor whose
    names take entries that differ, or a plan entry taking a DTensor (the module was
    materialized by an earlier call; the message names the module and the tensor).
    Returns ``module``."""
    plan = dict(plan or {})
    slots: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    names: dict[int, list[str]] = {}  # id of a (possibly tied) tensor -> its names
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for table in (mod._parameters, mod._buffers):
            for leaf, t in table.items():
                if t is not None:
                    slots.append((table, leaf, t))
                    names.setdefault(id(t), []).append(f"{mod_name}.{leaf}" if mod_name else leaf)
    targets = _plan_targets(plan, names)
    for *_, t in slots:
        if id(t) in targets and isinstance(t, _UpstreamDTensor):
            raise ValueError(
                f"materialize_module: {type(module).__name__}'s {names[id(t)][0]!r} is already "
                f"a DTensor ({_describe((t.device_mesh, t.placements))}): the module was "
                f"materialized by an earlier call; materialize a deferred_init'ed module once "
                f"(use redistribute to change a layout)"
            )
    done: dict[int, torch.Tensor] = {}  # id of a (possibly tied) tensor -> its replacement
    for table, leaf, t in slots:
        if id(t) not in done:
            done[id(t)] = _materialized(t, targets.get(id(t)))
        table[leaf] = done[id(t)]
    for mod in module.modules():
        if mod in _GUARDS and _first_deferred(mod) is None:
            _GUARDS.pop(mod).remove()
    return module


def _plan_targets(
    plan: Mapping[str, tuple[Any, Sequence[Placement]]], names: Mapping[int, list[str]]
) -> dict[int, tuple[Any, Sequence[Placement]]]:
    """Tensor id -> its plan entry (see :func:`materialize_module` for the errors)."""
    targets: dict[int, tuple[Any, Sequence[Placement]]] = {}
    used: set[str] = set()
    for key, tensor_names in names.items():
        first: dict[str, str] = {}  # pattern -> the first of this tensor's names it takes
        for n in tensor_names:
            pattern = next((k for k in plan if fnmatch.fnmatchcase(n, k)), None)
            if pattern is not None:
                first.setdefault(pattern, n)
        used.update(first)
        patterns = list(first)
        values = {(plan[p][0], tuple(plan[p][1])): p for p in patterns}
        if len(values) > 1:
            pa, pb = list(values.values())[:2]
            a, b = first[pa], first[pb]
            raise ValueError(
                f"materialize_module: tied tensor {a!r} / {b!r} takes plan entries {pa!r} and "
                f"{pb!r}, which differ; give all its names one layout"
            )
        if patterns:
            targets[key] = plan[patterns[0]]
    all_names = [n for ns in names.values() for n in ns]
    for pattern in plan:
        if pattern in used:
            continue
        matched = [n for n in all_names if fnmatch.fnmatchcase(n, pattern)]
        why = (
            f"every name it matches ({matched[:3]}) is taken by an earlier pattern"
            if matched
            else "it matches no parameter or buffer"
        )
        close = difflib.get_close_matches(pattern, all_names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close and not matched else ""
        raise ValueError(
            f"materialize_module: plan pattern {pattern!r} ({_describe(plan[pattern])}) takes "
            f"no tensor: {why}{hint} (names look like {all_names[:4]})"
        )
    return targets


def _describe(entry: tuple[Any, Sequence[Placement]]) -> str:
    mesh, placements = entry
    return f"placements {tuple(placements)} on {mesh}"


def _materialized(t: torch.Tensor, target: tuple[Any, Sequence[Placement]] | None) -> torch.Tensor:
    if target is None and not isinstance(t, _DeferredTensor):
        return t
    with torch.no_grad():
        value = materialize_dtensor(t, *target) if target is not None else _materialize_tensor(t)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(value, requires_grad=t.requires_grad)
    return value
