"""``torch.distributed.checkpoint`` with vescale DTensors (issue 13 item 3).

vescale DTensors with uneven shards on a 2x2 mesh are saved with ``dcp.save`` and loaded into
DTensors of other placements (and other meshes): resharding on load. Every loaded tensor equals
the saved global value exactly, and its local shard is the ``torch.chunk`` piece of it.
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import vescale
from tests.dtensor.reference import coord_of, expected_local
from vescale import Replicate, Shard

# name -> (global shape, saved placements on the 2x2 mesh, loaded mesh shape, loaded placements)
CASES = {
    "rows": ((7, 5), [Shard(0), Replicate()], (4,), [Shard(1)]),
    "both": ((5, 7), [Shard(0), Shard(1)], (2, 2), [Shard(1), Shard(0)]),
    "same_dim": ((9, 3), [Shard(0), Shard(0)], (2, 2), [Replicate(), Shard(0)]),
    "vector": ((11,), [Replicate(), Shard(0)], (2, 2), [Shard(0), Shard(0)]),
}


def _values() -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    return {k: torch.randn(shape, dtype=torch.float64) for k, (shape, *_) in CASES.items()}


def dcp_reshard_on_load() -> None:
    path = [tempfile.mkdtemp(prefix="vescale_dcp_") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(path, src=0)
    values = _values()
    mesh = vescale.init_device_mesh("cpu", (2, 2))
    saved = {
        k: vescale.distribute_tensor(values[k], mesh, placements)
        for k, (_, placements, _, _) in CASES.items()
    }
    assert all(type(t) is vescale.DTensor for t in saved.values())
    dcp.save(saved, checkpoint_id=path[0])

    loaded = {}
    for k, (shape, _, mesh_shape, placements) in CASES.items():
        target = vescale.init_device_mesh("cpu", mesh_shape)
        loaded[k] = vescale.distribute_tensor(
            torch.zeros(shape, dtype=torch.float64), target, placements
        )
    dcp.load(loaded, checkpoint_id=path[0])
    for k, (_, _, mesh_shape, placements) in CASES.items():
        t = loaded[k]
        assert type(t) is vescale.DTensor and t.placements == tuple(placements), (k, t.placements)
        assert torch.equal(t.full_tensor(), values[k]), k
        local = expected_local(values[k], mesh_shape, coord_of(mesh_shape), placements)
        assert torch.equal(t.to_local(), local), k


def test_dcp_save_vescale_load_other_placements(pool4):
    pool4.run(dcp_reshard_on_load)
