"""The demo's GPT (``examples/train_demo.gpt_runs``: 3 SGD steps on a (dp=2, tp=2) mesh,
compiled, eager and on one device) run once per backend configuration per session.

tests/test_compiler.py and tests/passes/test_passes.py assert on the same runs instead of each
compiling the model again: every configuration is compiled once, and its per-rank result holds
all they check (losses, parameters, the ``collectives.json`` records and ``schedule.json``
lanes of the compiled graphs, and, for the unbucketed program, the collectives eager DDP
issues without buckets, counted by the profiler).
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from tests.harness import WorkerPool
from tests.harness.collectives import count_collectives
from vescale.backend import PASSES_OFF

# name -> (backend options, rank environment); those in DUMPED also write and read dumps
CONFIGS: dict[str, tuple[dict[str, Any] | None, dict[str, str]]] = {
    "inductor": ({"codegen": "inductor"}, {}),
    "fx": ({"codegen": "fx"}, {}),
    "fx-passes-off": ({"codegen": "fx", **PASSES_OFF}, {}),
    "eager-env": (None, {"VESCALE_COMPILE_EAGER": "1"}),
}
DUMPED = ("fx", "fx-passes-off")


class RankResult(NamedTuple):
    """One rank's result: ``runs[name] = (losses, params)`` for "vescale", "eager" and
    "1-device"; for the dumped configurations also its ``collectives.json`` records, the
    lanes of the last graph's ``schedule.json`` and whether that graph's fingerprint was
    dumped; for "fx-passes-off", eager DDP's unbucketed collective counts of one step."""

    runs: dict[str, tuple[list[float], dict[str, torch.Tensor]]]
    records: list[dict[str, Any]]
    lanes: set[str]
    fingerprinted: bool
    eager_counts: dict[str, int]


def _eager_unbucketed_counts() -> dict[str, int]:
    """The collectives of one eager forward + backward with one reduction per gradient (as
    the captured program issues them before the passes)."""
    import gpt

    import vescale
    from vescale.ddp import DistributedDataParallel

    mesh = vescale.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cfg = gpt.GPTConfig()
    eager = DistributedDataParallel(gpt.parallelize(gpt.build(cfg), mesh), bucket_cap_mb=0)
    inputs = gpt.shard_batch(mesh, *gpt.batch(cfg, 0))
    with count_collectives() as counts:  # CommDebugMode misses in-dispatch collectives
        eager(*inputs).backward()
    return dict(counts)


def _run(name: str, dump_root: str) -> RankResult:
    import train_demo

    options = CONFIGS[name][0]
    if name in DUMPED:
        options = {**(options or {}), "dump_dir": dump_root}
    runs = train_demo.gpt_runs(steps=3, options=options)
    out = {k: (run.losses, run.params) for k, run in runs.items()}
    if name not in DUMPED:
        return RankResult(out, [], set(), False, {})
    folder = Path(dump_root) / f"rank{dist.get_rank()}"
    records = json.loads((folder / "collectives.json").read_text())
    last = folder / records[-1]["graph"]
    trace = json.loads((last / "schedule.json").read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    lanes = {names[e["tid"]] for e in trace["traceEvents"] if e["ph"] == "X"}
    fingerprinted = (last / "graph.fingerprint.txt").exists()
    counts = _eager_unbucketed_counts() if name == "fx-passes-off" else {}
    return RankResult(out, records, lanes, fingerprinted, counts)


@functools.cache
def gpt_results(pool: WorkerPool, name: str) -> list[RankResult]:
    """The per-rank results of configuration ``name`` of :data:`CONFIGS` on ``pool`` (the
    session's 4-rank pool), computed on first use."""
    with tempfile.TemporaryDirectory() as root:
        return pool.run(_run, name, root, env=CONFIGS[name][1], timeout_s=300)
