#!/usr/bin/env bash
# One command to set up a development environment: creates .venv with every workspace package
# installed (editable) plus the test and lint tools, exactly as uv.lock pins them, and writes the
# tiny run's dataset.
#
#   scripts/setup.sh            # the lock; torch from a local wheel of its version where pip has one
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
# The uv that wrote uv.lock, installed when none is on PATH (a newer one reads the lock too).
uv_version=0.13.9

if command -v uv >/dev/null 2>&1 && uv --version >/dev/null 2>&1; then
    uv=$(command -v uv)
else
    uv=.tools/uv/bin/uv
    if [ "$("$uv" --version 2>/dev/null | cut -d' ' -f2)" != "$uv_version" ]; then
        echo "setup: uv is not on PATH; installing it from PyPI into .tools/uv"
        rm -rf .tools/uv
        "$python_bin" -m venv .tools/uv
        .tools/uv/bin/python -m pip install --quiet --disable-pip-version-check "uv==$uv_version"
    fi
fi
echo "setup: using $("$uv" --version) ($uv)"

# Everything is installed exactly as uv.lock pins it (`--locked`: setup stops if the lock is out of
# date with the pyproject files, rather than resolving afresh). One exception, for machines whose
# pip is configured with a local wheel directory holding the locked torch version built for this
# Python (a CPU build): that wheel replaces PyPI's build, and the CUDA libraries only PyPI's
# Linux build needs are left out (scripts/local_torch.py says which). uv does not read pip's
# configuration, so setup reads it here.
find_links=$("$python_bin" -m pip config list 2>/dev/null | sed -n "s/^[a-z:.]*find-links='\(.*\)'$/\1/p" | head -n 1 || true)
find_links=${PIP_FIND_LINKS:-$find_links}
rm -f uv.toml  # written by earlier versions of this script
skip=""
if [ -n "$find_links" ] && [ -d "$find_links" ]; then
    skip=$("$python_bin" scripts/local_torch.py uv.lock "$find_links")
fi
no_install=()
for package in $skip; do no_install+=(--no-install-package "$package"); done
"$uv" sync --all-packages --locked --python "$python_bin" "${no_install[@]}" "$@"
if [ -n "$skip" ]; then
    torch_version=$("$python_bin" -c 'import sys, tomllib; print(next(p["version"] for p in tomllib.load(open("uv.lock", "rb"))["package"] if p["name"] == "torch"))')
    echo "setup: torch $torch_version from $find_links (the locked version; pip's local wheels)"
    "$uv" pip install --quiet --python .venv/bin/python --no-deps --no-index \
        --find-links "$find_links" "torch==$torch_version"
fi
.venv/bin/python scripts/make_tiny_dataset.py  # data/tiny-cpu (skipped when present)
echo "setup: done. Run the tests with ./scripts/test.sh; the commands are in .venv/bin"
echo "       (or run 'source .venv/bin/activate' once per shell and drop the .venv/bin/ prefix)"
