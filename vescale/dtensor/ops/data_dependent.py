"""Data-dependent ops: ``nonzero`` on Replicate inputs, ``unique`` (``_unique2``) on any.

Their output shapes depend on values, so fake propagation cannot know them; on Replicate
inputs every rank computes the same result, whose tensor meta is taken from the local result.

``_unique2`` on a sharded input never gathers the input: each rank takes its local unique
values, those (variable-length, padded to the longest) are all-gathered along each sharding
mesh dim and merged, so every rank holds the sorted global uniques (Replicate). The inverse
indices are a local ``searchsorted`` into them and keep the input's placements; the counts
are the local counts placed at their global positions, all-reduced (SUM) over the sharding
mesh dims. Communication: the unique values (twice: sizes, then values) and the counts,
never the input. ``Partial`` inputs are reduced first (the explicit-mode error when on).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor as _UpstreamDTensor

from vescale._torch_compat import DTensorSpec, OpSchema
from vescale.dtensor.dtensor import from_local, wrap_local
from vescale.dtensor.explicit import redistribute_for
from vescale.dtensor.hooks import bypass_dispatch, bypass_sharding_prop, python_dispatch
from vescale.dtensor.inflight import wait_local
from vescale.dtensor.op_args import bind, unbind
from vescale.dtensor.placement_types import Placement, Replicate

__all__ = ["replicate_only", "sharded_unique"]

aten = torch.ops.aten

# op -> number of tensor outputs
DATA_DEPENDENT_OPS = {aten.nonzero.default: 1, aten._unique2.default: 3}


@bypass_sharding_prop(list(DATA_DEPENDENT_OPS))
def replicate_only(schema: OpSchema) -> tuple[Placement, ...] | tuple[tuple[Placement, ...], ...]:
    """Replicate outputs for Replicate inputs; anything else raises naming op and placements."""
    specs = [a for a in schema.args_schema if isinstance(a, DTensorSpec)]
    mesh = specs[0].mesh
    for spec in specs:
        if not all(p.is_replicate() for p in spec.placements):
            raise RuntimeError(
                f"{schema.op}: supported on Replicate inputs only, got {tuple(spec.placements)} "
                f"on {mesh}; redistribute the input to Replicate first"
            )
    out = (Replicate(),) * mesh.ndim
    n = DATA_DEPENDENT_OPS[schema.op]
    return out if n == 1 else (out,) * n


def _gather_values(values: torch.Tensor, mesh: Any, mesh_dim: int) -> torch.Tensor:
    """The concatenation of every rank's 1-D ``values`` along ``mesh_dim``."""
    n = torch.tensor([values.numel()], device=values.device)
    sizes = wait_local(funcol.all_gather_single(n, 0, (mesh, mesh_dim))).tolist()
    padded = values.new_zeros(max(sizes))
    padded[: values.numel()] = values
    gathered = wait_local(funcol.all_gather_single(padded, 0, (mesh, mesh_dim)))
    return torch.cat([c[:s] for c, s in zip(gathered.chunk(len(sizes)), sizes)])


def _replicated(local: torch.Tensor, mesh: Any) -> Any:
    return from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False, support_uneven=False)


@bypass_dispatch(
    aten._unique2.default,
    when=lambda op, a, kw: isinstance(bind(op, a, kw)["self"], _UpstreamDTensor),
)
def sharded_unique(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch.unique(x, sorted, return_inverse, return_counts)`` of a DTensor ``x`` (see module
    docstring)."""
    bound = bind(op, args, kwargs)
    x = bound["self"]
    mesh = x.device_mesh
    if any(p.is_partial() for p in x.placements):
        x = redistribute_for(op, x, [Replicate() if p.is_partial() else p for p in x.placements])
    sharding = [i for i, p in enumerate(x.placements) if p.is_shard() and mesh.size(i) > 1]
    if not sharding:
        return python_dispatch(op, *unbind(op, bound | {"self": x}), replicate_only)
    local = wait_local(x._local_tensor)
    values, _, counts = torch._unique2(local, sorted=True, return_counts=True)
    merged = values
    for mesh_dim in sharding:
        merged = torch.unique(_gather_values(merged, mesh, mesh_dim), sorted=True)
    empty = local.new_empty(0, dtype=torch.long)
    inverse = empty
    if bound["return_inverse"]:
        inverse = wrap_local(torch.searchsorted(merged, local), mesh, x.placements, x.shape)
    global_counts: Any = _replicated(empty, mesh)
    if bound["return_counts"]:
        c = torch.zeros(merged.numel(), dtype=torch.long, device=local.device)
        c[torch.searchsorted(merged, values)] = counts
        for mesh_dim in sharding:
            c = wait_local(funcol.all_reduce(c, "sum", (mesh, mesh_dim)))
        global_counts = _replicated(c, mesh)
    if not isinstance(inverse, _UpstreamDTensor):
        inverse = _replicated(inverse, mesh)
    return _replicated(merged, mesh), inverse, global_counts
