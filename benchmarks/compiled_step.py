"""Full training step of a dp x tp GPT: eager vescale, upstream Inductor (its communication
passes off and on), the torchtitan-style 2-D recipe, the vescale backend with its passes off
and on, and a compute-only lower bound.

    torchrun --standalone --nproc-per-node 4 benchmarks/compiled_step.py [--steps 20] [--sweep 1 25]
        [--device cpu|cuda]

Same GPT (``examples/gpt.py``, 4 blocks) on a (world/2, 2) mesh for every mode, a step is
forward, backward and an SGD step:

* vescale modes and ``upstream inductor*``: the vescale DTensor model wrapped in
  ``vescale.ddp.DistributedDataParallel`` (every gradient reduced to its parameter's
  placements); ``upstream inductor + comm passes`` turns on Inductor's FX bucketing of
  all-reduce / reduce-scatter / all-gather, ``reorder_for_compute_comm_overlap`` and (if it
  compiles on CPU) ``aten_distributed_optimizations.enable_overlap_scheduling``;
* ``torchtitan 2-D``: the plain model with upstream tensor-parallel styles over tp (q/k/v and
  the first MLP linear column-wise, the projections row-wise, the head column-wise with
  replicated logits), FSDP2 (``fully_shard``) over dp per block and at the root, each block
  compiled with ``backend="inductor"`` as torchtitan does, each dp rank feeding its batch shard;
* ``compute only``: ``vescale, passes on`` with every collective replaced by a local op of the
  same output shape (an all-reduce by its input, others by zeros) and waits dropped: the step
  with free communication, a lower bound;
* ``vescale plan path``: the plain model, ``vescale.parallelize`` with every parameter in the
  placements ``gpt.parallelize`` gives it and the batch ``Shard(0)`` over dp; the global solver
  places every activation with costs from ``calibrate(mesh)`` on this mesh (so it may choose
  another program than Megatron's for the same parameters); compiled by the vescale backend.
  Its first-step loss must equal ``eager vescale``'s; the solver's summary is printed.
  ``plan path, compute only``: the same program with every collective a local op.

Every mode is built and warmed up (three steps) first; then ``--steps`` rounds time one step
of every mode in turn, so all medians (rank 0) come from the same stretch of a shared
machine's drifting load. Compile time is the first step minus that median. Collectives and bytes per step are counted with the
profiler (every ``_c10d_functional`` collective, wherever it is issued, Inductor's in-place
variants included; bytes of this rank's inputs). Last, ``vescale / best upstream`` (the
fastest upstream mode), ``vescale plan path / best upstream`` and ``vescale / compute only``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config as inductor_config
import torch.distributed as dist
import torch.nn.functional as F
from torch._inductor.compile_fx import compile_fx
from torch.distributed.device_mesh import init_device_mesh as upstream_init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import gpt
from launch import BACKENDS, add_device_argument, init_distributed, synchronize

import vescale
from vescale import backend as vescale_backend
from vescale.backend import PASSES_OFF
from vescale.backend import vescale_backend as vescale_backend_fn
from vescale.ddp import DistributedDataParallel
from vescale.fx.collectives import COLLECTIVE_KINDS, WAIT_TENSOR
from vescale.plan import calibrate

CFG = gpt.GPTConfig(vocab=128, seq=32, dim=64, heads=4, layers=4)
DEVICE = "cpu"  # main sets it from --device (examples/launch.py)
CFG_BATCH = 8  # gpt.batch's global batch size
PLAN_ROW = "vescale plan path (parallelize, global solver)"
PLAN_FREE = "plan path, compute only"
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


def _is_collective(name: str) -> bool:
    """A ``_c10d_functional`` collective, functional or Inductor's in-place/out variants."""
    return name.startswith("_c10d_functional::") and not name.endswith(_NOT_COLLECTIVES)


def _count(
    step: Callable[[], Any], is_collective: Callable[[str], bool] = _is_collective
) -> tuple[int, int]:
    """(collectives, bytes of their first input) one call of ``step`` issues on this rank,
    counting the outermost events ``is_collective`` names (a list-of-tensors input, as c10d's
    ops record it, counts no bytes)."""
    with torch.profiler.profile(record_shapes=True) as prof:
        step()
    n = nbytes = 0
    for e in prof.events():
        parent, nested = e.cpu_parent, False
        while parent is not None and not nested:
            nested, parent = is_collective(parent.name), parent.cpu_parent
        if is_collective(e.name) and not nested:
            n += 1
            shape = e.input_shapes[0] if e.input_shapes and e.input_shapes[0] else []
            if shape and isinstance(shape[0], int):
                nbytes += 4 * int(torch.Size(shape).numel())  # float32 model
    return n, nbytes


