"""Warm start: a second process compiling the same DTensor program with ``backend="vescale"``
reuses Inductor's FX graph cache (keyed on the graph after vescale's passes), and a changed
backend option or a changed placement, which change that graph, compiles anew.

The first (cold) compile runs in the pytest process, the second in a child process, each on
the single-process ``fake`` process group (2 ranks). Both use Inductor's default cache
directory, whose compiled C++ (CPU feature probes, precompiled headers, kernels) earlier
compiles left warm; the program carries a constant drawn per test run (the salt), so its
graphs are new to the FX graph cache: the cold compile misses.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _program(x: Any, w1: Any, w2: Any, salt: int) -> Any:
    """Two row-parallel linears (weights brought to ``Shard(1)`` first, a no-op if they are),
    their outputs all-reduced and multiplied; times ``salt`` (an int: a constant of the
    graph)."""
    from vescale import Replicate, Shard

    mesh, r = x.device_mesh, [Replicate()]
    a = x @ w1.redistribute(mesh, [Shard(1)]).t()
    b = x @ w2.redistribute(mesh, [Shard(1)]).t()
    return (a.redistribute(mesh, r) * b.redistribute(mesh, r)).sum() * salt


def _compile_counts(salt: int, variants: list[str]) -> dict[str, dict[str, int]]:
    """For each variant, compile forward and backward of two row-parallel linears (two
    all-reduces) and return Inductor's FX-graph cache counters of that compile."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import vescale
    from vescale import Shard

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = vescale.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        x = vescale.distribute_tensor(torch.randn(4, 8), mesh, [Shard(1)])
        out: dict[str, dict[str, int]] = {}
        for variant in variants:
            dim = 0 if variant == "weights Shard(0)" else 1
            w1, w2 = (
                vescale.distribute_tensor(torch.randn(8, 8), mesh, [Shard(dim)]).requires_grad_()
                for _ in range(2)
            )
            options: dict[str, Any] = {"bucket_cap_mb": 0} if variant == "bucket_cap_mb=0" else {}
            torch._dynamo.reset()
            counters.clear()
            torch.compile(_program, backend="vescale", options=options)(x, w1, w2, salt).backward()
            out[variant] = {k: v for k, v in counters["inductor"].items() if "fxgraph_cache" in k}
    finally:
        dist.destroy_process_group()
    return out


def _child(salt: int, variants: list[str]) -> dict[str, dict[str, int]]:
    code = (
        "import json, sys; from tests.test_compile_cache import _compile_counts; "
        "print('COUNTS', json.dumps(_compile_counts(int(sys.argv[1]), sys.argv[2:])))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(salt), *variants],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("COUNTS "))
    return json.loads(line.removeprefix("COUNTS "))  # type: ignore[no-any-return]


# Inductor's first import in this process imports torch.utils.mkldnn, whose ScriptModules
# use torch.jit.script_method: torch's own deprecation warnings, not raised by vescale code.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_second_process_hits_and_changes_recompile():
    salt = random.SystemRandom().randrange(2, 2**31)
    try:
        cold = _compile_counts(salt, ["base"])  # in this process
    finally:
        torch._dynamo.reset()
    assert cold["base"] == {"fxgraph_cache_miss": 2}, cold  # forward and backward graphs
    warm = _child(salt, ["base", "bucket_cap_mb=0", "weights Shard(0)"])
    assert warm["base"] == {"fxgraph_cache_hit": 2}, warm
    # no bucketing: two all-reduces instead of one merged, in the forward graph
    assert warm["bucket_cap_mb=0"].get("fxgraph_cache_miss", 0) >= 1, warm
    # column- instead of row-sharded weights: other local shapes and collectives
    assert warm["weights Shard(0)"] == {"fxgraph_cache_miss": 2}, warm
