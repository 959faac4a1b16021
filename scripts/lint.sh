#!/usr/bin/env bash
# ruff lint and format check (scripts/lint.sh --fix rewrites files instead of checking).
set -euo pipefail
cd "$(dirname "$0")/.."
export UV_PYTHON_DOWNLOADS=never
if [ "${1:-}" = "--fix" ]; then
    uv run --no-sync ruff check --fix .
    uv run --no-sync ruff format .
else
    uv run --no-sync ruff check .
    uv run --no-sync ruff format --check .
fi
