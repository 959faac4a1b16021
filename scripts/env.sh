# Sourced by test.sh and lint.sh: puts the environment made by scripts/setup.sh first on PATH,
# as `source .venv/bin/activate` would, so no other tool (uv included) is needed to use it.
if [ ! -x .venv/bin/python ]; then
    echo "$(basename "$0"): error: no .venv here; run ./scripts/setup.sh first" >&2
    exit 1
fi
export VIRTUAL_ENV="$PWD/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
unset PYTHONHOME
