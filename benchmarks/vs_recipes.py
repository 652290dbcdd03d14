"""The plan path with an empty plan and a free batch against hand-written upstream recipes.

    torchrun --standalone --nproc-per-node 4 benchmarks/vs_recipes.py \\
        [--cfg tiny|medium|hf-llama|hf-llama-tiny] [--steps 10] [--phases] [--device cpu|cuda]

The plain GPT of ``examples/gpt.py`` (``tiny``, ``medium``), or transformers'
``LlamaForCausalLM`` (``hf-llama``: vocab 256, hidden 64, 2 layers, sequence 32, the loss
from ``labels`` only, as the model is written; ``hf-llama-tiny``: hidden 32, 1 layer, as
``tests/plan/test_llama_plan.py`` builds it); global batch 8; a step is forward, backward
and SGD:

* ``upstream DDP-4 + inductor``: ``torch.nn.parallel.DistributedDataParallel`` over the world,
  ``torch.compile`` (Inductor), each rank feeding its batch shard;
* ``upstream FSDP2-4 + inductor``: ``fully_shard`` per block and at the root over the world,
  each block compiled with Inductor;
* ``upstream TP+FSDP2 2-D``: the torchtitan-style recipe of ``benchmarks/compiled_step.py``
  (tensor parallel over tp, FSDP2 over dp, blocks compiled with Inductor; the GPT only);
* ``upstream ind. + comm passes: Megatron TP x DDP``: the Megatron row of
  ``benchmarks/compiled_step.py``: ``gpt.parallelize``'s tensor parallelism over tp (vescale
  DTensors), ``vescale.ddp`` over dp, compiled by Inductor with its communication passes
  (bucketing, compute/communication reordering; overlap scheduling where it compiles on
  CPU); the GPT only. Its parameters are replicated over dp, so the budget row is not
  compared with it;
* ``parallelize, empty plan``: ``vescale.parallelize(model, mesh, {}, inputs=[Batch("dp",
  "tp")] * 2)`` with calibrated costs: the solver chooses every placement;
* ``parallelize, empty plan, budget``: the same with ``memory_budget`` = the leanest choice's
  bytes per rank plus a quarter of the replicated parameter, gradient and optimizer bytes:
  a choice with replicated parameters (DDP) does not fit, 4-way sharded ones do.

Every mode is built and warmed up first; then ``--steps`` rounds time one step of each mode
in turn (medians on rank 0 over the same stretch of a shared machine's load). Each mode's
first-step loss (the global mean) must equal one device's within 1e-5. Ratios: each
``parallelize`` row over the fastest upstream row, and the budget row over the fastest
upstream row whose parameters are sharded (DDP holds replicated ones, which the budget
excludes); the empty plan's build (calibration from its cache, capture, propagation, solve,
materialization) plus first step (compile) over the fastest upstream row's. ``--phases``
then times DDP-4's and the empty plan's forward, backward and optimizer step apart (medians
of as many interleaved rounds): where a step's time goes outside the compiled code.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh as upstream_init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as UpstreamDDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import compiled_step
import gpt
from launch import BACKENDS, add_device_argument, init_distributed

import vescale
from vescale.plan import Batch, calibrate


@dataclass(frozen=True)
class Model:
    """A benchmarked model: its builder, step ``i``'s global batch, its repeated blocks
    (FSDP2 shards each) and whether the torchtitan-style GPT recipe applies."""

    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, ...]]
    blocks: Callable[[Any], Any]
    titan: gpt.GPTConfig | None = None


def _gpt(cfg: gpt.GPTConfig) -> Model:
    return Model(
        f"GPT {cfg}",
        lambda: gpt.build(cfg, device=compiled_step.DEVICE),
        lambda i: gpt.batch(cfg, i, device=compiled_step.DEVICE),
        lambda m: m.blocks,
        titan=cfg,
    )


class _LabelsOnly(torch.nn.Module):
    """A Hugging Face causal LM's loss as a training loop asks for it (labels only)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=labels).loss


