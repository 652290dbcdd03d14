#!/usr/bin/env bash
# Test suite: install vescale with its test extras (torch 2.13) and run pytest in two
# pytest-xdist workers: one owns the worker pools (every test using pool2/pool4, grouped by
# tests/conftest.py), the other runs the single-process and subprocess tests alongside.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
OMP_NUM_THREADS=1 python -m pytest tests -n 2 --dist loadgroup -p no:benchmark "$@"
