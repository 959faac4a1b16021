# Recipes wrap the scripts in scripts/; nothing here is needed to use the project.

default:
    @just --list

# Create .venv with every workspace package installed
setup *ARGS:
    ./scripts/setup.sh {{ARGS}}

# Run the test suite (pytest arguments pass through; --fast skips slow tests)
test *ARGS:
    ./scripts/test.sh {{ARGS}}

# ruff lint and format check (`just lint --fix` rewrites)
lint *ARGS:
    ./scripts/lint.sh {{ARGS}}

# Run every benchmark in scripts/bench and print its ratios
bench:
    for script in scripts/bench/*.py; do echo "== $script"; uv run --no-sync python "$script" || exit 1; done

# Validate a run configuration (state file or run config)
validate-config STATE *ARGS:
    uv run --no-sync psyche-server validate-config --state {{STATE}} {{ARGS}}

# What CI runs
ci:
    ./.ci/run
