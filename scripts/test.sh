#!/usr/bin/env bash
# Runs the test suite in the environment made by scripts/setup.sh.
#   scripts/test.sh              # everything that can run here (gpu tests skip without CUDA)
#   scripts/test.sh --fast       # skip tests marked slow
#   scripts/test.sh tests/core   # any pytest arguments
set -euo pipefail
cd "$(dirname "$0")/.."
export UV_PYTHON_DOWNLOADS=never
args=()
for a in "$@"; do
    if [ "$a" = "--fast" ]; then args+=("-m" "not slow"); else args+=("$a"); fi
done
exec uv run --no-sync pytest "${args[@]}"
