"""The one seam with torch: every change vescale makes to a torch object.

Four kinds of entries, each with the reason it exists:

* **attribute patches** (:data:`ATTRIBUTES`, built by :func:`_attribute_table`): an
  attribute of a torch class, instance or module replaced by a function defined elsewhere in
  vescale (modules define replacements; only this module assigns them), or here when it
  concerns the seam's own entries (leaving upstream's ``loss_parallel()`` writes back the
  handlers it popped);
* **registry entries** written through :func:`set_entry` / :func:`remove_entry` /
  :func:`register_op_strategy`: per-op handlers, sharding strategies and scalar-shape
  adjusters in upstream DTensor's tables, recorded with the value they replaced;
* **dispatcher kernels** (:func:`register_kernel`): Python kernels for an op at dispatch keys
  where it has none of its own (an autograd key before a CompositeImplicitAutograd
  decomposition), held in a ``torch.library.Library`` that :func:`uninstall` destroys;
* **safe globals** (:func:`_safe_globals`): vescale's DTensor, spec, mesh and placement
  classes on ``torch.serialization``'s allowlist, as upstream puts its own there.

:func:`install` (run once by ``import vescale``, before any DTensor op: upstream's C++
dispatcher caches ``OpDispatcher.wrap`` at first use) applies all of them and is idempotent;
:func:`uninstall` restores every original and clears the sharding caches, so a process is
back to upstream torch (tests use it). :func:`describe` lists the table for the docs
(``docs/torch-changes.md``). Everything here is scoped at run time to what vescale owns
(vescale DTensors carry a ``VescaleSpec``) except the entries marked ``all DTensors``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "describe",
    "install",
    "installed",
    "register_kernel",
    "register_op_strategy",
    "remove_entry",
    "set_entry",
    "temporarily",
    "uninstall",
]

_MISSING = object()


@dataclass
class _Attribute:
    owner: Any
    name: str
    replacement: Any
    why: str
    original: Any = _MISSING


@dataclass
class _Entry:
    table: MutableMapping[Any, Any]
    table_name: str
    key: Any
    value: Any  # _MISSING: the entry is removed
    why: str
    original: Any = _MISSING


@dataclass
class _Kernel:
    op: torch._ops.OpOverload
    keys: tuple[str, ...]
    fn: Callable[..., Any]
    why: str


_attributes: list[_Attribute] = []
_entries: dict[tuple[int, Any], _Entry] = {}
_kernels: list[_Kernel] = []
_libraries: list[Any] = []  # the torch.library.Library objects holding _kernels while installed
_state: dict[str, Any] = {"installed": False, "safe_globals_added": []}


def installed() -> bool:
    """Whether vescale's changes are in effect."""
    return _state["installed"]


def _own(owner: Any, name: str) -> Any:
    """``owner``'s own value for ``name`` (the descriptor for class attributes), or missing."""
    return vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING


def _put(owner: Any, name: str, value: Any) -> None:
    if value is _MISSING:
        if name in vars(owner):
            delattr(owner, name)
    else:
        setattr(owner, name, value)


def _write(table: MutableMapping[Any, Any], key: Any, value: Any) -> None:
    if value is _MISSING:
        table.pop(key, None)
    else:
        table[key] = value


def _clear_caches() -> None:
    from vescale._torch_compat import PROPAGATOR

    torch._C._clear_DTensor_sharding_propagator_cache()
    PROPAGATOR.propagate_op_sharding.cache_clear()


def set_entry(
    table: MutableMapping[Any, Any], table_name: str, key: Any, value: Any, why: str
) -> None:
    """``table[key] = value`` (an upstream registry), recorded so :func:`uninstall` restores
    what was there before vescale's first write."""
    slot = (id(table), key)
    entry = _entries.get(slot)
    if entry is None:
        entry = _entries[slot] = _Entry(
            table, table_name, key, value, why, table.get(key, _MISSING)
        )
    else:
        entry.value, entry.why = value, why
    if _state["installed"]:
        _write(table, key, value)


def remove_entry(table: MutableMapping[Any, Any], table_name: str, key: Any, why: str) -> None:
    """Remove ``table[key]`` (recorded like :func:`set_entry`)."""
    set_entry(table, table_name, key, _MISSING, why)


def restore_entry(table: MutableMapping[Any, Any], key: Any) -> None:
    """Put back upstream's value of ``table[key]`` and forget vescale's entry."""
    entry = _entries.pop((id(table), key), None)
    if entry is not None and _state["installed"]:
        _write(table, key, entry.original)