Step = tuple[torch.nn.Module, torch.optim.Optimizer, list[tuple[Any, Any]]]
COMM_PASSES: dict[str, Any] = {
    "bucket_all_reduces_fx": "all",
    "bucket_reduce_scatters_fx": "all",
    "bucket_all_gathers_fx": "all",
    "reorder_for_compute_comm_overlap": True,
}


def _vescale_step(mesh: vescale.DeviceMesh, backend: str | None, options: dict | None) -> Step:
    model: torch.nn.Module = DistributedDataParallel(
        gpt.parallelize(gpt.build(CFG, device=DEVICE), mesh)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # a backend object per mode: Dynamo's cache entries match the backend by identity, and
    # every mode lives in one process, so modes must not reuse one another's graphs
    if backend == "vescale":
        model = torch.compile(model, backend=functools.partial(vescale_backend_fn, options=options))
    elif backend == "inductor":
        model = torch.compile(model, backend=functools.partial(compile_fx))
    return model, opt, [gpt.shard_batch(mesh, *gpt.batch(CFG, i, device=DEVICE)) for i in range(4)]


_plan_summary: list[str] = []


def _plan_step(mesh: vescale.DeviceMesh) -> Step:
    """The plain model through ``vescale.parallelize`` (see module docstring)."""
    plan = {**gpt.PLAN, "*": (Replicate(), Replicate())}  # every parameter as gpt.parallelize
    batch = {"dp": Shard(0)}
    model = vescale.parallelize(
        gpt.build(CFG, device=DEVICE),
        mesh,
        plan,
        inputs=[batch, batch],
        example_inputs=gpt.batch(CFG, 0, device=DEVICE),
        alpha_beta=calibrate(mesh),
    )
    _plan_summary.append(model.explain().summary())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, [gpt.batch(CFG, i, device=DEVICE) for i in range(4)]


def _local_attention(self: gpt.Attention, x: torch.Tensor) -> torch.Tensor:
    """``gpt.Attention.forward`` on this rank's heads (``self.heads`` local, widths from the
    local tensors), as torchtitan's models are written for tensor parallelism."""
    b, t, _ = x.shape
    q, k, v = (
        lin(x).view(b, t, self.heads, -1).transpose(1, 2) for lin in (self.q, self.k, self.v)
    )
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def _titan_step() -> Step:
    """The torchtitan-style 2-D recipe on the plain model (see module docstring)."""
    mesh = upstream_init_device_mesh(
        DEVICE, (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp")
    )
    tp, dp = mesh["tp"], mesh["dp"]
    model = gpt.build(CFG, device=DEVICE)
    styles = {"attn.proj": RowwiseParallel(), "mlp.proj": RowwiseParallel()}
    styles |= {name: ColwiseParallel() for name in ("attn.q", "attn.k", "attn.v", "mlp.fc")}
    for block in model.blocks:
        block.attn.heads //= tp.size()
        block.attn.forward = _local_attention.__get__(block.attn)
        parallelize_module(block, tp, styles)
    parallelize_module(model, tp, {"head": ColwiseParallel(output_layouts=Replicate())})
    for block in model.blocks:
        block.compile(backend="inductor")
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = CFG_BATCH // dp.size()
    first = dp.get_local_rank() * rows
    batches = [
        tuple(a[first : first + rows] for a in gpt.batch(CFG, i, device=DEVICE)) for i in range(4)
    ]
    return model, opt, batches


def _no_comm(gm: torch.fx.GraphModule, ctx: Any) -> torch.fx.GraphModule:
    """Every collective replaced by a local op of its output's shape, waits dropped."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is WAIT_TENSOR:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.target in COLLECTIVE_KINDS:
            val = node.meta["val"]
            if not isinstance(val, torch.Tensor):
                raise NotImplementedError(f"compute only: {node.target} (coalesced)")
            with graph.inserting_before(node):
                local = node.args[0]
                if COLLECTIVE_KINDS[node.target] != "all_reduce":
                    local = graph.call_function(
                        torch.ops.aten.full.default,
                        (list(val.shape), 0),
                        {"dtype": val.dtype, "device": val.device},
                    )
            node.replace_all_uses_with(local)
            graph.erase_node(node)
    graph.lint()
    return gm


@contextlib.contextmanager
def _compute_only() -> Iterator[None]:
    """The vescale backend with :func:`_no_comm` after its passes."""
    vescale_backend.PIPELINE.passes.append(("no_comm", _no_comm))
    try:
        yield
    finally:
        vescale_backend.PIPELINE.passes.pop()


@dataclass
class _Mode:
    step: Callable[..., Any]  # (i, phases=None): see _prepare
    first_s: float  # the first step: compile + one step
    loss: float | None  # the first step's global loss (None: a per-rank loss)
    collectives: int
    nbytes: int
    build_s: float = 0.0  # building the mode (for the plan path: capture, propagate, solve)
    times: list[float] = field(default_factory=list)


def _first_loss(loss: Any) -> float | None:
    """The first step's loss as every rank sees it (a DTensor's full value), else None."""
    return loss.full_tensor().item() if hasattr(loss, "full_tensor") else None


def _prepare(
    build: Callable[[], Step],
    scope: contextlib.AbstractContextManager | None = None,
    *,
    loss_value: Callable[[Any], float | None] = _first_loss,
    is_collective: Callable[[str], bool] = _is_collective,
) -> _Mode:
    """Build a mode and run its three warm-up steps inside ``scope`` (compiles happen there);
    ``loss_value`` reads the first loss, ``is_collective`` names the events counted."""
    with scope or contextlib.nullcontext():
        dist.barrier()
        t0 = time.perf_counter()
        model, opt, batches = build()
        built = time.perf_counter() - t0

        def step(i: int = 0, phases: list[float] | None = None) -> Any:
            """Step ``i``; ``phases`` gets its forward, backward and optimizer seconds."""

            def now() -> float:  # a phase's end on the device too (only when phases are read)
                if phases is not None:
                    synchronize(DEVICE)
                return time.perf_counter()

            t0 = now()
            loss = model(*batches[i % len(batches)])
            t1 = now()
            opt.zero_grad()
            loss.backward()
            t2 = now()
            opt.step()
            if phases is not None:
                phases += [t1 - t0, t2 - t1, now() - t2]
            return loss

        dist.barrier()
        t0 = time.perf_counter()
        loss = step(0)
        synchronize(DEVICE)
        first = time.perf_counter() - t0
        value = loss_value(loss)
        step(1)
        step(2)
        return _Mode(step, first, value, *_count(step, is_collective), build_s=built)


def _time_interleaved(modes: dict[str, _Mode], steps: int) -> None:
    """``steps`` rounds, each one step of every mode in turn: a shared machine's load
    drifts over minutes, so every mode's median is taken over the same stretch of time."""
    for i in range(steps):
        for mode in modes.values():
            dist.barrier()
            t0 = time.perf_counter()
            mode.step(3 + i)
            synchronize(DEVICE)
            mode.times.append(time.perf_counter() - t0)


def _upstream_comm_passes(mesh: vescale.DeviceMesh) -> tuple[str, _Mode]:
    """``upstream inductor`` with Inductor's communication passes; overlap scheduling too
    where it compiles on CPU."""
    try:
        flags = {**COMM_PASSES, "aten_distributed_optimizations.enable_overlap_scheduling": True}
        mode = _prepare(lambda: _vescale_step(mesh, "inductor", None), inductor_config.patch(flags))
        return "upstream ind. + comm+overlap", mode
    except Exception as err:
        if dist.get_rank() == 0:
            first = str(err).strip().splitlines()[-1][:160] if str(err).strip() else ""
            print(f"overlap scheduling fails on CPU ({type(err).__name__}: {first}): without it")
    torch._dynamo.reset()
    mode = _prepare(
        lambda: _vescale_step(mesh, "inductor", None), inductor_config.patch(COMM_PASSES)
    )
    return "upstream ind. + comm passes", mode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sweep", type=float, nargs="*", default=[])
    parser.add_argument("--skip", nargs="*", default=[], help="modes (row names) not to run")
    add_device_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    global DEVICE
    DEVICE = init_distributed(args.device, timeout=timedelta(seconds=300))
    mesh = vescale.init_device_mesh(
        DEVICE, (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp")
    )
    torch.compile(lambda a: a.sin() * 2)(torch.randn(8))  # Inductor start-up, charged to no one
    vescale_modes: dict[str, tuple[str | None, dict | None]] = {
        "eager vescale": (None, None),
        "upstream inductor": ("inductor", None),
        "vescale, passes off": ("vescale", PASSES_OFF),
        "vescale, passes on": ("vescale", {}),
    }
    for cap in args.sweep:
        vescale_modes[f"  bucket_cap_mb={cap:g}"] = ("vescale", {"bucket_cap_mb": cap})
    modes: dict[str, _Mode] = {}
    if "upstream inductor + comm passes" not in args.skip:  # first: its fallback resets Dynamo
        comm_name, comm_mode = _upstream_comm_passes(mesh)
    for name, (backend, opts) in vescale_modes.items():
        if name not in args.skip:
            modes[name] = _prepare(lambda b=backend, o=opts: _vescale_step(mesh, b, o))
    if "upstream inductor + comm passes" not in args.skip:
        modes[comm_name] = comm_mode
    if "torchtitan 2-D" not in args.skip:
        modes["torchtitan 2-D"] = _prepare(_titan_step)
    modes["compute only"] = _prepare(lambda: _vescale_step(mesh, "vescale", {}), _compute_only())
    if PLAN_ROW not in args.skip:
        modes[PLAN_ROW] = _prepare(lambda: _plan_step(mesh))
        modes[PLAN_FREE] = _prepare(lambda: _plan_step(mesh), _compute_only())
        ref = next(m.loss for m in modes.values() if m.loss is not None)
        if abs(modes[PLAN_ROW].loss - ref) > 1e-4 * max(abs(ref), 1.0):  # type: ignore[operator]
            raise AssertionError(f"plan path loss {modes[PLAN_ROW].loss} != {ref}")
    _time_interleaved(modes, args.steps)
    if dist.get_rank() == 0:
        rows = {}
        for name, m in modes.items():
            median = statistics.median(m.times)
            rows[name] = (median, m.first_s - median, m.collectives, m.nbytes, m.loss)
        _print(rows, mesh)
        for text in _plan_summary[:1]:  # the same choice both times (calibration is cached)
            print(f"plan path solver (rank 0):\n{text}")
    dist.barrier()
    dist.destroy_process_group()


Row = tuple[float, float, int, int, float | None]


def _print(rows: dict[str, Row], mesh: vescale.DeviceMesh) -> None:
    base = rows.get("eager vescale", next(iter(rows.values())))[0]
    ranks = f"{BACKENDS[DEVICE]} {DEVICE.upper()} ranks"
    print(f"GPT {CFG}, (dp={mesh.size(0)}, tp={mesh.size(1)}) {ranks}, SGD step")
    head = (
        f"{'mode':<46} {'step ms':>8} {'vs eager':>9} {'colls/step':>10} {'KiB/step':>9} "
        f"{'compile s':>9} {'loss 0':>8}"
    )
    print(head)
    for name, (med, compile_s, n, nbytes, loss) in rows.items():
        compile_txt = f"{compile_s:>9.1f}" if name != "eager vescale" else f"{'-':>9}"
        loss_txt = f"{loss:>8.4f}" if loss is not None else f"{'-':>8}"
        print(
            f"{name:<46} {med * 1e3:>8.2f} {med / base:>8.2f}x {n:>10} "
            f"{nbytes / 1024:>9.1f} {compile_txt} {loss_txt}"
        )
    upstream = {k: v[0] for k, v in rows.items() if k.startswith(("upstream", "torchtitan"))}
    if not upstream:
        return
    best = min(upstream, key=upstream.__getitem__)
    for name, label in (("vescale, passes on", "vescale"), (PLAN_ROW, "vescale plan path")):
        if name in rows:
            print(f"{label} / best upstream ({best}): {rows[name][0] / upstream[best]:.2f}")
    for name, label in (("vescale, passes on", "vescale"), (PLAN_ROW, "vescale plan path")):
        if name in rows and "compute only" in rows:
            print(f"{label} / compute only: {rows[name][0] / rows['compute only'][0]:.2f}")
    if PLAN_ROW in rows and PLAN_FREE in rows:
        print(f"vescale plan path / its compute only: {rows[PLAN_ROW][0] / rows[PLAN_FREE][0]:.2f}")


if __name__ == "__main__":
    # kineto logs every profiler start and stop (the collective counts) at its top level, "USDT"
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    main()
