import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor compiles in the compiling process: no pool of compile subprocesses (each a fresh
# interpreter importing torch) in this process, its children or the pool's ranks (whose
# forkserver inherits this environment), on a machine the ranks already oversubscribe.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# The plan path's calibration cache (vescale/cost/calibration.py) in a folder of this session's
# own, inherited by the worker pools: tests neither read nor leave constants in ~/.cache/vescale.
os.environ.setdefault("VESCALE_CACHE_DIR", tempfile.mkdtemp(prefix="vescale-test-cache-"))
# Every test solves its plan (vescale/plan/cache.py is off): a test's report is its own solve's,
# whichever test placed the same problem first; tests/plan/test_plan_cache.py turns it on.
os.environ.setdefault("VESCALE_PLAN_CACHE", "0")
# The example models (examples/gpt.py, examples/train_demo.py) are test subjects too; worker
# processes inherit this path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import pytest

import vescale  # noqa: F401  (DTensor hooks must be installed before any DTensor op)
from tests.harness import WorkerPool


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the exhaustive sweeps marked @pytest.mark.full (nightly-style); "
        "VESCALE_FULL_SWEEP=1 does the same",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "full: exhaustive sweep, run with --full only")
    config.addinivalue_line("markers", "xdist_group(name): tests pytest-xdist runs in one worker")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistController(), "vescale-xdist-controller")


def full_run(config: pytest.Config) -> bool:
    return bool(config.getoption("--full")) or os.environ.get("VESCALE_FULL_SWEEP") == "1"


POOL_FIXTURES = ("pool2", "pool4")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``full`` are deselected (not skipped) unless ``--full``: the default
    run reports them as deselected, never as passed. Under pytest-xdist (``-n 2 --dist
    loadgroup``, as ``scripts/test.sh`` runs) every test using a worker pool is in one group,
    so one xdist worker owns the session's pools and the other runs the single-process and
    subprocess tests next to it."""
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in POOL_FIXTURES):
            item.add_marker(pytest.mark.xdist_group("pools"))
    if full_run(config):
        return
    full = [item for item in items if item.get_closest_marker("full")]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if not item.get_closest_marker("full")]
    if hasattr(config, "workeroutput"):  # an xdist worker: its controller reports the count
        config.workeroutput["full_deselected"] = len(full)


class _XdistController:
    """Hooks of pytest-xdist's controller, registered only when xdist is loaded (plain pytest,
    or ``-p no:xdist``, rejects an unknown hook): under xdist the summary line has no
    "deselected" (each worker deselects), so the controller collects the workers' counts and
    says it."""

    def __init__(self) -> None:
        self.deselected: list[int] = []

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        self.deselected.append(getattr(node, "workeroutput", {}).get("full_deselected", 0))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.deselected and max(self.deselected):
            terminalreporter.write_line(
                f"{max(self.deselected)} deselected (@pytest.mark.full; run with --full)"
            )


@pytest.fixture(scope="session")
def pool2():
    pool = WorkerPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool4():
    pool = WorkerPool(4)
    yield pool
    pool.close()
