#!/usr/bin/env bash
# One command to set up a development environment: creates .venv with every workspace package
# installed (editable) plus the test and lint tools.
#
#   scripts/setup.sh            # CPU torch where a local CPU wheel is configured, else PyPI's torch
#
# uv is installed from PyPI if missing. Nothing here writes a machine-specific path into a
# tracked file: a local wheel directory configured for pip is passed to uv through uv.toml,
# which is gitignored.
set -euo pipefail
cd "$(dirname "$0")/.."

export UV_PYTHON_DOWNLOADS=never

if ! command -v uv >/dev/null 2>&1; then
    echo "setup: installing uv from PyPI"
    python3 -m pip install --quiet --user uv
    export PATH="$HOME/.local/bin:$PATH"
fi

# uv does not read pip's configuration. Where pip is configured with a find-links directory
# (for example a local CPU build of torch), hand it to uv so the same wheels are preferred.
find_links=$(python3 -m pip config list 2>/dev/null | sed -n "s/^[a-z:.]*find-links='\(.*\)'$/\1/p" | head -n 1 || true)
find_links=${PIP_FIND_LINKS:-$find_links}
if [ -n "$find_links" ] && [ -d "$find_links" ]; then
    printf 'find-links = ["%s"]\n' "$find_links" > uv.toml
else
    rm -f uv.toml
fi

python_bin=$(command -v python3)
uv sync --all-packages --python "$python_bin" "$@"
uv run --no-sync python scripts/make_tiny_dataset.py  # data/tiny-cpu (skipped when present)
echo "setup: done. Run the tests with scripts/test.sh"
