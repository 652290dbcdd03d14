"""Train a small GPT on a 2-D (data parallel x tensor parallel) mesh with
``torch.compile(backend="vescale")``, beside eager vescale and the same model on one device.

    torchrun --standalone --nproc-per-node N examples/train_demo.py [--steps S] [--dump-dir DIR]
        [--device cpu|cuda] [--mesh DP,TP]

On N GPUs (one per local rank) it runs on CUDA + NCCL, else on CPU + gloo (``--device``
chooses: ``examples/launch.py``). The mesh is (N/2, 2) for an even N, (N, 1) for an odd one,
or ``--mesh``.

The model (``examples/gpt.py``) is plain PyTorch, built with ``vescale.deferred_init`` (no
weight allocated) for the distributed runs; ``gpt.parallelize`` materializes each rank's
shards, Megatron-style over tp, with the single-device values, and
``vescale.ddp.DistributedDataParallel`` reduces gradients over dp. Each step prints
the compiled, eager and single-device losses; then the collectives of the compiled graphs
(from ``collectives.json``), the compile time and where the dumps went. Exits 1 if any loss
differs from single device by more than the tolerance. The tokens are random
(``gpt.batch``), so the losses stay a little above ``ln(64) = 4.16``, moving by a few hundredths from
step to step: the demo checks that the three columns agree, not that the loss falls.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpt
from launch import BACKENDS, add_device_argument, init_distributed

import vescale
from vescale.ddp import DistributedDataParallel

TOLERANCE = 1e-5


class Run(NamedTuple):
    losses: list[float]
    first_step_s: float
    params: dict[str, torch.Tensor]


def mesh_shape(world: int, given: str | None = None) -> tuple[int, int]:
    """``(dp, tp)`` for ``world`` ranks: ``given`` as ``"DP,TP"`` (their product must be
    ``world``), else ``(world / 2, 2)`` for an even ``world`` and ``(world, 1)`` for an odd one."""
    if given is None:
        tp = 2 if world % 2 == 0 else 1
        return world // tp, tp
    parts = given.split(",")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"--mesh {given!r}: expected DP,TP (two positive integers)")
    dp, tp = int(parts[0]), int(parts[1])
    if dp * tp != world:
        raise SystemExit(f"--mesh {given!r}: {dp} x {tp} ranks, but the world has {world}")
    return dp, tp


def train(model: torch.nn.Module, cfg: gpt.GPTConfig, steps: int, lr: float, to_inputs) -> Run:
    """Per-step losses of ``steps`` SGD steps, the seconds the first step took, and the
    trained parameters (full tensors, by name)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, first = [], 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        loss = model(*to_inputs(*gpt.batch(cfg, step)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 0:
            first = time.perf_counter() - t0
        losses.append(
            loss.full_tensor().item() if isinstance(loss, vescale.DTensor) else loss.item()
        )
    params = {  # names without the torch.compile / DDP wrapper prefixes
        name.removeprefix("_orig_mod.").removeprefix("module."): (
            p.full_tensor() if isinstance(p, vescale.DTensor) else p
        ).detach()
        for name, p in model.named_parameters()
    }
    return Run(losses, first, params)


def gpt_runs(
    steps: int = 5,
    lr: float = 0.5,
    options: dict | None = None,
    cfg: gpt.GPTConfig | None = None,
    device: str = "cpu",
    shape: tuple[int, int] | None = None,
    compile_kwargs: dict | None = None,
) -> dict[str, Run]:
    """{"vescale": ..., "eager": ..., "1-device": ...}: the GPT trained on a (dp, tp) mesh of
    ``device`` (``shape``, default :func:`mesh_shape`) compiled with ``options`` (and
    ``compile_kwargs`` for ``torch.compile``, e.g. ``mode``), eagerly, and on one device (this
    rank's)."""
    cfg = cfg or gpt.GPTConfig()
    shape = shape or mesh_shape(dist.get_world_size())
    mesh = vescale.init_device_mesh(device, shape, mesh_dim_names=("dp", "tp"))

    def distributed() -> torch.nn.Module:
        return DistributedDataParallel(gpt.parallelize(gpt.build_deferred(cfg), mesh))

    def sharded(ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gpt.shard_batch(mesh, ids, targets)

    torch._dynamo.reset()
    compiled = torch.compile(
        distributed(), backend="vescale", options=options, **(compile_kwargs or {})
    )
    return {
        "vescale": train(compiled, cfg, steps, lr, sharded),
        "eager": train(distributed(), cfg, steps, lr, sharded),
        "1-device": train(
            gpt.build(cfg, device=device), cfg, steps, lr, lambda i, t: (i.to(device), t.to(device))
        ),
    }


def _summary(dump_dir: Path) -> list[str]:
    records = json.loads((dump_dir / "rank0" / "collectives.json").read_text())
    per: Counter[tuple] = Counter()
    nbytes: Counter[tuple] = Counter()
    for r in records:
        dim = "flat" if r["mesh_dim"] is None else str(r["mesh_dim"])  # flattened mesh dims
        key = (r["graph"].rsplit(".", 1)[1], r["kind"], dim)
        per[key] += 1
        nbytes[key] += r["bytes"]
    lines = [f"{'graph':<9} {'collective':<15} {'mesh dim':>8} {'count':>6} {'bytes':>9}"]
    for key in sorted(per):
        lines.append(f"{key[0]:<9} {key[1]:<15} {key[2]!s:>8} {per[key]:>6} {nbytes[key]:>9}")
    sources = sorted({r["source"] for r in records})
    lines.append(f"caused by: {', '.join(sources)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--codegen", default="inductor", choices=["inductor", "fx"])
    parser.add_argument("--dump-dir", default="vescale_dumps")
    parser.add_argument("--mesh", default=None, help="DP,TP (default: from the world size)")
    add_device_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = init_distributed(args.device, timeout=timedelta(seconds=120))
    shape = mesh_shape(dist.get_world_size(), args.mesh)
    rank = dist.get_rank()
    options = {"codegen": args.codegen, "dump_dir": args.dump_dir}
    runs = gpt_runs(args.steps, args.lr, options, device=device, shape=shape)
    ref = runs["1-device"].losses
    worst = max(abs(a - b) for name in ("vescale", "eager") for a, b in zip(runs[name].losses, ref))
    if rank == 0:
        mesh = f"(dp={shape[0]}, tp={shape[1]}) mesh of {device.upper()} ranks ({BACKENDS[device]})"
        print(f"GPT {gpt.GPTConfig()} on a {mesh}")
        print(f"{'step':>4}  {'vescale':>10}  {'eager':>10}  {'1-device':>10}  {'max |diff|':>10}")
        for i, (c, e, r) in enumerate(zip(runs["vescale"].losses, runs["eager"].losses, ref)):
            print(
                f"{i:>4}  {c:>10.6f}  {e:>10.6f}  {r:>10.6f}  {max(abs(c - r), abs(e - r)):>10.2e}"
            )
        print("\n".join(_summary(Path(args.dump_dir))))
        print(
            f"first step (compile + run) {runs['vescale'].first_step_s:.1f} s with backend=vescale "
            f"({args.codegen}); eager {runs['eager'].first_step_s:.2f} s"
        )
        print(f"graph dumps: {Path(args.dump_dir).resolve()}/rank*/")
        verdict = "OK" if worst <= TOLERANCE else "MISMATCH"
        print(f"max |diff| = {worst:.2e} ({verdict}, tolerance {TOLERANCE:.0e})")
    dist.barrier()
    dist.destroy_process_group()
    if worst > TOLERANCE:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
