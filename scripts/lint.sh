#!/usr/bin/env bash
# ruff lint and format check (scripts/lint.sh --fix rewrites files instead of checking), and the
# layer rule between packages (import-linter, contracts in pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
if [ "${1:-}" = "--fix" ]; then
    ruff check --fix .
    ruff format .
else
    ruff check .
    ruff format --check .
fi
lint-imports --no-cache
