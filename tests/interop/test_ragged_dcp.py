"""``torch.distributed.checkpoint`` with ``RaggedShard`` DTensors (issue 29 item 2).

A rank's 1-D slice is saved as the boxes it covers (chunk metadata from the units: the saved
metadata lists exactly those boxes), and DCP reshards on load: RaggedShard DTensors saved on
a 4-rank mesh load into RaggedShard with other units or dims, ``Shard``, ``Replicate``, and
onto a 2x2 mesh (a 2-rank RaggedShard beside Replicate or Shard); ``Shard``/``Replicate``
checkpoints load into RaggedShard. Every loaded tensor equals the saved float64 value
exactly and keeps its placements.
"""

from __future__ import annotations

import itertools
import math
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import vescale
from vescale import RaggedShard, Replicate, Shard
from vescale.dtensor.ragged_checkpoint import flat_boxes

MESH_4 = (4,)
MESH_2x2 = (2, 2)
# name -> (global shape, saved mesh, saved placements, loaded mesh, loaded placements)
CASES = {
    "rows_to_other_units": ((8, 6), MESH_4, [RaggedShard((0,), (1, 0, 3, 4))], MESH_4, [RaggedShard((0,), (0, 2, 2, 0))]),
    "elements_to_rows": ((4, 6), MESH_4, [RaggedShard((0, 1), (5, 0, 7, 12))], MESH_4, [RaggedShard((0,), (1, 1, 0, 2))]),
    "rows_to_elements": ((6, 2, 3), MESH_4, [RaggedShard((0,), (0, 1, 2, 3))], MESH_4, [RaggedShard((0, 1, 2), (7, 11, 0, 18))]),
    "one_rank_to_shard": ((5, 3), MESH_4, [RaggedShard((0,), (0, 0, 5, 0))], MESH_4, [Shard(0)]),
    "to_replicate": ((4, 6), MESH_4, [RaggedShard((0, 1), (3, 9, 0, 12))], MESH_4, [Replicate()]),
    "to_2x2_replicate_ragged": ((8, 6), MESH_4, [RaggedShard((0,), (3, 1, 0, 4))], MESH_2x2, [Replicate(), RaggedShard((0, 1), (13, 35))]),
    "to_2x2_shard_ragged": ((8, 6), MESH_4, [RaggedShard((0, 1), (5, 11, 0, 32))], MESH_2x2, [Shard(1), RaggedShard((0,), (3, 1))]),
    "shard_to_ragged": ((7, 3), MESH_4, [Shard(0)], MESH_4, [RaggedShard((0, 1), (4, 0, 10, 7))]),
    "replicate_2x2_to_ragged": ((6, 4), MESH_2x2, [Replicate(), Shard(1)], MESH_4, [RaggedShard((0,), (2, 0, 1, 3))]),
}  # fmt: skip


def _values() -> dict[str, torch.Tensor]:
    torch.manual_seed(11)
    return {k: torch.randn(shape, dtype=torch.float64) for k, (shape, *_) in CASES.items()}


def _mesh(shape: tuple[int, ...]) -> vescale.DeviceMesh:
    return vescale.init_device_mesh("cpu", shape)


def _expected_boxes(
    shape: tuple[int, ...], p: RaggedShard
) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every rank's boxes from the units, by marking elements (independent of flat_boxes)."""
    rows = math.prod(shape[: len(p.dims)])
    per_unit = rows // sum(p.local_units) * (math.prod(shape) // rows)
    out = set()
    for start, units in zip(itertools.accumulate(p.local_units, initial=0), p.local_units):
        for o, s in flat_boxes(shape, start * per_unit, (start + units) * per_unit):
            out.add((o, s))
    return out


def save_and_load() -> None:
    path = [tempfile.mkdtemp(prefix="vescale_ragged_dcp_") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(path, src=0)
    values = _values()
    saved = {
        k: vescale.distribute_tensor(values[k], _mesh(mesh), placements)
        for k, (_, mesh, placements, _, _) in CASES.items()
    }
    dcp.save(saved, checkpoint_id=path[0])

    metadata = dcp.FileSystemReader(path[0]).read_metadata()
    for k, (shape, _, placements, _, _) in CASES.items():
        chunks = {
            (tuple(c.offsets), tuple(c.sizes)) for c in metadata.state_dict_metadata[k].chunks
        }
        if isinstance(placements[0], RaggedShard):
            assert chunks == _expected_boxes(shape, placements[0]), (k, chunks)

    loaded = {}
    for k, (shape, _, _, mesh, placements) in CASES.items():
        loaded[k] = vescale.distribute_tensor(
            torch.zeros(shape, dtype=torch.float64), _mesh(mesh), placements
        )
    locals_before = {k: t.to_local().data_ptr() for k, t in loaded.items()}
    dcp.load(loaded, checkpoint_id=path[0])
    for k, (_, _, _, mesh, placements) in CASES.items():
        t = loaded[k]
        assert type(t) is vescale.DTensor and t.placements == tuple(placements), (k, t.placements)
        assert t.to_local().data_ptr() == locals_before[k], k  # loaded in place
        assert torch.equal(t.full_tensor(), values[k]), k
        expected = vescale.distribute_tensor(values[k], _mesh(mesh), placements).to_local()
        assert torch.equal(t.to_local(), expected), k


def test_ragged_dcp_reshard_on_load(pool4):
    pool4.run(save_and_load)


def test_flat_boxes_cover_the_range_in_storage_order():
    for shape in [(5,), (3, 4), (2, 3, 4), (4, 1, 3), (2, 2, 2, 3)]:
        numel = math.prod(shape)
        flat = torch.arange(numel).reshape(shape)
        for start in range(numel + 1):
            for end in range(start, numel + 1):
                boxes = flat_boxes(shape, start, end)
                assert len(boxes) <= 2 * len(shape) - 1, (shape, start, end, boxes)
                pieces = [
                    flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
                    for offsets, sizes in boxes
                ]
                got = torch.cat(pieces) if pieces else torch.empty(0, dtype=flat.dtype)
                assert torch.equal(got, torch.arange(start, end)), (shape, start, end, boxes)
