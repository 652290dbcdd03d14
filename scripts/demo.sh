#!/usr/bin/env bash
# Main job: install vescale (on torch 2.13) and train the GPT demo (dp x tp, backend=vescale) on 4
# ranks: CUDA + NCCL when 4 GPUs are present, else CPU + gloo (examples/train_demo.py --device).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh  # the runtime only: torch 2.13 and vescale's dependencies
OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 4 \
  examples/train_demo.py "$@"
