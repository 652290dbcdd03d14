"""``vescale.DTensor``: upstream ``DTensor`` with veScale's conversion semantics.

What is vescale's is marked on the spec: a ``vescale.DTensor`` carries a
:class:`VescaleSpec`, equal to the ``DTensorSpec`` with the same fields but hashed apart, so
upstream's sharding caches (C++ and Python) keep the results of ops on vescale DTensors
apart from those on upstream DTensors. An op with a vescale input gets ``VescaleSpec``
outputs (``dispatch.py`` marks them after propagation), and :func:`wrap_output` (upstream's
``OpDispatcher.wrap``, replaced through ``vescale._patches``) builds a ``vescale.DTensor``
for those and exactly what upstream builds otherwise. On a cache hit this costs one type
check per output; upstream DTensors keep upstream's classes and behaviour.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._torch_compat import DTensorSpec, OpDispatcher
from vescale.dtensor._recording import ACTIVE as _RECORDING
from vescale.dtensor._recording import record_placements
from vescale.dtensor.device_mesh import DeviceMesh
from vescale.dtensor.placement_types import Placement

__all__ = [
    "DTensor",
    "VescaleSpec",
    "as_vescale_spec",
    "is_vescale_spec",
    "upstream_init",
    "vescale_rules",
    "vescale_rules_active",
    "wrap_output",
]


class VescaleSpec(DTensorSpec):
    """The spec of a ``vescale.DTensor``: equal to the ``DTensorSpec`` with the same fields,
    hashed apart (so sharding caches keep vescale's results apart), and AOTAutograd's stable
    hash tells the two apart too."""

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


_rules = threading.local()


def vescale_rules_active() -> bool:
    """Whether the sharding propagation running now is for an op with a vescale input, so
    vescale-only strategy rules apply (upstream's rules otherwise)."""
    return bool(getattr(_rules, "on", False))


@contextlib.contextmanager
def vescale_rules(on: bool = True) -> Iterator[None]:
    """Propagate with vescale's rules (``on``) or upstream's in this scope and thread; the
    dispatcher sets it per op, and direct callers of strategies (the plan path) use it."""
    prev = getattr(_rules, "on", False)
    _rules.on = on
    try:
        yield
    finally:
        _rules.on = prev


class DTensor(_UpstreamDTensor):
    """A distributed tensor; accepted everywhere an upstream ``DTensor`` is.

    ``DTensor.from_local`` is :func:`vescale.from_local` (bound in ``api.py``).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> DTensor:
        """Upstream's ``(local, spec, *, requires_grad)`` or veScale legacy's ``(local, mesh,
        placements, *, shape, dtype, requires_grad, stride)`` (see ``_legacy.construct``)."""
        from vescale.dtensor._legacy import construct

        return construct(cls, *args, **kwargs)  # type: ignore[no-any-return]

    def tolist(self) -> Any:
        """veScale legacy's ``tolist``: this rank's local values (see ``_legacy.tolist``)."""
        from vescale.dtensor._legacy import tolist

        return tolist(self)

    def to_local(  # type: ignore[override]
        self,
        *,
        grad_placements: Sequence[Placement] | None = None,
        async_output: bool = True,
    ) -> torch.Tensor:
        """The local shard; ``async_output=False`` waits any in-flight collective first."""
        return api.to_local(self, grad_placements=grad_placements, async_output=async_output)

    def redistribute(  # type: ignore[override]
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        async_op: bool = True,
    ) -> DTensor:
        """See :func:`vescale.redistribute_dtensor`."""
        return api.redistribute_dtensor(self, device_mesh, placements, async_op=async_op)

    def full_tensor(  # type: ignore[override]
        self, *, grad_placements: Sequence[Placement] | None = None
    ) -> torch.Tensor:
        """The whole global tensor on every rank, waited."""
        return api.full_tensor(self, grad_placements=grad_placements)

    def data_ptr(self) -> int:
        """The local shard's ``data_ptr()`` (for pointer-taking plug-in kernels)."""
        return api.wait_local(self._local_tensor).data_ptr()

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


from vescale.dtensor import api  # noqa: E402  (api imports DTensor from here)
