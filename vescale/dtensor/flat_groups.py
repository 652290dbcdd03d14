"""Flattened meshes: one process group over several mesh dims, for one collective there.

A reduction over several mesh dims at once (``(Partial, Partial) -> (Replicate, Replicate)``)
is one collective over the flattened group of those dims once upstream's flattened mesh
(``DeviceMesh._flatten``) exists: upstream's planner then merges the per-dim steps. This
module creates those meshes, once per mesh object and set of dims, and remembers them.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from vescale._torch_compat import disable_current_modes

__all__ = ["flatten_mesh_dims", "flattened_mesh", "flattened_meshes"]

# per mesh *object* (equal meshes are distinct roots to upstream's flatten mapping)
_flattened: dict[int, tuple[weakref.ref[Any], dict[tuple[int, ...], Any]]] = {}


def _known(mesh: Any) -> dict[tuple[int, ...], Any]:
    entry = _flattened.get(id(mesh))
    if entry is None or entry[0]() is not mesh:
        entry = _flattened[id(mesh)] = (weakref.ref(mesh), {})
    return entry[1]


def flattened_mesh(mesh: Any, mesh_dims: Sequence[int]) -> Any:
    """The 1-D mesh over ``mesh_dims`` of ``mesh`` flattened (upstream ``DeviceMesh._flatten``;
    upstream's planner uses it, once it exists, for one collective over those dims), created on
    first use; ``None`` for fewer than two dims, a meta or unnamed mesh, or a mesh whose root
    does not span the world (creating a group is collective over every rank). Never created
    while compiling (Dynamo cannot trace group creation): compiled code finds the meshes that
    :func:`vescale.init_device_mesh` or ``DistributedDataParallel`` made beforehand."""
    dims = tuple(sorted(set(mesh_dims)))
    if len(dims) < 2 or mesh.device_type == "meta" or not mesh.mesh_dim_names:
        return None
    known = _known(mesh)
    if dims in known or torch.compiler.is_compiling() or not dist.is_initialized():
        return known.get(dims)
    flat = None
    if mesh._get_root_mesh().size() == dist.get_world_size():
        names = tuple(mesh.mesh_dim_names[d] for d in dims)
        with disable_current_modes():
            flat = mesh[names]._flatten()
    known[dims] = flat
    return flat


def flattened_meshes(mesh: Any) -> dict[tuple[int, ...], Any]:
    """The flattened meshes of ``mesh`` created so far, by mesh dims (``None``: none can be);
    creates nothing."""
    return dict(_known(mesh))


def flatten_mesh_dims(mesh: Any) -> None:
    """Flattened meshes for every set of two or more of ``mesh``'s dims (see
    :func:`flattened_mesh`), so reductions traced by Dynamo, which cannot create process
    groups, find them too. A 2-D mesh over the world adds one mesh and no new group."""
    for n in range(2, mesh.ndim + 1):
        for dims in itertools.combinations(range(mesh.ndim), n):
            flattened_mesh(mesh, dims)
