"""``vescale.DTensor``: upstream ``DTensor`` with veScale's conversion semantics.

Every DTensor op output is a ``vescale.DTensor`` (upstream's dispatcher wraps outputs
through ``OpDispatcher.wrap``, which we point at our class at import, before any DTensor
op runs; the C++ fast path and its sharding cache are untouched).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale.dtensor._recording import ACTIVE as _RECORDING
from vescale.dtensor._recording import record_placements
from vescale.dtensor._torch_compat import DTensorSpec, OpDispatcher
from vescale.dtensor.device_mesh import DeviceMesh
from vescale.dtensor.placement_types import Placement

__all__ = ["DTensor"]


class DTensor(_UpstreamDTensor):
    """A distributed tensor; accepted everywhere an upstream ``DTensor`` is.

    ``DTensor.from_local`` is :func:`vescale.from_local` (bound in ``api.py``).
    """

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
        return out  # type: ignore[return-value]


_upstream_wrap = OpDispatcher.wrap
_new_dtensor = _UpstreamDTensor.__new__  # C++ ``_dtensor__new__``: sets _local_tensor and _spec


def _wrap(res: object, spec: object) -> object:
    """Upstream's output wrapping, producing ``vescale.DTensor``.

    Outside ``torch.export`` the object is built by ``__new__`` alone: upstream's
    ``__init__`` does nothing but pass through two Python wrappers (dynamo-disable and the
    export constructor hook), which cost ~1.2 us per op output.
    """
    if _RECORDING[0]:
        record_placements(res, spec)
    if isinstance(res, torch.Tensor):
        if isinstance(spec, DTensorSpec):
            if torch.compiler.is_exporting():
                return DTensor(res, spec, requires_grad=res.requires_grad)  # type: ignore[call-arg]
            return _new_dtensor(DTensor, res, spec, requires_grad=res.requires_grad)
        return _upstream_wrap(res, spec)
    if isinstance(res, list | tuple) and isinstance(spec, list | tuple):
        out = [_wrap(r, s) for r, s in zip(res, spec)]
        return tuple(out) if isinstance(res, tuple) else out
    return _upstream_wrap(res, spec)


OpDispatcher.wrap = staticmethod(_wrap)  # type: ignore[method-assign,assignment]

from vescale.dtensor import api  # noqa: E402  (api imports DTensor from here)
