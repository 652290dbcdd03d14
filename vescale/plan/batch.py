"""``Batch``: an input placement the compiler chooses (the batch split over any of the mesh
dims the user allows)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Replicate, Shard

from vescale.plan.propagate import Placements
from vescale.plan.validate import PlanError

__all__ = ["Batch", "batch_choices"]


class Batch:
    """``inputs=[Batch("dp", "tp"), ...]``: tensor dim ``dim`` of this input is the batch;
    the compiler splits it over one or more of ``mesh_dims`` (mesh dim names or indices),
    its choice, and replicates it over the other mesh dims. Only sets of mesh dims whose
    ranks divide the batch evenly are candidates; the mesh dims named are data-parallel (a
    value computed from the inputs is not gathered over them where a choice keeps it
    split)."""

    __slots__ = ("dim", "mesh_dims")

    def __init__(self, *mesh_dims: str | int, dim: int = 0) -> None:
        self.mesh_dims = mesh_dims
        self.dim = dim

    def __repr__(self) -> str:
        dims = ", ".join(repr(d) for d in self.mesh_dims)
        return f"Batch({dims}{'' if self.dim == 0 else f', dim={self.dim}'})"


def _mesh_text(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return "mesh(" + ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape)) + ")"


def _mesh_dim(what: str, d: Any, mesh: DeviceMesh) -> int:
    names = list(mesh.mesh_dim_names or ())
    if isinstance(d, str) and d in names:
        return names.index(d)
    if isinstance(d, int) and not isinstance(d, bool) and 0 <= d < mesh.ndim:
        return d
    raise PlanError(
        f"{what}: mesh dim {d!r} is not a dim of {_mesh_text(mesh)} "
        f"(give its name, one of {names}, or an index below {mesh.ndim})"
    )


def batch_choices(what: str, spec: Batch, example: Any, mesh: DeviceMesh) -> list[Placements]:
    """The placements ``spec`` allows for ``example``, the most split first (greedy's and
    eager's pick); :class:`PlanError` naming ``what``, the spec and the mesh if it is wrong."""
    if not spec.mesh_dims:
        raise PlanError(f"{what}: {spec!r} names no mesh dim to split the batch over")
    dims = [_mesh_dim(what, d, mesh) for d in spec.mesh_dims]
    if len(set(dims)) != len(dims):
        raise PlanError(f"{what}: {spec!r} names a mesh dim of {_mesh_text(mesh)} twice")
    shape = tuple(getattr(example, "shape", ()))
    if not isinstance(example, torch.Tensor) or not isinstance(spec.dim, int):
        raise PlanError(f"{what}: {spec!r} needs a tensor example input and an integer dim")
    if not -len(shape) <= spec.dim < len(shape):
        raise PlanError(
            f"{what}: {spec!r} splits dim {spec.dim}, but the input has shape {shape} "
            f"(on {_mesh_text(mesh)})"
        )
    dim = spec.dim % len(shape)
    out: list[Placements] = []
    for k in range(len(dims), 0, -1):
        for subset in itertools.combinations(sorted(dims), k):
            if shape[dim] % math.prod(mesh.size(d) for d in subset) == 0:
                out.append(
                    tuple(Shard(dim) if d in subset else Replicate() for d in range(mesh.ndim))
                )
    if not out:
        sizes = {spec.mesh_dims[i]: mesh.size(d) for i, d in enumerate(dims)}
        raise PlanError(
            f"{what}: {spec!r}: no set of the mesh dims {sizes} (ranks each) of "
            f"{_mesh_text(mesh)} divides dim {dim} of size {shape[dim]} evenly; use a batch "
            f"that a mesh dim divides, or place the input explicitly"
        )
    return out