def _hf_llama(hidden: int, layers: int) -> Model:
    """transformers' ``LlamaForCausalLM`` (vocab 256, 4 heads, 2 key/value heads), sequence 32."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return _LabelsOnly(transformers.LlamaForCausalLM(cfg)).to(compiled_step.DEVICE)

    def batch(i: int) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(0, 256, (BATCH, 32), generator=torch.Generator().manual_seed(i))
        ids = ids.to(compiled_step.DEVICE)
        return ids, ids

    return Model(
        f"HF LlamaForCausalLM (vocab 256, hidden {hidden}, {layers} layer{'s' * (layers > 1)})",
        build,
        batch,
        lambda m: m.lm.model.layers,
    )


BATCH = 8
CONFIGS: dict[str, Callable[[], Model]] = {
    "tiny": lambda: _gpt(gpt.GPTConfig(vocab=128, seq=32, dim=64, heads=4, layers=4)),
    "medium": lambda: _gpt(gpt.GPTConfig(vocab=1024, seq=128, dim=256, heads=8, layers=4)),
    "hf-llama": lambda: _hf_llama(64, 2),
    # the configuration of tests/plan/test_llama_plan.py
    "hf-llama-tiny": lambda: _hf_llama(32, 1),
}
Step = compiled_step.Step
_summaries: dict[str, str] = {}


def _my_rows(model: Model, i: int, ranks: int, rank: int) -> tuple[torch.Tensor, ...]:
    rows = BATCH // ranks
    return tuple(a[rank * rows : (rank + 1) * rows] for a in model.batch(i))


def _ddp(spec: Model) -> Step:
    model = torch.compile(UpstreamDDP(spec.build()), backend="inductor")
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = [_my_rows(spec, i, world, rank) for i in range(4)]
    return model, torch.optim.SGD(model.parameters(), lr=0.1), batches


def _own_forward(block: torch.nn.Module) -> None:
    """The block's forward under a code object of its own: Dynamo keys compiled code by the
    frame's code, and the 2-D recipe compiles ``gpt.Block.forward`` for its DTensors."""
    forward = type(block).forward

    def own(self: Any, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, **kwargs)

    block.forward = own.__get__(block)  # type: ignore[method-assign]


def _fsdp(spec: Model) -> Step:
    mesh = upstream_init_device_mesh(compiled_step.DEVICE, (dist.get_world_size(),))
    model = spec.build()
    for block in spec.blocks(model):
        _own_forward(block)
        block.compile(backend="inductor")
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = [_my_rows(spec, i, world, rank) for i in range(4)]
    return model, torch.optim.SGD(model.parameters(), lr=0.1), batches


def _titan(cfg: gpt.GPTConfig) -> Step:
    compiled_step.CFG = cfg  # its recipe builds compiled_step.CFG
    return compiled_step._titan_step()


def _plan(spec: Model, mesh: Any, name: str, budget: int | None) -> Step:
    free = Batch("dp", "tp")
    model = vescale.parallelize(
        spec.build(),
        mesh,
        {},
        inputs=[free, free],
        example_inputs=spec.batch(0),
        alpha_beta=calibrate(mesh),
        memory_budget=budget,
    )
    report = model.explain()
    _summaries[name] = report.summary()
    _summaries[name + " memory"] = report.memory  # type: ignore[assignment]
    assert model.program.memory is not None
    _summaries[name + " least"] = str(model.program.memory.least())
    return model, torch.optim.SGD(model.parameters(), lr=0.1), [spec.batch(i) for i in range(4)]


def _global_loss(loss: torch.Tensor) -> float:
    """The step's global mean loss: a DTensor's value, else the mean of the ranks' (equal
    shards)."""
    if isinstance(loss, vescale.DTensor) or hasattr(loss, "full_tensor"):
        return float(loss.full_tensor().item())
    value = loss.detach().clone()
    dist.all_reduce(value)
    return float(value.item()) / dist.get_world_size()


def _prepare(build: Callable[[], Step]) -> compiled_step._Mode:
    """Build a mode, run its first step (compile; global loss kept) and two more."""
    return compiled_step._prepare(build, loss_value=_global_loss, is_collective=_collective)


