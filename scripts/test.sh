#!/usr/bin/env bash
# Test suite: install vescale with its test extras (CPU torch 2.13.0) and run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0 -e '.[test]'
OMP_NUM_THREADS=1 python -m pytest tests "$@"
