"""``torch.compile(backend="vescale")`` on models laid out by upstream tools (issue 13 item 3).

1. The sequence-parallel MLP of ``test_tp_styles`` (upstream ``parallelize_module``);
2. the 2-D recipe with upstream tools: TP styles over "tp", ``fully_shard`` over "dp".
Compiled loss and gradients equal eager; the collectives ``collectives.json`` lists are those
eager issues (same kinds and count, counted by the profiler); for FSDP2, whose hooks Dynamo
does not trace through, the number of graphs and graph breaks is asserted (see the test).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from tests.harness.collectives import count_collectives
from tests.interop._models import full, mlp
from tests.interop.test_tp_styles import PLAN


def _loss_and_grads(model, step, x):  # type: ignore[no-untyped-def]
    """One forward + backward; the collectives of the step itself are counted (not those of
    the ``full_tensor`` calls that gather the results for comparison)."""
    with count_collectives() as counts:
        loss = step(model, x)
        loss.backward()
    grads = {k: full(p.grad).clone() for k, p in model.named_parameters()}
    return full(loss).item(), grads, counts


def _tp_step(model, x):  # type: ignore[no-untyped-def]
    out = model(x)
    return (out * out).sum()


def compiled_tp_styles(dump_root: str) -> None:
    torch._dynamo.reset()
    ws, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(1)
    x = torch.randn(2, 4 * ws, 8, dtype=torch.float64).chunk(ws, dim=1)[rank]
    eager_model = parallelize_module(mlp(), mesh, PLAN)
    eager_loss, eager_grads, eager_counts = _loss_and_grads(eager_model, _tp_step, x)
    model = parallelize_module(mlp(), mesh, PLAN)
    step = torch.compile(_tp_step, backend="vescale", options={"dump_dir": dump_root})
    loss, grads, _ = _loss_and_grads(model, step, x)
    assert abs(loss - eager_loss) < 1e-10, (loss, eager_loss)
    for k, g in grads.items():
        assert torch.allclose(g, eager_grads[k], atol=1e-10), k
    records = json.loads((Path(dump_root) / f"rank{rank}" / "collectives.json").read_text())
    assert Counter(r["kind"] for r in records) == eager_counts, (records, eager_counts)


def test_compiled_tp_styles_equal_eager(pool2, tmp_path):
    pool2.run(compiled_tp_styles, str(tmp_path))


def _fsdp_tp_model(mesh):  # type: ignore[no-untyped-def]
    model = parallelize_module(mlp(), mesh["tp"], PLAN)
    fully_shard(model, mesh=mesh["dp"])
    return model


def compiled_fsdp_over_tp_styles(dump_root: str) -> None:
    """Dynamo does not trace FSDP2's hooks (``torch._dynamo.disable``): the step compiles to
    2 graphs around 1 graph break; the TP collectives are in the graphs, FSDP2's run eagerly."""
    torch._dynamo.reset()
    counters.clear()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    torch.manual_seed(1)
    x = torch.randn(4, 8, 8, dtype=torch.float64).chunk(2, dim=0)[dp].chunk(2, dim=1)[tp]
    eager_loss, eager_grads, eager_counts = _loss_and_grads(_fsdp_tp_model(mesh), _tp_step, x)
    step = torch.compile(_tp_step, backend="vescale", options={"dump_dir": dump_root})
    loss, grads, _ = _loss_and_grads(_fsdp_tp_model(mesh), step, x)
    assert abs(loss - eager_loss) < 1e-10, (loss, eager_loss)
    for k, g in grads.items():
        assert torch.allclose(g, eager_grads[k], atol=1e-10), k
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    breaks = counters["graph_break"]
    assert sum(breaks.values()) == 1 and "`disable`" in next(iter(breaks)), dict(breaks)
    rank = dist.get_rank()
    records = json.loads((Path(dump_root) / f"rank{rank}" / "collectives.json").read_text())
    tp_group = sorted(mesh["tp"].mesh.tolist())
    assert all(r["group_ranks"] == tp_group for r in records), records
    kinds = Counter(r["kind"] for r in records)
    assert kinds == {k: eager_counts[k] for k in ("all_gather", "reduce_scatter")}, (
        records,
        eager_counts,
    )


def test_compiled_fsdp_over_tp_styles(pool4, tmp_path):
    pool4.run(compiled_fsdp_over_tp_styles, str(tmp_path))
