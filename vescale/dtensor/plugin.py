"""``plugin_op``: a plain-tensor kernel (APEX-style fused op, C++ extension) on DTensors."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale.dtensor.dtensor import DTensor, from_local, redistribute_dtensor, to_local
from vescale.dtensor.placement_types import Placement

__all__ = ["plugin_op"]


def plugin_op(
    kernel: Callable[..., Any],
    out_placements: Sequence[Placement] | Sequence[Sequence[Placement]],
    in_placements: Sequence[Sequence[Placement] | None] | None = None,
    *,
    grad_placements: Sequence[Sequence[Placement] | None] | None = None,
) -> Callable[..., Any]:
    """Run a plain-tensor kernel (APEX-style fused op, C++ extension) on DTensors.

    The kernel receives waited local shards (never ``AsyncCollectiveTensor``), so raw
    pointers (``data_ptr()``) are valid; DTensor positional inputs are first redistributed
    to ``in_placements[i]`` where given. Tensor outputs become DTensors with
    ``out_placements`` (one placement list, or one per output), assumed evenly sharded.
    Autograd flows through the kernel's own autograd; ``grad_placements[i]`` declares the
    layout of input ``i``'s local gradient (default: its placements, Partial -> Replicate).
    """
    multi = bool(out_placements) and not isinstance(out_placements[0], Placement)

    @functools.wraps(kernel)
    def run(*args: Any, **kwargs: Any) -> Any:
        mesh = next((a.device_mesh for a in args if isinstance(a, _UpstreamDTensor)), None)
        if mesh is None:
            return kernel(*args, **kwargs)
        local_args = []
        for i, a in enumerate(args):
            if isinstance(a, _UpstreamDTensor):
                want = in_placements[i] if in_placements is not None else None
                if want is not None and tuple(want) != tuple(a.placements):
                    a = redistribute_dtensor(a, mesh, want)
                gp = grad_placements[i] if grad_placements is not None else None
                if isinstance(a, DTensor):  # the method form traces in one graph
                    a = a.to_local(grad_placements=gp, async_output=False)
                else:
                    a = to_local(a, grad_placements=gp, async_output=False)
            local_args.append(a)
        out = kernel(*local_args, **kwargs)
        outs = out if multi else (out,)
        layouts = out_placements if multi else (out_placements,)
        wrapped = tuple(
            from_local(o, mesh, p, run_check=False, support_uneven=False)  # type: ignore[arg-type]
            if isinstance(o, torch.Tensor)
            else o
            for o, p in zip(outs, layouts)
        )
        return wrapped if multi else wrapped[0]

    return run
