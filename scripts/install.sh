#!/usr/bin/env bash
# Install vescale (editable) on the CPU build of torch 2.13.0: `bash scripts/install.sh` for the
# runtime (what the demo needs), `bash scripts/install.sh test` for the test tools too.
# The torch pin names the CPU build (2.13.0+cpu), so pip never falls back to PyPI's default
# CUDA wheel: it comes from pip's configured index or find-links, or from the index in
# VESCALE_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu) when that is set.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") target=. ;;
  test) target='.[test]' ;;
  *) echo "scripts/install.sh: unknown extra '$1' (use no argument, or 'test')" >&2; exit 2 ;;
esac
index=()
if [ -n "${VESCALE_TORCH_INDEX:-}" ]; then index=(--extra-index-url "$VESCALE_TORCH_INDEX"); fi
python -m pip install -q "${index[@]}" 'torch==2.13.0+cpu' -e "$target"
