"""Per-block compile of a tensor-parallel + FSDP2 GPT: graphs, graph breaks and step time,
vescale backend vs upstream Inductor vs eager.

    torchrun --standalone --nproc-per-node 4 benchmarks/per_block_compile.py \
        [--steps 10] [--dtensor vescale|upstream]

The model is ``examples/gpt.py`` on a (dp=world/2, tp=2) mesh: Megatron tensor parallelism
over tp (its plan, on the ``tp`` sub-mesh), then upstream ``fully_shard`` over dp on every
block and on the root. ``--dtensor`` picks the tensor-parallel parameters' class: vescale's
(``vescale.init_device_mesh``/``distribute_tensor``) or upstream's (the same model built with
``torch.distributed.tensor``), both compiled with each backend. Each block is compiled on its own (``torch.compile(block,
backend=..., fullgraph=True)``, the usual way large models are compiled); FSDP2's
all-gather/reduce-scatter hooks run between the compiled regions. A step is forward,
backward and an SGD step. Step time is the median over ``--steps`` after three warm-up steps
(rank 0). Graphs and graph breaks are Dynamo's counters over the whole run (``unique_graphs``
and the sum of ``graph_break``); "vescale fallbacks" counts the backend's warnings that a
graph ran eagerly or as captured FX instead of compiled. Each rank compiles into its own
fresh Inductor cache: "first s" is a cold compile, and upstream Inductor, whose FX graph
cache key leaves out the process-group names (which differ between the ranks of one mesh
dim: ranks 0-1 and 2-3 of the tp dim), cannot load a graph another rank wrote (a warm shared
cache fails with "Could not resolve the process group registered under the name 4").
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh as upstream_init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor as UpstreamDTensor
from torch.distributed.tensor import distribute_tensor as upstream_distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import gpt

import vescale
from vescale import Replicate

CFG = gpt.GPTConfig(vocab=128, seq=32, dim=64, heads=4, layers=4)


def _tp_placements(name: str) -> tuple[Any, ...]:
    """:data:`gpt.PLAN`'s tp placements of parameter ``name`` (FSDP2 adds dp itself)."""
    dims = next((p for pat, p in gpt.PLAN.items() if fnmatch.fnmatchcase(name, pat)), None)
    return tuple(dims[1:]) if dims else (Replicate(),)


def _model(mesh: Any, upstream: bool, backend: str | None, options: dict | None) -> Any:
    distribute = upstream_distribute_tensor if upstream else vescale.distribute_tensor
    model = gpt.build(CFG)
    for name, param in list(model.named_parameters()):
        owner, leaf = name.rsplit(".", 1)
        local = distribute(param.detach(), mesh["tp"], _tp_placements(name))
        model.get_submodule(owner).register_parameter(leaf, nn.Parameter(local))
    for name, module in model.named_modules():
        if name.endswith(("attn.proj", "mlp.proj")):  # row-parallel: Partial -> Replicate
            module.register_forward_hook(lambda _m, _a, y: y.redistribute(placements=[Replicate()]))
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh["dp"])
        if backend is not None:
            model.blocks[i] = torch.compile(block, backend=backend, fullgraph=True, options=options)
    fully_shard(model, mesh=mesh["dp"])
    return model


def _inputs(mesh: Any, upstream: bool, step: int) -> tuple[Any, ...]:
    """This dp rank's slice of the batch of ``step``, replicated over tp."""
    from_local = UpstreamDTensor.from_local if upstream else vescale.from_local
    ids, targets = gpt.batch(CFG, step)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    rows = slice(dp_rank * ids.shape[0] // dp, (dp_rank + 1) * ids.shape[0] // dp)
    return tuple(
        from_local(t[rows], mesh["tp"], [Replicate()], run_check=False) for t in (ids, targets)
    )


def _run(
    mesh: Any, upstream: bool, backend: str | None, options: dict | None, steps: int
) -> tuple[float, float, int, int, int, list[float]]:
    torch._dynamo.reset()
    counters.clear()
    model = _model(mesh, upstream, backend, options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    times, losses = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps + 3):
            dist.barrier()
            t0 = time.perf_counter()
            loss = model(*_inputs(mesh, upstream, i))
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss.full_tensor().item())
    fallbacks = [w for w in caught if "vescale backend" in str(w.message)]
    graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    return statistics.median(times[3:]), times[0], graphs, breaks, len(fallbacks), losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtensor", choices=("vescale", "upstream"), default="vescale")
    args = parser.parse_args()
    upstream = args.dtensor == "upstream"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    mesh = (upstream_init_device_mesh if upstream else vescale.init_device_mesh)(
        "cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp")
    )
    torch.compile(lambda a: a.sin() * 2)(torch.randn(8))  # Inductor start-up, charged to no one
    modes: dict[str, tuple[str | None, dict | None]] = {
        "eager": (None, None),
        "upstream inductor": ("inductor", None),
        "vescale": ("vescale", {}),
    }
    with tempfile.TemporaryDirectory(prefix=f"inductor-rank{dist.get_rank()}-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read at every cache access
        rows = {
            name: _run(mesh, upstream, backend, opts, args.steps)
            for name, (backend, opts) in modes.items()
        }
    if dist.get_rank() == 0:
        print(f"GPT {CFG}, (dp={mesh.size(0)}, tp={mesh.size(1)}) gloo CPU ranks")
        print(
            f"{args.dtensor} DTensor TP over tp, FSDP2 fully_shard over dp per block + root, "
            f"each block compiled, median of {args.steps} steps"
        )
        head = (
            f"{'mode':<18} {'step ms':>8} {'vs eager':>9} {'first s':>8} {'graphs':>7} "
            f"{'breaks':>7} {'fallbacks':>9}  {'loss max |diff| vs eager':>24}"
        )
        print(head)
        base, ref = rows["eager"][0], rows["eager"][5]
        for name, (med, first, graphs, breaks, fallbacks, losses) in rows.items():
            diff = max(abs(a - b) for a, b in zip(losses, ref))
            print(
                f"{name:<18} {med * 1e3:>8.2f} {med / base:>8.2f}x {first:>8.1f} {graphs:>7} "
                f"{breaks:>7} {fallbacks:>9}  {diff:>24.2e}"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
