"""Per-block compile of a tensor-parallel + FSDP2 GPT: graphs, graph breaks and step time,
vescale backend vs upstream Inductor vs eager.

    torchrun --standalone --nproc-per-node 4 benchmarks/per_block_compile.py \
        [--steps 10] [--dtensor vescale|upstream] [--sp] [--device cpu|cuda]

The model is ``examples/gpt.py`` on a (dp=world/2, tp=2) mesh: Megatron tensor parallelism
over tp (its plan, on the ``tp`` sub-mesh), then upstream ``fully_shard`` over dp on every
block and on the root. ``--sp`` adds Megatron sequence parallelism: the residual stream is
sharded over the sequence (``Shard(1)``), an all-gather feeds the column-parallel layers, the
row-parallel outputs are reduce-scattered; the embedding is vocabulary-parallel (no learned
positions, as in RoPE models) and its ``Partial`` output is reduce-scattered asynchronously,
so the first block's graph receives an in-flight collective result (``in-flight`` counts
the vescale graphs that wait on such an input). ``--dtensor`` picks the tensor-parallel parameters' class: vescale's
(``vescale.init_device_mesh``/``distribute_tensor``) or upstream's (the same model built with
``torch.distributed.tensor``), both compiled with each backend. Each block is compiled on its own (``torch.compile(block,
backend=..., fullgraph=True)``, the usual way large models are compiled); FSDP2's
all-gather/reduce-scatter hooks run between the compiled regions. A step is forward,
backward and an SGD step. Step time is the median over ``--steps`` after three warm-up steps
(rank 0). Graphs and graph breaks are Dynamo's counters over the whole run (``unique_graphs``
and the sum of ``graph_break``); "vescale fallbacks" counts the backend's warnings that a
graph ran eagerly or as captured FX instead of compiled. Each rank compiles into its own
fresh Inductor cache: "first" is a cold compile, and upstream Inductor, whose FX graph
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
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh as upstream_init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor as UpstreamDTensor
from torch.distributed.tensor import distribute_tensor as upstream_distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import gpt
from launch import BACKENDS, add_device_argument, init_distributed, synchronize

import vescale
from vescale import Replicate, Shard
from vescale.backend import capture_graphs

CFG = gpt.GPTConfig(vocab=128, seq=32, dim=64, heads=4, layers=4)
SEQ_SHARDS = (Shard(1),)  # the residual stream under sequence parallelism


class SequenceParallelGPT(gpt.GPT):
    """:class:`gpt.GPT` without learned positions; the vocabulary-parallel embedding's
    ``Partial`` output is reduce-scattered to sequence shards, not waited before block 0."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx).redistribute(placements=SEQ_SHARDS, async_op=True)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x).redistribute(placements=[Replicate()]))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def _tp_placements(name: str, sp: bool) -> tuple[Any, ...]:
    """:data:`gpt.PLAN`'s tp placements of parameter ``name`` (FSDP2 adds dp itself); under
    sequence parallelism the embedding table is vocabulary-parallel."""
    if sp and name == "tok.weight":
        return (Shard(0),)
    dims = next((p for pat, p in gpt.PLAN.items() if fnmatch.fnmatchcase(name, pat)), None)
    return tuple(dims[1:]) if dims else (Replicate(),)


def _redistribute_hooks(model: nn.Module, sp: bool) -> None:
    """Row-parallel outputs: ``Partial`` -> ``Replicate`` (all-reduce), or under sequence
    parallelism -> sequence shards (reduce-scatter), whose attention/MLP inputs are gathered."""
    out = SEQ_SHARDS if sp else (Replicate(),)
    for name, module in model.named_modules():
        if name.endswith(("attn.proj", "mlp.proj")):
            module.register_forward_hook(lambda _m, _a, y: y.redistribute(placements=out))
        if sp and name.endswith((".attn", ".mlp")):
            module.register_forward_pre_hook(
                lambda _m, args: (args[0].redistribute(placements=[Replicate()]),)
            )


def _model(mesh: Any, upstream: bool, sp: bool, backend: str | None, options: dict | None) -> Any:
    distribute = upstream_distribute_tensor if upstream else vescale.distribute_tensor
    torch.manual_seed(0)
    model = (SequenceParallelGPT(CFG) if sp else gpt.build(CFG)).to(mesh.device_type)
    for name, param in list(model.named_parameters()):
        owner, leaf = name.rsplit(".", 1)
        local = distribute(param.detach(), mesh["tp"], _tp_placements(name, sp))
        model.get_submodule(owner).register_parameter(leaf, nn.Parameter(local))
    _redistribute_hooks(model, sp)
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh["dp"])
        if backend is not None:
            model.blocks[i] = torch.compile(block, backend=backend, fullgraph=True, options=options)
    fully_shard(model, mesh=mesh["dp"])
    return model


