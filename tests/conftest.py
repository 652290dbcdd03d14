import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

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
