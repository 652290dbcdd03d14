"""One program on every rank, whatever each rank measures.

Every rank passes its own cost model here, 1000x apart (what calibrating under load on each
rank alone would give): the choice is made once (rank 0 solves, every rank receives it) and
each rank compiles the same collective sequence (the backend's fingerprints, gathered).

The structural cause of issue 26.5's ``RankDivergenceError``: ``Replicate -> Partial(sum)``
(a local step: coordinate 0 keeps the value, the others hold zeros) was ``zeros_like`` off
coordinate 0, which Inductor's decompositions turn into a ``full`` that no longer reads its
input, so a collective feeding it was dead, and eliminated, on those ranks only. A solution
with that step (load changes which solution the solver reaches) compiled a program with
fewer collectives on the other coordinates."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.placement_types import Partial

import vescale
from tests.harness import fake_world
from tests.plan.gpt_cases import train
from vescale import Replicate, Shard
from vescale.backend import CompiledGraph, capture_graphs
from vescale.cost.model import default_cost_model
from vescale.plan import AlphaBeta

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _mesh() -> vescale.DeviceMesh:
    return vescale.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def _rank_local_costs() -> AlphaBeta:
    """This rank's own "measurement": latency x1000, bandwidth and compute /1000 per rank."""
    k = 1000.0 ** dist.get_rank()
    return AlphaBeta((20e-6 * k,), (1e-9 / k,), 1e-10 / k)


def _everyone(mine: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def _sequences(graphs: list[CompiledGraph]) -> list[tuple[str, list[str]]]:
    """Each compiled graph's kind (forward/backward) and collective sequence, without the
    (per-file) source lines; graph numbers count per process, so they may differ by rank."""
    return [
        (g.name.rpartition(".")[2], [s.split(" @ ")[0] for s in g.ctx.reports["fingerprint"]])
        for g in graphs
    ]


class Shifted(nn.Module):
    """``x + w``; with ``w`` sharded and the output asked for as ``Partial``, the program
    gathers ``w`` and partitions the replicated sum locally."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w


def _check_partial_output() -> None:
    x = torch.randn(4, generator=torch.Generator().manual_seed(0))
    with capture_graphs() as graphs:
        model = vescale.parallelize(
            Shifted(),
            _mesh(),
            {"w": [Shard(0)]},
            inputs=[[Replicate()]],
            outputs=[[Partial()]],
            example_inputs=(x,),
            alpha_beta=_rank_local_costs(),
        )
        out = model(x)
    programs = _everyone(_sequences(graphs))
    assert all(p == programs[0] for p in programs), programs
    assert [s for _, seq in programs[0] for s in seq] == [
        "all_gather float32[4] over mesh dim 0 of 2"
    ]
    expected = x + torch.arange(4.0)
    assert tuple(out.placements) == (Partial(),)
    torch.testing.assert_close(out.full_tensor(), expected, atol=0, rtol=0)
    mine = expected if dist.get_rank() == 0 else torch.zeros(4)
    torch.testing.assert_close(out.to_local(), mine, atol=0, rtol=0)


def test_replicate_to_partial_after_a_collective_is_one_program(pool2):
    pool2.run(_check_partial_output, timeout_s=600)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.fc2(torch.relu(self.fc1(x))) - y) ** 2).mean()


def _check_rank_local_costs_train_as_one() -> None:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(2)]
    ref_losses, ref_params = train(MLP(), batches)
    with capture_graphs() as graphs:
        model = vescale.parallelize(
            MLP(),
            _mesh(),
            {"fc1.weight": [Shard(0)], "fc2.weight": [Shard(1)]},
            inputs=[[Replicate()], [Replicate()]],
            example_inputs=batches[0],
            alpha_beta=_rank_local_costs(),
        )
        losses, params = train(model, batches)
    chosen = _everyone(sorted((k, str(v)) for k, v in model.program.param_placements().items()))
    assert all(c == chosen[0] for c in chosen), chosen
    programs = _everyone(_sequences(graphs))
    assert programs[0] and all(p == programs[0] for p in programs), programs
    assert all(abs(a - b) < 1e-6 for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    for k, v in params.items():
        torch.testing.assert_close(v, ref_params[k], atol=1e-6, rtol=0, msg=k)


def test_rank_local_cost_models_compile_one_program_and_train(pool2):
    pool2.run(_check_rank_local_costs_train_as_one, timeout_s=600)


def _gpt_program_of(rank: int) -> list[tuple[str, list[str]]]:
    """The collective sequences rank ``rank`` of 4 compiles for the plan of docs/plan.md's
    first sample, deciding alone (the ``fake`` group: no rank hears of another), with a cost
    model under which the solver gathers over tp what it then chunks over dp."""
    import gpt

    with fake_world(4, rank):
        mesh = vescale.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        cfg = gpt.GPTConfig(vocab=64, seq=8, dim=16, heads=2, layers=1)
        d = default_cost_model(2)
        costs = dataclasses.replace(
            d, alpha=(d.alpha[0] / 10, d.alpha[1] * 3), beta=(d.beta[0] / 10, d.beta[1] * 3)
        )
        with capture_graphs() as graphs:
            model = vescale.parallelize(
                gpt.build(cfg),
                mesh,
                {
                    "blocks.*.attn.[qkv].weight": {"tp": Shard(0)},
                    "blocks.*.*.proj.weight": {"tp": Shard(1)},
                    "head.weight": {"tp": Shard(0)},
                },
                inputs=[{"dp": Shard(0)}, {"dp": Shard(0)}],
                example_inputs=gpt.batch(cfg, 0),
                alpha_beta=costs,
                options={"codegen": "fx"},
                progress=False,
            )
            model(*gpt.batch(cfg, 1)).backward()
        return _sequences(graphs)


def test_each_rank_alone_compiles_the_same_program():
    # CI under load: this plan compiled 189 collectives on ranks 0 and 3, 205 on 1 and 2 (an
    # all-gather over tp sliced at the dp coordinate, the own chunk where dp == tp, was
    # eliminated there only); every compile-time decision must read rank-independent facts.
    # One process per rank (a process holds one fake world's groups).
    code = (
        "import json, sys; from tests.plan.test_rank_consistent_plan import _gpt_program_of; "
        "print(json.dumps(_gpt_program_of(int(sys.argv[1]))))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "examples")])}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank)], cwd=ROOT, env=env, stdout=subprocess.PIPE
        )
        for rank in (0, 1)
    ]
    programs = [json.loads(run.communicate(timeout=300)[0].splitlines()[-1]) for run in runs]
    assert programs[0] and programs[0] == programs[1]
