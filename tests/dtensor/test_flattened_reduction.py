"""A reduction over both dims of a named (dp=2, tp=2) mesh is one collective over the
flattened group of the four ranks: eager ``redistribute``, the eager DDP reducer, and the
compiled backward graph (bucketed on the flattened group's own key). Every rank ends with
bit-identical values, equal to the single-device reduction."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import vescale
from tests.dtensor.reference import partial_source
from tests.harness.collectives import count_collectives
from vescale import Partial, Replicate, Shard
from vescale.backend import PASSES_OFF
from vescale.ddp import DistributedDataParallel


@functools.cache
def _mesh() -> vescale.DeviceMesh:
    return vescale.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _all_ranks_equal(t: torch.Tensor) -> bool:
    """Whether every rank holds exactly the same bits as rank 0."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return all(torch.equal(o, out[0]) for o in out)


def _check_redistribute(src_ops, dst):
    src = [Partial(op) for op in src_ops]
    torch.manual_seed(7)
    full, local = partial_source(src, (2, 2), (8, 6), dtype=torch.float32)
    full = full / 2 ** src_ops.count("avg")  # an avg mesh dim averages its two pieces
    dt = vescale.from_local(local, _mesh(), src, run_check=False)
    with count_collectives() as counts:
        out = dt.redistribute(placements=dst, async_op=False)
        res = out.to_local(async_output=False)
    torch.testing.assert_close(out.full_tensor(), full)
    return dict(counts), _all_ranks_equal(res) if dst[0] == Replicate() else True


def test_partial_over_two_dims_to_replicate_is_one_all_reduce(pool4):
    for src_ops in (("sum", "sum"), ("avg", "avg")):
        for counts, same in pool4.run(_check_redistribute, src_ops, [Replicate(), Replicate()]):
            assert counts == {"all_reduce": 1}, (src_ops, counts)
            assert same, src_ops


def test_partial_over_two_dims_to_shard_is_one_reduce_scatter(pool4):
    for counts, _ in pool4.run(_check_redistribute, ("sum", "sum"), [Shard(0), Shard(0)]):
        assert counts == {"reduce_scatter": 1}, counts


class _Scaled(nn.Module):
    """``sum((x * w + b) ** 2)``: with ``x`` sharded over both mesh dims and ``w``, ``b``
    replicated, both gradients are Partial over dp and tp."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.b = nn.Parameter(torch.linspace(-1.0, 1.0, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x * self.w + self.b) ** 2).sum()


def _check_ddp(mode, dump_dir):
    mesh = _mesh()
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(5))
    ref = _Scaled().double()
    ref(x.double()).backward()
    net = _Scaled()
    for name in ("w", "b"):
        dt = vescale.distribute_tensor(getattr(net, name).detach(), mesh, [Replicate()] * 2)
        setattr(net, name, nn.Parameter(dt))
    model = DistributedDataParallel(net)
    if mode != "eager":
        options = {"codegen": "fx", "dump_dir": dump_dir, **(PASSES_OFF if mode == "off" else {})}
        torch._dynamo.reset()
        model = torch.compile(model, backend="vescale", options=options)
    inputs = vescale.distribute_tensor(x, mesh, [Shard(0), Shard(0)])
    model(inputs).backward()  # compiles the backward graph (its tracing would be counted)
    net.zero_grad()
    loss = model(inputs)
    with count_collectives() as counts:
        loss.backward()
    same = True
    for name, p in net.named_parameters():
        assert tuple(p.grad.placements) == (Replicate(), Replicate()), name
        grad = p.grad.to_local(async_output=False)
        torch.testing.assert_close(grad.double(), ref.get_parameter(name).grad, msg=name)
        same = same and _all_ranks_equal(grad)
    return dict(counts), same


def _backward_groups(dump_dir: Path) -> list[list[int]]:
    records = json.loads((dump_dir / "rank0" / "collectives.json").read_text())
    return [r["group_ranks"] for r in records if r["graph"].endswith("backward")]


def test_ddp_reduces_two_dim_partial_gradients_once(pool4, tmp_path):
    # eager reducer: w and b share a bucket, one all-reduce over the four ranks
    for counts, same in pool4.run(_check_ddp, "eager", None):
        assert counts == {"all_reduce": 1} and same, counts
    # compiled, passes off: one all-reduce per gradient, each over the flattened group
    for counts, same in pool4.run(_check_ddp, "off", str(tmp_path / "off")):
        assert counts == {"all_reduce": 2} and same, counts
    assert _backward_groups(tmp_path / "off") == [[0, 1, 2, 3]] * 2
    # compiled, passes on: the bucket pass merges both on the flattened group's key
    for counts, same in pool4.run(_check_ddp, "on", str(tmp_path / "on")):
        assert counts == {"all_reduce": 1} and same, counts
    assert _backward_groups(tmp_path / "on") == [[0, 1, 2, 3]]
