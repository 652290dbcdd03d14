"""Op results on a rank outside the op's mesh, by upstream's rule: empty local results and
no communication, without running any handler."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._torch_compat import DTensorSpec, TensorMeta
from vescale.dtensor.dtensor import new_dtensor
from vescale.dtensor.placement_types import Replicate

__all__ = ["off_mesh_result", "op_mesh"]


def op_mesh(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The mesh of the op's first DTensor input (upstream's compute mesh)."""
    for a in pytree.tree_leaves((args, kwargs)):
        if isinstance(a, _UpstreamDTensor):
            return a.device_mesh
    return None


def off_mesh_result(
    op: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    data_dependent: bool,
) -> Any:
    """``op`` on a rank outside its mesh: Replicate results with the global shapes and dtypes
    of ``op`` on meta tensors of the inputs' global shapes (``data_dependent``: ops whose
    output shapes depend on values, of ``op`` on empty inputs); in-place and ``out=`` ops
    return their DTensor."""
    mesh = op_mesh(args, kwargs)
    leaves, tree = pytree.tree_flatten((args, kwargs))
    own: dict[int, Any] = {}
    fakes = []
    for a in leaves:
        if isinstance(a, torch.Tensor):
            fake = (
                torch.empty((0,) * a.ndim, dtype=a.dtype)
                if data_dependent
                else torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
            )
            own[id(fake)] = a
            a = fake
        fakes.append(a)
    f_args, f_kwargs = pytree.tree_unflatten(fakes, tree)
    out = op(*f_args, **f_kwargs)

    def wrap(o: Any) -> Any:
        if not isinstance(o, torch.Tensor):
            return o
        if id(o) in own:
            return own[id(o)]
        meta = TensorMeta(o.shape, o.stride(), o.dtype)
        spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=meta)
        local = torch.zeros((), dtype=o.dtype) if o.ndim == 0 else torch.tensor([], dtype=o.dtype)
        return new_dtensor(local, spec, requires_grad=False)

    return pytree.tree_map(wrap, out)
