#!/usr/bin/env bash
# Runs the test suite in the environment made by scripts/setup.sh.
#   scripts/test.sh              # everything that can run here (gpu tests skip without CUDA)
#   scripts/test.sh --fast       # the same without tests marked slow
#   scripts/test.sh tests/core   # any pytest arguments: one plain pytest run
#
# With no pytest arguments the suite runs in two phases: the unit and integration tests spread
# over the machine's cores (pytest-xdist), then the end-to-end tests (marked e2e: servers and
# client processes that need the machine to themselves), one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
export UV_PYTHON_DOWNLOADS=never
markers=()
args=()
for a in "$@"; do
    if [ "$a" = "--fast" ]; then markers+=("not slow"); else args+=("$a"); fi
done

join() { local IFS=' '; local out=""; for m in "$@"; do out="${out:+$out and }($m)"; done; echo "$out"; }

if [ ${#args[@]} -gt 0 ]; then
    selection=$(join "${markers[@]}")
    exec uv run --no-sync pytest ${selection:+-m "$selection"} "${args[@]}"
fi

workers=$(python3 -c 'import os; print(min(4, max(1, len(os.sched_getaffinity(0)))))')
uv run --no-sync pytest -n "$workers" -m "$(join "${markers[@]}" "not e2e")"
status=0
uv run --no-sync pytest -m "$(join "${markers[@]}" "e2e")" || status=$?
# With --fast every end-to-end test may be filtered out (pytest exits 5: nothing ran).
if [ "$status" -eq 5 ] && [ ${#markers[@]} -gt 0 ]; then status=0; fi
exit "$status"
