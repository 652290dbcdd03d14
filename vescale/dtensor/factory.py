"""DTensor factories (``vescale.dtensor.zeros/ones/empty/full/rand/randn/arange``), legacy's API.

Each returns the DTensor whose global value is what the ``torch`` factory returns on one device:
a ``Shard`` holds this rank's ``torch.chunk`` piece, ``Replicate`` the whole tensor, and
``Partial(op)`` a local value that ``op``-reduces to it (``sum``: the value on coordinate 0 of
each Partial mesh dim, zeros elsewhere; ``avg``/``max``/``min``: the value everywhere), as
:func:`vescale.distribute_tensor` lays it out. ``rand``/``randn`` give the single-device values
under the same seed (:mod:`vescale.dtensor.random`). A rank outside ``device_mesh`` holds an
empty local tensor. No communication is involved.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from vescale.dtensor._utils import compute_local_shape_and_global_offset
from vescale.dtensor.dtensor import DTensor, _mesh, new_dtensor
from vescale.dtensor.layout import contiguous_strides
from vescale.dtensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    make_spec,
    normalize_placements,
)
from vescale.dtensor.ragged import find_ragged, replace_ragged
from vescale.dtensor.redistribute import replicate_to_partial

__all__ = ["arange", "empty", "full", "ones", "rand", "randn", "zeros"]

Size = int | Sequence[int] | torch.Size


def _global_shape(size: Sequence[Size], what: str) -> torch.Size:
    if len(size) == 1 and not isinstance(size[0], int):
        size = tuple(size[0])
    if not all(isinstance(s, int) and s >= 0 for s in size):
        raise ValueError(f"{what}: size must be non-negative ints, got {tuple(size)}")
    return torch.Size(size)  # type: ignore[arg-type]


def _build(
    what: str,
    shape: torch.Size,
    fill: Callable[[torch.Size, torch.dtype | None, Any], torch.Tensor],
    *,
    dtype: torch.dtype | None,
    layout: torch.layout,
    requires_grad: bool,
    device_mesh: Any,
    placements: Sequence[Placement] | None,
    random: Callable[[DTensor], Any] | None = None,
) -> DTensor:
    """``fill(local_shape, dtype, offset)`` this rank's piece (or ``random`` in place on the
    whole DTensor), then Partial mesh dims made to reduce to it."""
    if layout != torch.strided:
        raise ValueError(f"{what}: only torch.strided is supported, got layout={layout}")
    mesh = _mesh(device_mesh, what)
    pl = normalize_placements(placements, mesh, len(shape), what=what, shape=shape)
    if find_ragged(pl) is not None:  # the values laid out without it, then the local slice
        whole = _build(
            what, shape, fill, dtype=dtype, layout=layout, requires_grad=False,
            device_mesh=mesh, placements=replace_ragged(pl, Replicate()), random=random,
        )  # fmt: skip
        out = whole.redistribute(mesh, pl, async_op=False).detach()
        return out.requires_grad_(requires_grad)  # type: ignore[return-value]
    value_pl = tuple(Replicate() if p.is_partial() else p for p in pl)
    device = torch.device(mesh.device_type)
    if mesh.get_coordinate() is None:
        local = fill(torch.Size([0]), dtype, None).to(device)
    else:
        local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, value_pl)
        local = fill(torch.Size(local_shape), dtype, offset).to(device)
    stride = contiguous_strides(shape)
    spec = make_spec(mesh, value_pl, shape, stride, local.dtype)
    out = new_dtensor(local, spec, requires_grad=False)
    if random is not None:
        with torch.no_grad():
            random(out)
    local = out._local_tensor
    coord = mesh.get_coordinate()
    if coord is not None:
        for mesh_dim, p in enumerate(pl):
            if p.is_partial():
                local = replicate_to_partial(local, cast(Partial, p).reduce_op, coord[mesh_dim])
    spec = make_spec(mesh, pl, shape, stride, local.dtype)
    return new_dtensor(local.detach(), spec, requires_grad=requires_grad)


def _constant(
    op: Callable[..., torch.Tensor], *args: Any
) -> Callable[[torch.Size, torch.dtype | None, Any], torch.Tensor]:
    return lambda shape, dtype, _offset: op(shape, *args, dtype=dtype)


def zeros(
    *size: Size,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    device_mesh: Any = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """``torch.zeros(*size)`` laid out as ``placements`` on ``device_mesh``."""
    shape = _global_shape(size, "zeros")
    return _build(
        "zeros", shape, _constant(torch.zeros), dtype=dtype, layout=layout,
        requires_grad=requires_grad, device_mesh=device_mesh, placements=placements,
    )  # fmt: skip


def ones(
    *size: Size,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    device_mesh: Any = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """``torch.ones(*size)`` laid out as ``placements`` on ``device_mesh``."""
    shape = _global_shape(size, "ones")
    return _build(
        "ones", shape, _constant(torch.ones), dtype=dtype, layout=layout,
        requires_grad=requires_grad, device_mesh=device_mesh, placements=placements,
    )  # fmt: skip


def empty(
    *size: Size,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    device_mesh: Any = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """``torch.empty(*size)`` laid out as ``placements`` (a Partial-sum coordinate other than
    0 holds zeros)."""
    shape = _global_shape(size, "empty")
    return _build(
        "empty", shape, _constant(torch.empty), dtype=dtype, layout=layout,
        requires_grad=requires_grad, device_mesh=device_mesh, placements=placements,
    )  # fmt: skip


def full(
    size: Sequence[int] | torch.Size,
    fill_value: float | int | bool,
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    device_mesh: Any = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """``torch.full(size, fill_value)`` laid out as ``placements`` on ``device_mesh``."""
    shape = _global_shape((size,), "full")
    return _build(
        "full", shape, _constant(torch.full, fill_value), dtype=dtype, layout=layout,
        requires_grad=requires_grad, device_mesh=device_mesh, placements=placements,
    )  # fmt: skip


def rand(
    *size: Size,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    device_mesh: Any = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """``torch.rand(*size)`` (the single-device values) laid out as ``placements``."""
    shape = _global_shape(size, "rand")
    return _build(
        "rand", shape, _constant(torch.empty), dtype=dtype, layout=layout,
        requires_grad=requires_grad, device_mesh=device_mesh, placements=placements,
        random=lambda t: t.uniform_(0, 1),
    )  # fmt: skip


def randn(
    *size: Size,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    device_mesh: Any = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """``torch.randn(*size)`` (the single-device values) laid out as ``placements``."""
    shape = _global_shape(size, "randn")
    return _build(
        "randn", shape, _constant(torch.empty), dtype=dtype, layout=layout,
        requires_grad=requires_grad, device_mesh=device_mesh, placements=placements,
        random=lambda t: t.normal_(0, 1),
    )  # fmt: skip


def arange(
    *start_end_step: float | int,
    dtype: torch.dtype | None = None,
    layout: torch.layout = torch.strided,
    requires_grad: bool = False,
    device_mesh: Any = None,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """``torch.arange(*start_end_step)`` laid out as ``placements``: each shard is computed
    from its global offset (``start + offset * step``)."""
    args = tuple(start_end_step)
    start: float | int
    end: float | int
    step: float | int
    if len(args) == 1:
        start, end, step = 0, args[0], 1
    elif len(args) == 2:
        start, end, step = args[0], args[1], 1
    elif len(args) == 3:
        start, end, step = args
    else:
        raise ValueError(f"arange: takes 1 to 3 positional args, got {len(args)}")
    if step == 0:
        raise ValueError("arange: step must be nonzero")
    n = max(0, math.ceil((end - start) / step))
    out_dtype = dtype or torch.arange(start, end, step).dtype  # torch's dtype inference
    acc = torch.float64 if out_dtype.is_floating_point else torch.int64

    def fill(shape: torch.Size, _dtype: torch.dtype | None, offset: Any) -> torch.Tensor:
        first = start + (offset[0] if offset else 0) * step
        return (torch.arange(shape[0], dtype=acc) * step + first).to(out_dtype)

    return _build(
        "arange", torch.Size([n]), fill, dtype=dtype, layout=layout,
        requires_grad=requires_grad, device_mesh=device_mesh, placements=placements,
    )  # fmt: skip
