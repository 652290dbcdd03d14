import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The example models (examples/gpt.py, examples/train_demo.py) are test subjects too; worker
# processes inherit this path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import pytest

import vescale  # noqa: F401  (DTensor hooks must be installed before any DTensor op)
from tests.harness import WorkerPool


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
