"""veScale-legacy mesh collectives (``vescale.dtensor._collective_utils``), over upstream's.

Each collective runs over the process group of one mesh dim and returns the same tensor on
this rank that legacy's did. A rank outside ``mesh`` gets its input back (no communication).
``mesh_scatter``/``mesh_broadcast`` take the first rank of the mesh dim as the source;
``reduce_op`` is a ``ReduceOp`` or its name (``"sum"``, ...), as ``Partial.reduce_op`` is.
``async_op`` is accepted for legacy's signatures; these calls always complete before returning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from vescale._torch_compat import mesh_scatter
from vescale.dtensor.placement_types import _reduce_op_name

__all__ = [
    "mesh_all_gather",
    "mesh_all_reduce",
    "mesh_all_to_all",
    "mesh_broadcast",
    "mesh_reduce_scatter",
    "mesh_scatter",
]


def _group(mesh: Any, mesh_dim: int, what: str) -> dist.ProcessGroup:
    if not -mesh.ndim <= mesh_dim < mesh.ndim:
        raise ValueError(f"{what}: mesh_dim {mesh_dim} out of range for {mesh}")
    return mesh.get_group(mesh_dim)  # type: ignore[no-any-return]


def mesh_broadcast(
    tensor: torch.Tensor, mesh: Any, mesh_dim: int = 0, async_op: bool = False
) -> torch.Tensor:
    """``tensor`` of the first rank along ``mesh_dim``, on every rank of that dim (in place)."""
    if mesh.get_coordinate() is None:
        return tensor
    group = _group(mesh, mesh_dim, "mesh_broadcast")
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    return tensor


def mesh_all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    mesh: Any,
    mesh_dim: int = 0,
    async_op: bool = False,
) -> None:
    """Rank ``i`` of ``mesh_dim`` receives ``input_tensor_list[i]`` of rank ``j`` into
    ``output_tensor_list[j]``. Backends without all-to-all (gloo) run one scatter per source."""
    if mesh.get_coordinate() is None:
        return
    group = _group(mesh, mesh_dim, "mesh_all_to_all")
    n = dist.get_world_size(group)
    if len(output_tensor_list) != n or len(input_tensor_list) != n:
        raise ValueError(
            f"mesh_all_to_all: need {n} input and output tensors (mesh dim {mesh_dim} of "
            f"{mesh}), got {len(input_tensor_list)} and {len(output_tensor_list)}"
        )
    if dist.get_backend(group) != "gloo":
        dist.all_to_all(output_tensor_list, input_tensor_list, group=group)
        return
    me = dist.get_rank()
    for i in range(n):
        src = dist.get_global_rank(group, i)
        scatter_list = [t.contiguous() for t in input_tensor_list] if src == me else None
        dist.scatter(output_tensor_list[i], scatter_list, src=src, group=group)


def mesh_all_gather(
    tensor: torch.Tensor,
    global_size: Sequence[int],
    mesh: Any,
    scatter_dim: int,
    mesh_dim: int,
) -> torch.Tensor:
    """The even shards along ``scatter_dim`` of ``mesh_dim`` concatenated (``global_size`` is
    the gathered size, checked)."""
    if mesh.get_coordinate() is None:
        return tensor
    n = mesh.size(mesh_dim)
    if tensor.size(scatter_dim) * n != global_size[scatter_dim]:
        raise ValueError(
            f"mesh_all_gather: {n} shards of size {tensor.size(scatter_dim)} on dim "
            f"{scatter_dim} do not make global size {tuple(global_size)} (mesh dim {mesh_dim} "
            f"of {mesh})"
        )
    group = _group(mesh, mesh_dim, "mesh_all_gather")
    out = funcol.all_gather_single(tensor.contiguous(), scatter_dim, group)
    return funcol.wait_tensor(out)


def mesh_all_reduce(tensor: torch.Tensor, mesh: Any, reduce_op: Any, mesh_dim: int) -> torch.Tensor:
    """``reduce_op`` of ``tensor`` over ``mesh_dim``."""
    if mesh.get_coordinate() is None:
        return tensor
    group = _group(mesh, mesh_dim, "mesh_all_reduce")
    return funcol.wait_tensor(funcol.all_reduce(tensor, _reduce_op_name(reduce_op), group))


def mesh_reduce_scatter(
    tensor: torch.Tensor, mesh: Any, reduce_op: Any, scatter_dim: int, mesh_dim: int
) -> torch.Tensor:
    """This rank's even chunk along ``scatter_dim`` of ``reduce_op`` of ``tensor`` over ``mesh_dim``."""
    if mesh.get_coordinate() is None:
        return tensor
    n = mesh.size(mesh_dim)
    if tensor.size(scatter_dim) % n:
        raise ValueError(
            f"mesh_reduce_scatter: size {tensor.size(scatter_dim)} of dim {scatter_dim} is not "
            f"divisible by mesh dim {mesh_dim} of size {n} ({mesh})"
        )
    group = _group(mesh, mesh_dim, "mesh_reduce_scatter")
    out = funcol.reduce_scatter_tensor(
        tensor.contiguous(), _reduce_op_name(reduce_op), scatter_dim, group
    )
    return funcol.wait_tensor(out)