def _reapply(table: MutableMapping[Any, Any], key: Any) -> None:
    """Write vescale's value of ``table[key]`` again (after upstream code removed it), or remove
    the key where vescale has no entry."""
    entry = _entries.get((id(table), key))
    _write(table, key, entry.value if entry is not None and _state["installed"] else _MISSING)


def _end_loss_parallel() -> None:
    """Exit of upstream's ``loss_parallel()``: upstream pops the handlers it installed on
    entry; the seam's entries they replaced (vescale's ``_log_softmax`` / ``nll_loss``
    handlers) are written back."""
    from torch.distributed.tensor import DTensor

    from vescale._torch_compat import upstream_loss_module

    table = DTensor._op_dispatcher._custom_op_handlers
    for op in upstream_loss_module.customized_loss_ops:
        _reapply(table, op)


def register_op_strategy(
    op: torch._ops.OpOverload | Sequence[torch._ops.OpOverload], schema_info: Any = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Upstream's ``register_op_strategy`` decorator, recorded in the seam: the strategy
    (and its schema info) replaces upstream's for ``op`` in the one sharding propagator."""
    from vescale._torch_compat import PROPAGATOR as propagator
    from vescale._torch_compat import upstream_register_op_strategy

    ops: list[Any] = list(op) if isinstance(op, list | tuple) else [op]

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        scratch_funcs: dict[Any, Any] = {}
        scratch_info: dict[Any, Any] = {}
        real_funcs, real_info = propagator.op_strategy_funcs, propagator.op_to_schema_info
        # Let upstream's decorator compute what it registers, into scratch tables.
        propagator.op_strategy_funcs, propagator.op_to_schema_info = scratch_funcs, scratch_info
        try:
            upstream_register_op_strategy(ops, schema_info)(fn)
        finally:
            propagator.op_strategy_funcs, propagator.op_to_schema_info = real_funcs, real_info
        why = f"strategy {fn.__module__}.{fn.__name__}"
        for o in ops:
            set_entry(real_funcs, "ShardingPropagator.op_strategy_funcs", o, scratch_funcs[o], why)
            if o in scratch_info:
                set_entry(
                    real_info, "ShardingPropagator.op_to_schema_info", o, scratch_info[o], why
                )
        if _state["installed"]:
            _clear_caches()
        return fn

    return register


def _impl(kernel: _Kernel) -> None:
    lib = torch.library.Library(kernel.op.namespace, "IMPL")
    for key in kernel.keys:
        lib.impl(kernel.op, kernel.fn, key)
    _libraries.append(lib)


def register_kernel(
    op: torch._ops.OpOverload, keys: Sequence[str], fn: Callable[..., Any], why: str
) -> None:
    """``fn`` as ``op``'s kernel at dispatch ``keys`` (``torch.library`` registrations, for
    keys where ``op`` has no kernel of its own: an autograd key runs ``fn`` before the op's
    CompositeImplicitAutograd decomposition, for every input, so ``fn`` must compute the op
    for all of them)."""
    kernel = _Kernel(op, tuple(keys), fn, why)
    _kernels.append(kernel)
    if _state["installed"]:
        _impl(kernel)


@contextlib.contextmanager
def temporarily(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name = value`` inside the ``with`` block only (e.g. the plan path's strategy
    queries without upstream's cost estimates), restored on exit."""
    saved = _own(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        _put(owner, name, saved)


def _attribute_table() -> list[_Attribute]:
    from torch.distributed.tensor import DTensor

    from vescale._torch_compat import PROPAGATOR as propagator
    from vescale._torch_compat import (
        ExplicitRedistributionContext,
        LocalLRUCache,
        OpDispatcher,
        _mesh_resources,
        upstream_dispatch_module,
        upstream_loss_module,
    )
    from vescale.dtensor import (
        _legacy,
        device_mesh,
        dtensor,
        explicit,
        implicit_redistribute,
        placement_types,
        propagation,
    )

    return [
        _Attribute(
            OpDispatcher,
            "wrap",
            staticmethod(dtensor.wrap_output),
            "op outputs with a VescaleSpec become vescale.DTensor; others are built as upstream "
            "builds them",
        ),
        _Attribute(
            DTensor,
            "__init__",
            dtensor.upstream_init,
            "a DTensor built around a vescale DTensor's spec (FSDP2 rewraps parameters so) is a "
            "vescale.DTensor",
        ),
        _Attribute(
            propagator,
            "propagate_op_sharding_non_cached",
            propagation.propagate_op_sharding,
            "all DTensors: a missing strategy raises UnsupportedOpError naming op, placements "
            "and mesh; ops with a vescale input get VescaleSpec outputs and vescale's rules",
        ),
        _Attribute(
            propagator,
            "propagate_op_sharding",
            LocalLRUCache(propagation.propagate_op_sharding),
            "the cached form of the entry above (upstream binds it at construction)",
        ),
        _Attribute(
            ExplicitRedistributionContext,
            "observe_redistribution",
            classmethod(explicit.observe_redistribution),
            "explicit mode (VESCALE_DISABLE_REDISTRIBUTE) for implicit redistributions of "
            "vescale DTensors; upstream's context for all",
        ),
        _Attribute(
            upstream_dispatch_module,
            "redistribute_local_tensor",
            implicit_redistribute.redistribute_for_dispatch,
            "implicit redistributions of vescale DTensors that target a Partial or involve "
            "an interleaved shard use vescale's planner; all others upstream's",
        ),
        _Attribute(
            _mesh_resources,
            "num_devices_per_host",
            device_mesh.devices_per_host,
            "all DTensors: the cost model on meta meshes (torch.meta has no device module)",
        ),
        _Attribute(
            upstream_loss_module,
            "_disable_custom_loss_ops",
            _end_loss_parallel,
            "all DTensors: leaving upstream's loss_parallel() puts back the handlers it "
            "replaced (upstream pops them, vescale's log_softmax/nll_loss handlers included)",
        ),
        _Attribute(
            placement_types.Placement,
            "is_interleaved_shard",
            placement_types.legacy_is_interleaved_shard,
            "all placements: veScale legacy's query (False but on InterleavedShard)",
        ),
        _Attribute(
            placement_types.Shard,
            "_unpad_tensor",
            _legacy.legacy_unpad_tensor,
            "all Shard placements: veScale legacy's helper undoing _split_tensor's padding",
        ),
    ]


_SAFE_GLOBALS_WHY = (
    "torch.load's default weights_only=True loads vescale DTensors, as upstream allows "
    "its DTensor, DeviceMesh, spec and placement classes"
)


def _safe_globals() -> list[Any]:
    """The vescale classes a pickled ``vescale.DTensor`` (``torch.save``) names."""
    from vescale.dtensor.device_mesh import DeviceMesh
    from vescale.dtensor.dtensor import DTensor, VescaleSpec
    from vescale.dtensor.placement_types import InterleavedShard, Partial
    from vescale.dtensor.ragged import RaggedShard

    return [DTensor, VescaleSpec, DeviceMesh, Partial, InterleavedShard, RaggedShard]


def install() -> None:
    """Apply every attribute patch and registry entry (idempotent)."""
    if _state["installed"]:
        return
    if not _attributes:
        _attributes.extend(_attribute_table())
    for a in _attributes:
        a.original = _own(a.owner, a.name)
        _put(a.owner, a.name, a.replacement)
    for e in _entries.values():
        e.original = e.table.get(e.key, _MISSING)
        _write(e.table, e.key, e.value)
    for k in _kernels:
        _impl(k)
    before = torch.serialization.get_safe_globals()
    _state["safe_globals_added"] = [g for g in _safe_globals() if g not in before]
    torch.serialization.add_safe_globals(_state["safe_globals_added"])
    _state["installed"] = True
    _clear_caches()


def uninstall() -> None:
    """Restore every original value vescale replaced (torch as if vescale were not imported;
    vescale DTensors then behave as upstream ones)."""
    if not _state["installed"]:
        return
    while _libraries:
        _libraries.pop()._destroy()
    kept = [
        g for g in torch.serialization.get_safe_globals() if g not in _state["safe_globals_added"]
    ]
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(kept)
    for e in reversed(list(_entries.values())):
        _write(e.table, e.key, e.original)
    for a in reversed(_attributes):
        _put(a.owner, a.name, a.original)
    _state["installed"] = False
    _clear_caches()


def _name(owner: Any) -> str:
    return (
        getattr(owner, "__qualname__", None)
        or getattr(owner, "__name__", None)
        or type(owner).__name__
    )


def describe() -> list[tuple[str, str, str]]:
    """``(where, what, why)`` for every change: attributes first, then registry entries."""
    rows = [(_name(a.owner), a.name, a.why) for a in _attributes or _attribute_table()]
    rows += [(e.table_name, str(e.key), e.why) for e in _entries.values()]
    rows += [(f"dispatcher {'/'.join(k.keys)}", str(k.op), k.why) for k in _kernels]
    rows += [
        ("torch.serialization safe globals", f"{g.__module__}.{g.__qualname__}", _SAFE_GLOBALS_WHY)
        for g in _safe_globals()
    ]
    return rows
