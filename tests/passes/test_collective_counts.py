"""Exact collective counts of the levers that cut the compiled GPT step's collectives.

Layer-norm backward keeps the input's layout (``vescale/dtensor/ops/norm_backward.py``): a
``Partial`` gradient into a replicated layer norm is one all-reduce, not upstream's
reduce-scatter followed by an all-gather where the residual stream needs it replicated.
Values are checked against the same computation on one device (float64).
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor as UpstreamDTensor

import vescale
from tests.dtensor.reference import coord_of, expected_local, mesh_of, partial_source
from tests.harness.collectives import count_collectives
from vescale import Partial, Replicate, Shard
from vescale.dtensor import explicit_redistribute

aten = torch.ops.aten
MESH = (2, 2)  # (dp, tp): upstream reduce-scatters a tp-Partial gradient of a dp-sharded input
SHAPE = (4, 6, 8)  # batch, sequence, normalized
PLACEMENTS = {
    "S0,R": (Shard(0), Replicate()),
    "S0,S1": (Shard(0), Shard(1)),
    "S0,S0": (Shard(0), Shard(0)),
}


def _dt(full: torch.Tensor, placements, upstream: bool = False):
    local = expected_local(full, MESH, coord_of(MESH), placements).contiguous()
    make = UpstreamDTensor.from_local if upstream else vescale.from_local
    return make(local, mesh_of(MESH), placements, run_check=False)


def _layer_norm_backward(input_placements: str, upstream: bool) -> tuple:
    """``native_layer_norm_backward`` of a gradient Partial over tp: its collectives, the input
    gradient's placements, and whether all three gradients equal one device's (float64)."""
    placements = PLACEMENTS[input_placements]
    gen = torch.Generator().manual_seed(3)
    x, w, b = (torch.randn(s, dtype=torch.float64, generator=gen) for s in (SHAPE, 8, 8))
    grad, grad_local = partial_source([Shard(0), Partial()], MESH, SHAPE)
    _, mean, rstd = aten.native_layer_norm(x, [8], w, b, 1e-5)
    mask = [True, True, True]
    ref = aten.native_layer_norm_backward(grad, x, [8], mean, rstd, w, b, mask)
    make = UpstreamDTensor.from_local if upstream else vescale.from_local
    args = [make(grad_local, mesh_of(MESH), [Shard(0), Partial()], run_check=False)]
    args += [_dt(x, placements, upstream), [8], _dt(mean, placements, upstream)]
    args += [_dt(rstd, placements, upstream)]
    args += [_dt(t, (Replicate(), Replicate()), upstream) for t in (w, b)] + [mask]
    with explicit_redistribute(False), count_collectives() as counts:
        out = aten.native_layer_norm_backward(*args)
    equal = all(torch.allclose(o.full_tensor(), r, rtol=0, atol=1e-12) for o, r in zip(out, ref))
    return dict(counts), tuple(out[0].placements), equal


@pytest.mark.parametrize(
    ("input_placements", "upstream", "counts", "grad_placements"),
    [
        # a replicated residual stream: one all-reduce, the gradient laid out as the input
        ("S0,R", False, {"all_reduce": 1}, "S0,R"),
        # sequence parallel: the reduce-scatter to the input's own shard
        ("S0,S1", False, {"reduce_scatter": 1}, "S0,S1"),
        # upstream DTensors keep upstream's choice: a reduce-scatter to a batch-dim shard
        ("S0,R", True, {"reduce_scatter": 1}, "S0,S0"),
    ],
)
def test_layer_norm_backward_follows_input(
    pool4, input_placements, upstream, counts, grad_placements
):
    for got, placements, equal in pool4.run(_layer_norm_backward, input_placements, upstream):
        assert equal
        assert got == counts
        assert placements == PLACEMENTS[grad_placements]


class _Block(nn.Module):
    """Pre-norm Megatron MLP block ``x + proj(gelu(fc(ln(x))))``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


