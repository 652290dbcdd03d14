"""Mesh dims of one rank: a redistribution whose changed placements are all on such dims
moves nothing, so it is never communication and never an explicit-mode error. The demo GPT
trains eagerly and compiled on (dp, 1), (1, tp) and (1, 1) meshes equal to one device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vescale
from tests.harness.collectives import count_collectives
from vescale import Partial, Replicate, Shard

ROOT = Path(__file__).resolve().parents[2]


def _check_moves_nothing(shape: tuple[int, int]) -> None:
    """Every placement change on the size-1 mesh dim: no collective, the local tensor as it
    is, in explicit mode (implicitly, through an op) and explicitly."""
    mesh = vescale.init_device_mesh("cpu", shape)
    one = shape.index(1)
    full = torch.arange(48.0).reshape(8, 6)
    for src, dst in [(Shard(1), Replicate()), (Partial(), Replicate()), (Shard(0), Shard(1))]:
        a, b = [Shard(0)] * 2, [Shard(0)] * 2
        a[one], b[one] = src, dst
        x = vescale.distribute_tensor(full, mesh, a)
        with count_collectives() as counts:
            y = x.redistribute(placements=b)
            assert torch.equal(y.to_local(), x.to_local())
            assert tuple(y.placements) == tuple(b)
        assert not counts, (src, dst, dict(counts))
    # an op whose strategy wants Replicate on the size-1 dim (the GPT loss's log_softmax)
    a = [Shard(0), Shard(0)]
    a[one] = Shard(1)
    x = vescale.distribute_tensor(full, mesh, a)
    with count_collectives() as counts:
        out = torch.log_softmax(x, dim=1)
    assert not counts, dict(counts)
    torch.testing.assert_close(out.full_tensor(), torch.log_softmax(full, dim=1))


@pytest.mark.parametrize("shape", [(2, 1), (1, 2)])
def test_moves_nothing_2(pool2, shape):
    pool2.run(_check_moves_nothing, shape)


def _check_gpt(shape: tuple[int, int], steps: int = 2) -> None:
    """The demo GPT (DDP over dp, Megatron over tp) on a ``shape`` mesh, compiled (FX
    codegen) and eager, against one device: losses and every trained parameter."""
    import gpt
    import train_demo

    from vescale.ddp import DistributedDataParallel

    cfg = gpt.GPTConfig()
    mesh = vescale.init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))

    def distributed() -> torch.nn.Module:
        return DistributedDataParallel(gpt.parallelize(gpt.build_deferred(cfg), mesh))

    def sharded(ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gpt.shard_batch(mesh, ids, targets)

    torch._dynamo.reset()
    compiled = torch.compile(distributed(), backend="vescale", options={"codegen": "fx"})
    runs = {
        "compiled": train_demo.train(compiled, cfg, steps, 0.5, sharded),
        "eager": train_demo.train(distributed(), cfg, steps, 0.5, sharded),
    }
    ref = train_demo.train(gpt.build(cfg), cfg, steps, 0.5, lambda i, t: (i, t))
    for name, run in runs.items():
        torch.testing.assert_close(run.losses, ref.losses, rtol=0, atol=1e-5, msg=name)
        assert run.params.keys() == ref.params.keys()
        for k, p in run.params.items():
            torch.testing.assert_close(p, ref.params[k], rtol=1e-5, atol=1e-5, msg=f"{name} {k}")


@pytest.mark.parametrize("shape", [(2, 1), (1, 2)])
def test_gpt_trains_on_2_ranks(pool2, shape):
    pool2.run(_check_gpt, shape, timeout_s=300)


@pytest.mark.parametrize("shape", [(4, 1), (1, 4)])
def test_gpt_trains_on_4_ranks(pool4, shape):
    pool4.run(_check_gpt, shape, timeout_s=300)


_ONE_RANK = """
import torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from tests.dtensor.test_size_one_mesh_dims import _check_gpt, _check_moves_nothing
_check_moves_nothing((1, 1))
_check_gpt((1, 1))
dist.destroy_process_group()
"""


def test_gpt_trains_on_a_1x1_mesh():
    """One process, world size 1 (a 1-GPU debug run): the (1, 1) mesh."""
    path = os.pathsep.join([str(ROOT), str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    out = subprocess.run(
        [sys.executable, "-c", _ONE_RANK], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
