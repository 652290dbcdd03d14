"""Checks of a placement plan against the model and the mesh, before anything communicates."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from vescale.dtensor.placement_types import InterleavedShard

__all__ = ["PlanError", "normalize_placements", "normalize_plan", "validate_inputs"]

Placements = tuple[Placement, ...]


class PlanError(ValueError):
    """A plan that does not fit the model, the mesh or the inputs, or that could not be
    solved (raised on every rank with the same text)."""


ACCEPTED = "Shard(dim), Replicate(), Partial() or InterleavedShard(dim, size) (from vescale)"


def _mesh_text(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return "mesh(" + ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape)) + ")"


def normalize_placements(what: str, value: Any, mesh: DeviceMesh) -> Placements:
    """``value`` (one placement per mesh dim, or ``{mesh dim name: placement}``) as a tuple;
    anything else, or an entry that is not a ``Placement`` (e.g. the string ``"Shard(0)"``),
    raises :class:`PlanError` naming ``what``, the value and the accepted types."""
    if isinstance(value, Mapping):
        names = list(mesh.mesh_dim_names or ())
        unknown = [k for k in value if k not in names]
        if unknown:
            raise PlanError(
                f"{what}: mesh dim {unknown[0]!r} does not exist in {_mesh_text(mesh)} (its dims: {names})"
            )
        for name, p in value.items():
            _check_placement(f"{what}[{name!r}]", p)
        return tuple(value.get(n, Replicate()) for n in names)
    if isinstance(value, Placement):
        value = (value,)
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise PlanError(
            f"{what}: {value!r} ({type(value).__name__}) is not placements: give one "
            f"placement per dim of {_mesh_text(mesh)} or {{mesh dim name: placement}}, "
            f"each a {ACCEPTED}"
        )
    out = tuple(value)
    for i, p in enumerate(out):
        _check_placement(f"{what}[{i}]", p)
    if len(out) != mesh.ndim:
        raise PlanError(f"{what}: {out} is not one placement per dim of {_mesh_text(mesh)}")
    return out


def _check_placement(what: str, p: Any) -> None:
    if not isinstance(p, Placement):
        raise PlanError(
            f"{what}: {p!r} ({type(p).__name__}) is not a placement: use {ACCEPTED}, "
            "not a string or another type"
        )


def check_fits(what: str, placements: Placements, t: torch.Tensor, mesh: DeviceMesh) -> None:
    """Every sharded dim exists in ``t``; an ``InterleavedShard`` divides evenly."""
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, Shard):
            continue
        if not -t.ndim <= p.dim < t.ndim:
            raise PlanError(
                f"{what}: {p!r} on mesh dim {mesh_dim} of {_mesh_text(mesh)} shards dim {p.dim}, "
                f"but the tensor has shape {tuple(t.shape)}"
            )
        if isinstance(p, InterleavedShard):
            size, k, n = t.shape[p.dim], p.interleaved_size, mesh.size(mesh_dim)
            if size % k or (size // k) % n:
                raise PlanError(
                    f"{what}: {p!r} on mesh dim {mesh_dim} of {_mesh_text(mesh)}: dim {p.dim} of size "
                    f"{size} is not {k} groups divisible by {n} ranks"
                )


def normalize_plan(
    plan: Mapping[str, Any], tensors: Mapping[str, torch.Tensor | None], mesh: DeviceMesh
) -> dict[str, Placements]:
    """Name -> placements for every tensor a plan pattern matches (first match wins); a
    pattern that matches nothing, or placements that do not fit, raise :class:`PlanError`
    naming the pattern or tensor, the placement and the mesh."""
    resolved = {
        pattern: normalize_placements(f"plan[{pattern!r}]", v, mesh) for pattern, v in plan.items()
    }
    out: dict[str, Placements] = {}
    used: set[str] = set()
    for name, t in tensors.items():
        pattern = next((p for p in resolved if fnmatch.fnmatchcase(name, p)), None)
        if pattern is None:
            continue
        used.add(pattern)
        if t is not None:
            check_fits(f"plan[{pattern!r}] for {name!r}", resolved[pattern], t, mesh)
        out[name] = resolved[pattern]
    unused = [p for p in resolved if p not in used]
    if unused:
        raise PlanError(
            f"plan pattern {unused[0]!r} (placements {resolved[unused[0]]} on {_mesh_text(mesh)}) "
            f"matches no parameter or buffer; names look like {list(tensors)[:4]}"
        )
    return out


def validate_inputs(
    inputs: Sequence[Any], examples: Sequence[torch.Tensor], mesh: DeviceMesh
) -> list[Placements]:
    if len(inputs) != len(examples):
        raise PlanError(f"inputs gives {len(inputs)} placements for {len(examples)} example inputs")
    out = []
    for i, (p, t) in enumerate(zip(inputs, examples)):
        placements = normalize_placements(f"inputs[{i}]", p, mesh)
        check_fits(f"inputs[{i}]", placements, t, mesh)
        out.append(placements)
    return out
