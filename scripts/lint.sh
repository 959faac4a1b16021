#!/usr/bin/env bash
# ruff lint and format check (scripts/lint.sh --fix rewrites files instead of checking), the
# layer rule between packages (import-linter, contracts in pyproject.toml), and the type checker
# over every package (mypy, configured in pyproject.toml; its cache is .mypy_cache, so a run
# after the first checks only what changed).
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
mypy
