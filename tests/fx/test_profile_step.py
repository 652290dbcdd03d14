"""vescale.profile_step: the measured trace of a compiled step beside its estimate, one row
per collective, every collective of every graph matched to its profiled launch and wait."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import vescale
from tests.dtensor.reference import mesh_of
from tests.harness.chrome_trace import check_chrome_trace


def _profiled(codegen: str) -> list[tuple[str, str, int, bool]]:
    torch._dynamo.reset()
    mesh = mesh_of((2,))
    w1 = vescale.distribute_tensor(torch.randn(8, 16), mesh, [Shard(1)]).requires_grad_()
    w2 = vescale.distribute_tensor(torch.randn(16, 8), mesh, [Shard(0)]).requires_grad_()

    def mlp(x: torch.Tensor) -> torch.Tensor:
        whole = x.redistribute(mesh, [Replicate()])
        return ((whole @ w1).relu() @ w2).redistribute(mesh, [Replicate()]).sum()

    compiled = torch.compile(mlp, backend="vescale", options={"codegen": codegen})
    x = vescale.distribute_tensor(torch.randn(4, 8), mesh, [Shard(0)]).requires_grad_()

    def step() -> None:
        compiled(x).backward()

    with tempfile.TemporaryDirectory() as out:
        report = vescale.profile_step(step, out=out)
        assert json.loads(Path(report.measured).read_text())["traceEvents"]
        for path in report.estimated:
            check_chrome_trace(json.loads(path.read_text()))
        graph = report.rows[0].graph.removesuffix(".forward")  # graph<N>: N counts per process
        assert sorted(p.name for p in report.estimated) == [
            f"{graph}.backward.schedule.json",
            f"{graph}.forward.schedule.json",
        ]
    text = str(report)
    assert text.splitlines()[0].split()[:2] == ["graph", "collective"]
    return [
        (r.graph.split(".")[1], r.kind, r.bytes, r.measured_us is not None and r.measured_us > 0)
        for r in report.rows
    ]


@pytest.mark.parametrize("codegen", ["fx", "inductor"])
def test_every_collective_matched(pool2, codegen):
    rows = pool2.run(_profiled, codegen, timeout_s=300)
    assert rows[0] == rows[1]
    kinds = [(g, k) for g, k, _, _ in rows[0]]
    # forward: x gathered for the column-parallel matmul, the row-parallel output
    # all-reduced; backward: x's gradient reduce-scattered back to Shard(0)
    assert kinds == [
        ("forward", "all_gather"),
        ("forward", "all_reduce"),
        ("backward", "reduce_scatter"),
    ]
    assert all(matched for *_, matched in rows[0]), rows[0]


def test_a_step_that_compiles_nothing_is_an_error():
    with pytest.raises(ValueError, match="compiled no vescale graph"):
        vescale.profile_step(lambda: None, out="unused")
