"""``from_local``'s layout for placements with a ``RaggedShard`` (:mod:`vescale.dtensor.ragged`):
its checks and the global shape (``dtensor.from_local`` builds the DTensor from them).
``distribute_tensor`` lays the tensor out with the RaggedShard as Replicate and redistributes
(the local slice); ``to_local``, ``full_tensor`` and ``redistribute`` need nothing of their
own (redistribution: :mod:`vescale.dtensor.ragged_redistribute`).

``from_local``'s global shape: ``shape=``/``stride=`` when given; otherwise only a 1-D
tensor with no other sharded mesh dim can be inferred (the sum of the slices along the
RaggedShard's mesh dim). ``run_check`` gathers every rank's metadata in one small
all-gather (:mod:`vescale.dtensor.local_metadata`) and raises the same error everywhere
where a rank's slice is not the one its units give.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

from vescale.dtensor.layout import contiguous_strides
from vescale.dtensor.local_metadata import LocalRecord, _local_errors, gather_records
from vescale.dtensor.placement_types import Placement, Shard
from vescale.dtensor.ragged import check_ragged, find_ragged, ragged_local_range

__all__ = ["ragged_from_local_layout"]

Layout = tuple[tuple[Placement, ...], "tuple[Placement, ...] | None"]
CheckArguments = Callable[..., Layout]


def _expected_numel(gshape: Sequence[int], mesh: Any, pl: Sequence[Placement], coord: Any) -> int:
    return ragged_local_range(gshape, mesh, pl, coord)[1]


def _inferable(pl: Sequence[Placement]) -> bool:
    """Whether the global shape can be inferred: no mesh dim shards the tensor otherwise."""
    return not any(isinstance(p, Shard) for p in pl)


def _arguments(
    local: Any,
    mesh: Any,
    placements: Sequence[Placement],
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
    grad_placements: Sequence[Placement] | None,
    tracing: bool,
    check_arguments: CheckArguments,
) -> Layout:
    """``from_local``'s own argument checks (``check_arguments``, for the global ndim), the
    global shape's where given."""
    if shape is None and (tracing or not _inferable(placements)):
        raise _no_shape(placements, mesh, local)
    ndim = 1 if shape is None else len(shape)
    pl, gp = check_arguments(local, mesh, placements, shape, stride, grad_placements, ndim)
    if shape is not None:
        check_ragged(shape, mesh, pl, what="from_local")
    return pl, gp


def _infer_shape(
    local: torch.Tensor, mesh: Any, pl: Sequence[Placement], device: torch.device
) -> tuple[int, ...]:
    """The global 1-D shape: the sum of the slices along the RaggedShard's mesh dim."""
    found = find_ragged(pl)
    assert found is not None
    mine = torch.tensor([local.numel()], dtype=torch.int64, device=device)
    sizes = funcol.all_gather_single(mine, 0, (mesh, found[0])).tolist()
    return (int(sum(sizes)),)


def _no_shape(pl: Sequence[Placement], mesh: Any, local: Any) -> ValueError:
    return ValueError(
        f"from_local: pass shape= and stride= for placements {tuple(pl)} on {mesh}: the global "
        f"shape of a RaggedShard's 1-D slices is inferred only for a 1-D tensor with no "
        f"other sharded mesh dim, outside torch.compile (local shape "
        f"{tuple(getattr(local, 'shape', ()))})"
    )


def _check_all(
    records: list[LocalRecord], mesh: Any, pl: tuple[Placement, ...], gshape: tuple[int, ...]
) -> None:
    """Every rank's local shape is its slice of ``gshape`` (the same error on every rank)."""
    grid = mesh.mesh
    coords: dict[int, tuple[int, ...]] = {}
    for idx in (
        torch.cartesian_prod(*[torch.arange(n) for n in grid.shape]).view(-1, grid.ndim).tolist()
    ):
        coords[int(grid[tuple(idx)])] = tuple(idx)
    bad = []
    for r in records:
        want = (_expected_numel(gshape, mesh, pl, coords[r.rank]),)
        if r.shape != want:
            bad.append(f"rank {r.rank} has {r.shape}, expected {want}")
    if bad:
        raise ValueError(
            f"from_local: local tensors are not the RaggedShard slices of global shape "
            f"{tuple(gshape)} with placements {pl} on {mesh}: {'; '.join(bad)} (each rank "
            f"holds its contiguous 1-D slice, local_units[i] units of the flattened tensor)"
        )


def ragged_from_local_layout(
    local_tensor: Any,
    mesh: Any,
    placements: Sequence[Placement],
    *,
    run_check: bool,
    tracing: bool,
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
    grad_placements: Sequence[Placement] | None,
    check_arguments: CheckArguments,
    device: torch.device,
) -> tuple[tuple[Placement, ...], tuple[Placement, ...] | None, tuple[int, ...], tuple[int, ...]]:
    """``from_local``'s (placements, grad placements, global shape, global stride) for
    ``placements`` with a RaggedShard, every check passed (see the module doc);
    ``check_arguments``: ``from_local``'s own argument checks, ``device``: where its small
    collectives run."""
    if run_check and not tracing and mesh.get_coordinate() is not None:
        error: Exception | None = None
        pl: tuple[Placement, ...] | None = None
        gp = None
        try:
            pl, gp = _arguments(
                local_tensor, mesh, placements, shape, stride, grad_placements, tracing,
                check_arguments,
            )  # fmt: skip
        except (TypeError, ValueError) as e:  # raised on every rank after the exchange
            error = e
        given = (tuple(shape), tuple(stride)) if shape is not None and stride is not None else None
        mine = LocalRecord.of(local_tensor, pl if pl is not None else placements, given, error)
        records = gather_records(mine, mesh, device)
        _local_errors(records, mesh, error)
        assert pl is not None
        if len({(r.placements, r.given) for r in records}) > 1:
            raise ValueError(
                f"from_local: placements or shape=/stride= differ across the ranks of {mesh} "
                f"(placements {pl}); pass the same on every rank"
            )
        if shape is None:
            found = find_ragged(pl)
            assert found is not None
            gshape: tuple[int, ...] = (
                sum((r.shape or (0,))[0] for r in records) // _copies(mesh, found[0]),
            )
        else:
            gshape = tuple(shape)
        check_ragged(gshape, mesh, pl, what="from_local")
        _check_all(records, mesh, pl, gshape)
    else:
        pl, gp = _arguments(
            local_tensor, mesh, placements, shape, stride, grad_placements, tracing,
            check_arguments,
        )  # fmt: skip
        gshape = tuple(shape) if shape is not None else _infer_shape(local_tensor, mesh, pl, device)
        check_ragged(gshape, mesh, pl, what="from_local")
        if not tracing and mesh.get_coordinate() is not None:
            want = (_expected_numel(gshape, mesh, pl, None),)
            if tuple(local_tensor.shape) != want:
                raise ValueError(
                    f"from_local: local shape {tuple(local_tensor.shape)} is not the RaggedShard "
                    f"slice {want} of global shape {gshape} with placements {pl} on {mesh}"
                )
    gstride = tuple(stride) if stride is not None else contiguous_strides(gshape)
    return pl, gp, gshape, gstride


def _copies(mesh: Any, mesh_dim: int) -> int:
    """How many times the records count each slice of one line along ``mesh_dim``."""
    return mesh.size() // mesh.size(mesh_dim)
