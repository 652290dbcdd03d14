"""examples/muon.py: Muon on a ``vescale.fsdp`` GPT (each matrix's update gathered whole to a
load-balanced owner, Newton-Schulz there, scattered back) equals Muon on one device, float64,
on 2 and 4 ranks; each matrix costs two all-to-alls (gather to its owner, scatter back),
none when its rows are all on its owner already."""

from __future__ import annotations

import gpt
import muon
import torch

import vescale
from tests.harness.collectives import count_collectives

CFG = gpt.GPTConfig(layers=2)
STEPS = 2


def _muon_vs_one_device() -> tuple[dict[str, int], int]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mesh = vescale.init_device_mesh("cpu", (world,))
    ref = gpt.build(CFG).double()
    model = muon.shard(gpt.build(CFG).double(), mesh)
    opts_ref, opts = muon.optimizers(ref), muon.optimizers(model)
    counts: dict[str, int] = {}
    for step in range(STEPS):
        ids, targets = gpt.batch(CFG, step)
        n = ids.shape[0] // world
        muon.train(ref, opts_ref, [(ids, targets)])
        model(ids[rank * n : (rank + 1) * n], targets[rank * n : (rank + 1) * n]).backward()
        with count_collectives() as c:
            opts[0].step()  # Muon
        counts = dict(c)
        opts[1].step()
        for opt in opts:
            opt.zero_grad()
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        assert torch.allclose(p.full_tensor(), p_ref, rtol=1e-10, atol=1e-12), name
    matrices = opts[0].param_groups[0]["params"]
    owner = muon.owners([p.shape for p in matrices], world)
    moved = sum(p.placements[0].local_units[o] != p.shape[0] for p, o in zip(matrices, owner))
    return counts, moved


def _check(results) -> None:
    for counts, moved in results:
        assert moved > 0 and counts == {"all_to_all": 2 * moved}


def test_muon_equals_one_device_pool2(pool2):
    _check(pool2.run(_muon_vs_one_device))


def test_muon_equals_one_device_pool4(pool4):
    _check(pool4.run(_muon_vs_one_device))


def test_owners_balance_the_newton_schulz_cost():
    shapes = [torch.Size(s) for s in [(128, 32), (32, 128), (32, 32), (32, 32), (32, 32), (32, 32)]]
    # cost rows*cols*min: 131072, 131072, then four of 32768: the two big ones on ranks 0
    # and 1, the small ones on ranks 2, 3, 2, 3 (least loaded, lowest rank on ties)
    assert muon.owners(shapes, 4) == [0, 1, 2, 3, 2, 3]
    assert muon.owners(shapes, 1) == [0] * 6