def _two_blocks_backward() -> tuple:
    """Two tensor-parallel blocks on a residual stream sharded over dp, replicated over tp,
    eager: backward collectives, the input gradient's placements, and whether every gradient
    equals one device's (float64)."""
    mesh = mesh_of(MESH)
    torch.manual_seed(0)
    ref = nn.Sequential(_Block(8), _Block(8)).double()
    model = nn.Sequential(_Block(8), _Block(8)).double()
    model.load_state_dict(ref.state_dict())
    tp = {"*.fc.*": (Replicate(), Shard(0)), "*.proj.weight": (Replicate(), Shard(1))}
    plan = {k: (mesh, v) for k, v in tp.items()}
    vescale.materialize_module(model, {**plan, "*": (mesh, [Replicate(), Replicate()])})
    for block in model:
        block.proj.register_forward_hook(
            lambda _m, _a, y: y.redistribute(placements=[Shard(0), Replicate()])
        )
    x = torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x_ref = x.clone().requires_grad_()
    x_dt = _dt(x, PLACEMENTS["S0,R"]).requires_grad_()
    ref(x_ref).pow(2).sum().backward()
    loss = model(x_dt).pow(2).sum()
    with count_collectives() as counts:
        loss.backward()
    equal = torch.allclose(x_dt.grad.full_tensor(), x_ref.grad, rtol=0, atol=1e-10)
    for p, p_ref in zip(model.parameters(), ref.parameters()):
        equal &= torch.allclose(p.grad.full_tensor(), p_ref.grad, rtol=0, atol=1e-10)
    return dict(counts), tuple(x_dt.grad.placements), equal


def test_two_blocks_backward_is_one_all_reduce_per_layer_norm(pool4):
    """Upstream's layout gives reduce-scatter, all-gather (before block 1's projection),
    reduce-scatter: 3 tp collectives and a gradient sharded over tp; vescale's gives 2
    all-reduces (parameter gradients stay Partial over dp: no DDP here)."""
    for counts, placements, equal in pool4.run(_two_blocks_backward):
        assert equal
        assert counts == {"all_reduce": 2}, counts
        assert placements == PLACEMENTS["S0,R"]


def _gpt_step_records(dump_root: str) -> list[tuple[str, str, int | None]]:
    """(graph, kind, mesh dim) of every collective of the demo GPT's compiled training step
    (passes on, FX codegen), and whether its loss equals eager's."""
    import gpt

    from vescale.ddp import DistributedDataParallel

    torch._dynamo.reset()
    mesh = vescale.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cfg = gpt.GPTConfig()
    inputs = gpt.shard_batch(mesh, *gpt.batch(cfg, 0))
    model = DistributedDataParallel(gpt.parallelize(gpt.build(cfg), mesh))
    options = {"codegen": "fx", "dump_dir": dump_root}
    torch.compile(model, backend="vescale", options=options)(*inputs).backward()
    rank = dist.get_rank()
    records = json.loads((Path(dump_root) / f"rank{rank}" / "collectives.json").read_text())
    return [(r["graph"].split(".")[-1], r["kind"], r["mesh_dim"]) for r in records]


@pytest.mark.full  # one GPT compile, about a minute on 2 cores; the default run pins the
# backward's tp collectives in tests/test_compiler.py::test_gpt_collectives_match_eager
def test_gpt_step_collective_counts(pool4):
    """The demo GPT (2 blocks) on (dp=2, tp=2), one compiled step, passes on: the forward's
    Megatron all-reduces (2 per block, 2 for the vocabulary-parallel loss over tp, the loss
    mean's count over dp) and a backward of one all-reduce per layer norm (5), one for the
    loss, one bucket of data-parallel gradients: 14. Upstream's layer-norm layout made that
    backward 5 reduce-scatters + 4 all-gathers + the loss's all-reduce + 2 buckets (dp, and
    dp x tp for the layer-norm gradients Partial over both): 19."""
    with tempfile.TemporaryDirectory() as root:
        for records in pool4.run(_gpt_step_records, root):
            assert Counter(records) == {
                ("forward", "all_reduce", 1): 6,
                ("forward", "all_reduce", 0): 1,
                ("backward", "all_reduce", 1): 6,
                ("backward", "all_reduce", 0): 1,
            }, Counter(records)
