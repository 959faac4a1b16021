#!/usr/bin/env bash
# One command to set up a development environment: creates .venv with every workspace package
# installed (editable) plus the test and lint tools, and writes the tiny run's dataset.
#
#   scripts/setup.sh            # CPU torch where a local CPU wheel is configured, else PyPI's torch
#
# Needs only Python 3.11+ with pip and venv. uv does the install: the one on PATH when there is
# one, otherwise setup installs it from PyPI into .tools/uv (a virtual environment of its own, so
# nothing outside the checkout changes and no PATH edit is needed). After setup nothing else needs
# uv: the commands live in .venv/bin. A local wheel directory configured for pip is passed to uv
# through uv.toml, which is gitignored, so no machine path lands in a tracked file.
set -euo pipefail
cd "$(dirname "$0")/.."

export UV_PYTHON_DOWNLOADS=never

if ! command -v python3 >/dev/null 2>&1; then
    echo "setup: error: python3 not found; install Python 3.11 or newer" >&2
    exit 1
fi
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup: error: $(python3 --version 2>&1) is too old; Python 3.11 or newer is needed" >&2
    exit 1
fi
# The interpreter itself, not a launcher in front of it (a pyenv shim): uv compares the request
# with the existing .venv and would rebuild it on every run otherwise.
python_bin=$(python3 -c 'import sys; print(sys.executable)')

if command -v uv >/dev/null 2>&1 && uv --version >/dev/null 2>&1; then
    uv=$(command -v uv)
else
    uv=.tools/uv/bin/uv
    if ! "$uv" --version >/dev/null 2>&1; then
        echo "setup: uv is not on PATH; installing it from PyPI into .tools/uv"
        rm -rf .tools/uv
        "$python_bin" -m venv .tools/uv
        .tools/uv/bin/python -m pip install --quiet --disable-pip-version-check uv
    fi
fi
echo "setup: using $("$uv" --version) ($uv)"

# uv does not read pip's configuration. Where pip is configured with a find-links directory
# (for example a local CPU build of torch), hand it to uv so the same wheels are preferred.
find_links=$("$python_bin" -m pip config list 2>/dev/null | sed -n "s/^[a-z:.]*find-links='\(.*\)'$/\1/p" | head -n 1 || true)
find_links=${PIP_FIND_LINKS:-$find_links}
if [ -n "$find_links" ] && [ -d "$find_links" ]; then
    printf 'find-links = ["%s"]\n' "$find_links" > uv.toml
else
    rm -f uv.toml
fi

"$uv" sync --all-packages --python "$python_bin" "$@"
.venv/bin/python scripts/make_tiny_dataset.py  # data/tiny-cpu (skipped when present)
echo "setup: done. Run the tests with ./scripts/test.sh; the commands are in .venv/bin"
echo "       (or run 'source .venv/bin/activate' once per shell and drop the .venv/bin/ prefix)"