def _collective(name: str) -> bool:
    """A functional collective, or a c10d one (upstream DDP's and FSDP2's)."""
    return compiled_step._is_collective(name) or (
        name.startswith("c10d::") and not name.endswith(("wait", "barrier"))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cfg", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--phases",
        action="store_true",
        help="then time forward, backward and the optimizer step apart (DDP-4, empty plan)",
    )
    add_device_argument(parser)
    args = parser.parse_args()
    spec = CONFIGS[args.cfg]()
    torch.set_num_threads(1)
    compiled_step.DEVICE = init_distributed(args.device, timeout=timedelta(seconds=900))
    mesh = vescale.init_device_mesh(
        compiled_step.DEVICE, (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp")
    )
    ref = spec.build()(*spec.batch(0)).item()  # one device, first step's loss
    modes: dict[str, compiled_step._Mode] = {
        "upstream DDP-4 + inductor": _prepare(lambda: _ddp(spec)),
        "upstream FSDP2-4 + inductor": _prepare(lambda: _fsdp(spec)),
    }
    if spec.titan is not None:
        titan = spec.titan
        modes["upstream TP+FSDP2 2-D"] = _prepare(lambda: _titan(titan))
        compiled_step.CFG = titan  # Megatron TP over tp, DDP over dp: gpt.parallelize's
        name, mode = compiled_step._upstream_comm_passes(mesh)
        modes[f"{name}: Megatron TP x DDP"] = mode
    free, budgeted = "parallelize, empty plan", "parallelize, empty plan, budget"
    modes[free] = _prepare(lambda: _plan(spec, mesh, free, None))
    need: Any = _summaries[free + " memory"]
    state = need["parameters"] + need["gradients"] + need["optimizer"]  # replicated
    # the leanest choice plus a quarter of the replicated state: every choice that keeps
    # the parameters replicated holds all of it, so only sharded ones fit
    budget = int(_summaries[free + " least"]) + state // 4  # type: ignore[call-overload]
    modes[budgeted] = _prepare(lambda: _plan(spec, mesh, budgeted, budget))
    bad = {n: m.loss for n, m in modes.items() if abs(m.loss - ref) > 1e-5 * max(abs(ref), 1)}  # type: ignore[operator]
    if bad:
        raise AssertionError(f"first-step losses differ from one device's {ref}: {bad}")
    compiled_step._time_interleaved(modes, args.steps)
    phases = _phases(modes, ("upstream DDP-4 + inductor", free), args.steps) if args.phases else {}
    if dist.get_rank() == 0:
        _print(spec, modes, ref, need["total"], budget)
        _print_phases(phases)
    dist.barrier()
    dist.destroy_process_group()


def _phases(
    modes: dict[str, compiled_step._Mode], names: tuple[str, ...], steps: int
) -> dict[str, list[list[float]]]:
    """Per mode of ``names``: forward, backward and optimizer seconds of ``steps`` rounds,
    the modes interleaved as in the step timing."""
    out: dict[str, list[list[float]]] = {n: [] for n in names}
    for i in range(steps):
        for n in names:
            dist.barrier()
            phases: list[float] = []
            modes[n].step(3 + i, phases)
            out[n].append(phases)
    return out


def _print_phases(phases: dict[str, list[list[float]]]) -> None:
    if not phases:
        return
    print("\n| mode | forward ms | backward ms | optimizer step ms | sum ms |")
    print("|---|---|---|---|---|")
    for n, rounds in phases.items():
        med = [statistics.median(r[k] for r in rounds) * 1e3 for k in range(3)]
        print(f"| {n} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} | {sum(med):.2f} |")


def _print(
    spec: Model, modes: dict[str, compiled_step._Mode], ref: float, need: int, budget: int
) -> None:
    med = {n: statistics.median(m.times) for n, m in modes.items()}
    ranks = f"{dist.get_world_size()} {BACKENDS[compiled_step.DEVICE]} {compiled_step.DEVICE.upper()} ranks"
    print(f"{spec.name}, batch {BATCH}, {ranks}, SGD step; one-device loss {ref:.6f}")
    print("| mode | step ms | colls/step | KiB/step | build + first step s | loss 0 |")
    print("|---|---|---|---|---|---|")
    for n, m in modes.items():
        print(
            f"| {n} | {med[n] * 1e3:.1f} | {m.collectives} | {m.nbytes / 1024:.1f} | "
            f"{m.build_s + m.first_s:.1f} | {m.loss:.6f} |"
        )
    upstream = {n: t for n, t in med.items() if n.startswith("upstream")}
    best = min(upstream, key=upstream.__getitem__)
    sharded = {n: t for n, t in upstream.items() if "DDP" not in n}
    best_fit = min(sharded, key=sharded.__getitem__)
    print(
        f"parallelize, empty plan / {best}: {med['parallelize, empty plan'] / upstream[best]:.2f}"
    )
    print(
        f"parallelize, empty plan, budget ({budget} B; the free choice: {need} B) / {best_fit}: "
        f"{med['parallelize, empty plan, budget'] / sharded[best_fit]:.2f}"
    )
    first = {n: m.build_s + m.first_s for n, m in modes.items()}
    print(
        f"parallelize, empty plan: planning + first step / {best}'s build + first step: "
        f"{first['parallelize, empty plan'] / first[best]:.2f}"
    )
    for name in ("parallelize, empty plan", "parallelize, empty plan, budget"):
        print(f"\n{name} (rank 0's solve):\n{_summaries[name]}")


if __name__ == "__main__":
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no profiler start/stop lines
    main()
