"""``torch.distributed.checkpoint`` for DTensors with a ``RaggedShard``
(:mod:`vescale.dtensor.ragged`): a rank's 1-D slice of the flattened storage is saved as the
boxes it covers (chunk metadata from the units, at most ``2 * ndim - 1`` boxes, in storage
order), so DCP reshards on load to any placements or mesh as it does for ``Shard``; loading
into a RaggedShard DTensor reads each box into a view of its slice. ``vescale.DTensor``'s
DCP methods (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``)
call these for RaggedShard placements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from vescale._torch_compat import compute_local_shape_and_global_offset
from vescale.dtensor.placement_types import Replicate
from vescale.dtensor.ragged import ragged_local_range, replace_ragged

__all__ = ["flat_boxes", "ragged_chunks", "ragged_shard_view", "ragged_write_items"]

Box = tuple[tuple[int, ...], tuple[int, ...]]


def flat_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The boxes ``(offsets, sizes)`` covering elements ``[start, end)`` of a row-major tensor
    of ``shape``, in storage order: a partial first row, whole rows, a partial last row,
    each partial row split the same way one dim down."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))]
    rest = tuple(shape[1:])
    inner = math.prod(rest)
    first, head = divmod(start, inner)
    last, tail = divmod(end, inner)

    def row(r: int, a: int, b: int) -> list[Box]:
        return [((r, *o), (1, *s)) for o, s in flat_boxes(rest, a, b)]

    if first == last:
        return row(first, head, tail)
    out = []
    if head:
        out += row(first, head, inner)
        first += 1
    if last > first:
        out.append(((first, *[0] * len(rest)), (last - first, *rest)))
    if tail:
        out += row(last, 0, tail)
    return out


def _boxes(dtensor: Any) -> list[Box]:
    """This rank's boxes in global coordinates."""
    spec = dtensor._spec
    if any(p.is_partial() for p in spec.placements):
        raise ValueError(
            f"distributed checkpoint: a DTensor with Partial placements {tuple(spec.placements)} "
            f"on {spec.mesh} cannot be saved or loaded; redistribute it to Replicate first"
        )
    if spec.mesh.get_coordinate() is None:
        return []
    other = replace_ragged(spec.placements, Replicate())
    inner, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, other)
    start, numel = ragged_local_range(spec.shape, spec.mesh, spec.placements)
    return [
        (tuple(o + b for o, b in zip(offset, box_offset)), sizes)
        for box_offset, sizes in flat_boxes(tuple(inner), start, start + numel)
    ]


def ragged_chunks(dtensor: Any) -> list[Any]:
    """``__create_chunk_list__``: one ``ChunkStorageMetadata`` per box of the local slice."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return [
        ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in _boxes(dtensor)
    ]


def ragged_write_items(fqn: str, dtensor: Any) -> list[Any]:
    """``__create_write_items__``: one shard write item per box of the local slice."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    properties = TensorProperties.create_from_tensor(dtensor._local_tensor)
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size(chunk.offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=dtensor.size()),
        )
        for chunk in ragged_chunks(dtensor)
    ]


def ragged_shard_view(dtensor: Any, index: Any) -> torch.Tensor:
    """``__get_tensor_shard__``: the box at ``index.offset`` as a view of the local slice
    (DCP reads a loaded box into it in place)."""
    boxes = _boxes(dtensor)
    offsets = [o for o, _ in boxes]
    wanted = tuple(index.offset) if index.offset is not None else None
    if index.index is not None and index.index < len(boxes) and offsets[index.index] == wanted:
        i = index.index
    elif wanted in offsets:
        i = offsets.index(wanted)
    else:
        raise ValueError(
            f"distributed checkpoint: {index.fqn!r} has no box at offset {wanted} on this rank "
            f"(its boxes: {offsets}; placements {tuple(dtensor.placements)} on "
            f"{dtensor.device_mesh})"
        )
    start = sum(math.prod(s) for _, s in boxes[:i])
    sizes = boxes[i][1]
    local = dtensor._local_tensor
    return local[start : start + math.prod(sizes)].view(sizes)