def _inputs(mesh: Any, upstream: bool, step: int) -> tuple[Any, ...]:
    """This dp rank's slice of the batch of ``step``, replicated over tp."""
    from_local = UpstreamDTensor.from_local if upstream else vescale.from_local
    ids, targets = gpt.batch(CFG, step, device=mesh.device_type)
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    rows = slice(dp_rank * ids.shape[0] // dp, (dp_rank + 1) * ids.shape[0] // dp)
    return tuple(
        from_local(t[rows], mesh["tp"], [Replicate()], run_check=False) for t in (ids, targets)
    )


class Row(NamedTuple):
    step_s: float  # median
    first_s: float
    graphs: int
    breaks: int
    fallbacks: int
    inflight: int  # vescale graphs waiting on an input whose collective was issued before
    losses: list[float]


def _run(mesh: Any, args: argparse.Namespace, backend: str | None, options: dict | None) -> Row:
    upstream = args.dtensor == "upstream"
    torch._dynamo.reset()
    counters.clear()
    model = _model(mesh, upstream, args.sp, backend, options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    times, losses = [], []
    with warnings.catch_warnings(record=True) as caught, capture_graphs() as graphs:
        warnings.simplefilter("always")
        for i in range(args.steps + 3):
            dist.barrier()
            t0 = time.perf_counter()
            loss = model(*_inputs(mesh, upstream, i))
            opt.zero_grad()
            loss.backward()
            opt.step()
            synchronize(mesh.device_type)
            times.append(time.perf_counter() - t0)
            losses.append(loss.full_tensor().item())
    return Row(
        step_s=statistics.median(times[3:]),
        first_s=times[0],
        graphs=counters["stats"]["unique_graphs"],
        breaks=sum(counters["graph_break"].values()),
        fallbacks=sum("vescale backend" in str(w.message) for w in caught),
        inflight=sum(bool(g.ctx.reports["boundary"]["inflight_inputs"]) for g in graphs),
        losses=losses,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtensor", choices=("vescale", "upstream"), default="vescale")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (docstring)")
    add_device_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = init_distributed(args.device, timeout=timedelta(seconds=300))
    init = upstream_init_device_mesh if args.dtensor == "upstream" else vescale.init_device_mesh
    mesh = init(device, (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    torch.compile(lambda a: a.sin() * 2)(torch.randn(8))  # Inductor start-up, charged to no one
    modes: dict[str, tuple[str | None, dict | None]] = {
        "eager": (None, None),
        "upstream inductor": ("inductor", None),
        "vescale": ("vescale", {}),
    }
    with tempfile.TemporaryDirectory(prefix=f"inductor-rank{dist.get_rank()}-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read at every cache access
        rows = {name: _run(mesh, args, backend, opts) for name, (backend, opts) in modes.items()}
    if dist.get_rank() == 0:
        _print(rows, mesh, args)
    dist.barrier()
    dist.destroy_process_group()


def _print(rows: dict[str, Row], mesh: Any, args: argparse.Namespace) -> None:
    """Times as ratios (the machine is shared): step time vs eager and vs upstream Inductor,
    the first (compiling) step vs upstream Inductor's."""
    ranks = f"{BACKENDS[mesh.device_type]} {mesh.device_type.upper()} ranks"
    print(f"GPT {CFG}, (dp={mesh.size(0)}, tp={mesh.size(1)}) {ranks}")
    print(
        f"{args.dtensor} DTensor TP{' + SP' if args.sp else ''} over tp, FSDP2 fully_shard over "
        f"dp per block + root, each block compiled, median of {args.steps} steps"
    )
    print(
        f"{'mode':<18} {'step/eager':>10} {'step/inductor':>13} {'first/inductor':>14} "
        f"{'graphs':>6} {'breaks':>6} {'fallbacks':>9} {'in-flight':>9}  {'loss |diff| vs eager':>20}"
    )
    eager, inductor = rows["eager"], rows["upstream inductor"]
    for name, r in rows.items():
        diff = max(abs(a - b) for a, b in zip(r.losses, eager.losses))
        print(
            f"{name:<18} {r.step_s / eager.step_s:>9.2f}x {r.step_s / inductor.step_s:>12.2f}x "
            f"{r.first_s / inductor.first_s:>13.2f}x {r.graphs:>6} {r.breaks:>6} "
            f"{r.fallbacks:>9} {r.inflight:>9}  {diff:>20.2e}"
        )


if __name__ == "__main__":
    main()
