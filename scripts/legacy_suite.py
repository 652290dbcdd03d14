"""Run veScale legacy's DTensor tests against this vescale, adapted to CPU + gloo.

usage: python scripts/legacy_suite.py LEGACY [--work DIR] [--timeout S] [FILE ...]

LEGACY is a checkout of ``volcengine/veScale`` (the folder holding ``legacy/test/``, or that
``test/`` folder itself). Its test files are copied into ``--work`` (never into this repository)
and rewritten mechanically: ``"cuda"`` -> ``"cpu"``, ``"nccl"`` -> ``"gloo"``, ``.cuda()`` and
CUDA seeding dropped, the "needs N GPUs" skip lifted. Tests that call a kernel only CUDA has are
skipped by name (``CUDA_ONLY``). Each FILE (relative to ``legacy/test/``, default ``FILES``) runs
alone under ``nice`` and a timeout, one at a time; rank processes start by fork. Prints a per-file
table (collected / passed / failed / error / skipped) and each failure's first error line.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

from suite_runner import STATUSES, first_error, run_pytest, verdicts

FILES = [
    "dtensor/general/test_dtensor.py",
    "dtensor/general/test_redistribute.py",
    "dtensor/general/test_api.py",
    "dtensor/shard/test_basic.py",
    "dtensor/general/test_equal.py",
    "dtensor/general/test_utils.py",
    "dtensor/device_mesh/test_device_mesh.py",
    "dtensor/device_mesh/test_device_mesh_with_pg.py",
    "dtensor/ops/test_tensor_ops.py",
    "dtensor/ops/test_embedding_ops.py",
    "dtensor/loss/test_loss.py",
    "dtensor/shard/test_interleaved_shard.py",
    "initialize/test_defer_init.py",
    "dtensor/general/test_dispatch.py",
    "dtensor/comm/test_basic.py",
    "dtensor/comm/test_all_to_all.py",
    "dtensor/general/test_init.py",
    "dtensor/ops/test_math_ops.py",
    "dtensor/ops/test_pointwise_ops.py",
    "dtensor/ops/test_matrix_ops.py",
    "dtensor/ops/test_random_ops.py",
    "dtensor/hash/test_hash.py",
    "dtensor/meta_device/test_meta_device.py",
    "dtensor/ops/test_sdpa_ops.py",
    "dtensor/ops/test_view_ops.py",
]

REPO = str(Path(__file__).resolve().parent.parent)  # the vescale checkout under test

# (file, regex on the test id) -> why: kernels that exist only for CUDA
CUDA_ONLY: dict[tuple[str, str], str] = {
    ("dtensor/ops/test_sdpa_ops.py", r"memory_effecient"): "memory-efficient SDPA is CUDA-only",
}

RULES = [
    (r"\.cuda\(\)", ""),
    (r"torch\.cuda\.manual_seed_all\(", "torch.manual_seed("),
    (r"torch\.cuda\.manual_seed\(", "torch.manual_seed("),
    (r"torch\.cuda\.initial_seed\(\)", "torch.initial_seed()"),
    (r"f\"cuda:\{self\.rank\}\"", '"cpu"'),
    (r"\"cuda\"", '"cpu"'),
]
# test bodies only: common_dtensor already picks gloo on CPU (and its init_pg tests for "nccl")
TEST_RULES = [*RULES, (r"\"nccl\"", '"gloo"')]

LIFT_GPU_SKIP = """

def skip_unless_torch_gpu(method):  # legacy_suite: adapted to CPU, the GPU-count skip is lifted
    return method
"""

CONFTEST = '''"""legacy_suite: fork rank processes; skip tests that need CUDA-only kernels."""
import re

import pytest
import torch.multiprocessing as mp
from torch.testing._internal.common_distributed import MultiProcessTestCase

MultiProcessTestCase._spawn_processes = lambda self: self._start_processes(
    mp.get_context("fork").Process
)
CUDA_ONLY = %r


def pytest_collection_modifyitems(items):
    for item in items:
        for (path, pattern), why in CUDA_ONLY.items():
            if item.nodeid.startswith(path) and re.search(pattern, item.nodeid):
                item.add_marker(pytest.mark.skip(reason="CUDA-only kernel: " + why))
'''


def adapt(src: str, rules: list[tuple[str, str]] = RULES) -> str:
    """The mechanical CPU/gloo rewrite of one legacy file."""
    for pattern, repl in rules:
        src = re.sub(pattern, repl, src)
    return src


def prepare(legacy: Path, work: Path, files: list[str]) -> None:
    """Copy and adapt ``common_dtensor.py`` and ``files`` into ``work``."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "common_dtensor.py").write_text(
        adapt((legacy / "common_dtensor.py").read_text()) + LIFT_GPU_SKIP
    )
    (work / "conftest.py").write_text(CONFTEST % (CUDA_ONLY,))
    for f in files:
        dst = work / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        for d in Path(f).parents:  # package markers: same-named files import apart
            if str(d) != ".":
                (work / d / "__init__.py").touch()
        dst.write_text(adapt((legacy / f).read_text(), TEST_RULES))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("legacy", type=Path)
    ap.add_argument("files", nargs="*", default=FILES)
    ap.add_argument("--work", type=Path, default=Path("/tmp/legacy_suite"))
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_intermixed_args()
    legacy = args.legacy / "legacy" / "test" if (args.legacy / "legacy").is_dir() else args.legacy
    prepare(legacy, args.work / "tests", args.files)
    logs = args.work / "logs"
    logs.mkdir(exist_ok=True)
    rows, failures = [], []
    totals = [0] * (1 + len(STATUSES))
    for f in args.files:
        name = f.replace("/", "__")[:-3]
        xml, log = logs / f"{name}.xml", logs / f"{name}.log"
        xml.unlink(missing_ok=True)
        log.unlink(missing_ok=True)
        pythonpath = [str(args.work / "tests"), REPO]
        rc = run_pytest(args.work / "tests", [f], xml, log, args.timeout, pythonpath)
        if not xml.exists():
            rows.append(f"| {f} | - | no result (rc={rc}, see {log}) | | | |")
            continue
        v = verdicts(xml)
        c = [len(v)] + [sum(s == k for s, _ in v.values()) for k in STATUSES]
        totals = [a + b for a, b in zip(totals, c)]
        rows.append(f"| {f} | " + " | ".join(map(str, c)) + " |")
        failures += [
            f"FAIL {f}::{t} :: {first_error(m)}"
            for t, (s, m) in v.items()
            if s in ("failed", "error")
        ]
        print(rows[-1], file=sys.stderr, flush=True)
    print("| file | collected | passed | failed | error | skipped |\n|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("| **total** | " + " | ".join(map(str, totals)) + " |\n")
    print("\n".join(failures))


if __name__ == "__main__":
    main()
