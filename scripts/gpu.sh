#!/usr/bin/env bash
# Checks and measures everything GPU-only in one command (scripts/gpu.py says what); `--dry-run`
# runs the same steps at tiny sizes on the CPU, as CI does. Uses the checkout's .venv when there is
# one, else the python3 on PATH with the packages' sources on PYTHONPATH (a GPU machine's own torch).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then
    python=.venv/bin/python
else
    python=python3
    src=$(printf '%s:' "$PWD"/packages/*/src)
    export PYTHONPATH="${src%:}${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$python" scripts/gpu.py "$@"
