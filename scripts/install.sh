#!/usr/bin/env bash
# Install vescale (editable) on torch 2.13 from pip's configured index (PyPI by default):
#   bash scripts/install.sh [test] [dev] [--dry-run]
# no extra: the runtime (what the demo needs); test: the test tools; dev: ruff and mypy.
# An installed torch 2.13.x (CUDA or CPU build) is kept; otherwise torch==2.13.0 is installed
# (PyPI's default build for the platform). VESCALE_TORCH_INDEX adds an index for torch, e.g.
# https://download.pytorch.org/whl/cpu for the CPU build. --dry-run prints the pip command
# instead of running it.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=() dry_run=0
for arg in "$@"; do
  case "$arg" in
    test | dev) extras+=("$arg") ;;
    --dry-run) dry_run=1 ;;
    *) echo "scripts/install.sh: unknown argument '$arg' (use test, dev, --dry-run)" >&2; exit 2 ;;
  esac
done
target=.
if [ ${#extras[@]} -gt 0 ]; then target=".[$(IFS=,; echo "${extras[*]}")]"; fi
installed=$(python -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
torch=()
case "$installed" in
  2.13.*) ;;
  *) torch=(torch==2.13.0) ;;
esac
index=()
if [ -n "${VESCALE_TORCH_INDEX:-}" ]; then index=(--extra-index-url "$VESCALE_TORCH_INDEX"); fi
cmd=(python -m pip install -q "${index[@]}" "${torch[@]}" -e "$target")
if [ "$dry_run" = 1 ]; then echo "${cmd[*]}"; else "${cmd[@]}"; fi
