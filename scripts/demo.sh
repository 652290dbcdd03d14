#!/usr/bin/env bash
# Main job: install vescale (CPU torch 2.13.0) and train the GPT demo (dp x tp, backend=vescale) on 4 CPU ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0 -e '.[test]'
OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 4 \
  examples/train_demo.py "$@"
