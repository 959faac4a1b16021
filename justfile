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

# Train the tiny CPU model with three clients (tmux panes; add --headless for one terminal)
local-testnet *ARGS:
    uv run --no-sync python scripts/make_tiny_dataset.py
    uv run --no-sync psyche-local-testnet start --num-clients 3 --config-path configs/tiny-cpu {{ARGS}}

# Validate a run configuration (state file or run config)
validate-config STATE *ARGS:
    uv run --no-sync psyche-server validate-config --state {{STATE}} {{ARGS}}

# What CI runs
ci:
    ./.ci/run

# ---- Solana (psyche-solana): recipes like upstream's architectures/decentralized/justfile ----
# A local endpoint replaces solana-test-validator: the Psyche programs run as their Python ports
# (see docs/solana.md). Start it in one terminal, set up a run in another.

SOLANA_WALLET := env_var_or_default("WALLET_PRIVATE_KEY_PATH", env_var_or_default("HOME", ".") + "/.config/solana/id.json")
DEVNET_RPC := "https://api.devnet.solana.com"
DEVNET_WS_RPC := "wss://api.devnet.solana.com"

# Serve a local Solana endpoint on 8899/8900, funding the wallet (created if missing)
solana-localnet port="8899" *args='':
    uv run --no-sync psyche-solana-client localnet --port {{port}} --fund {{SOLANA_WALLET}} {{args}}

# Create, configure and resume a permissionless run on the local endpoint
setup-solana-localnet-test-run run_id="test" config="configs/tiny-cpu/state.toml" *args='':
    #!/usr/bin/env bash
    set -euo pipefail
    export RPC="${RPC:-http://127.0.0.1:8899}" WS_RPC="${WS_RPC:-ws://127.0.0.1:8900}"
    client="uv run --no-sync psyche-solana-client"
    $client join-authorization-create -w {{SOLANA_WALLET}} --authorizer 11111111111111111111111111111111
    $client create-run -w {{SOLANA_WALLET}} --run-id {{run_id}} --client-version test {{args}}
    $client update-config -w {{SOLANA_WALLET}} --run-id {{run_id}} --config-path {{config}} \
        --num-parameters 1100000000 --vocab-size 32768
    $client set-paused -w {{SOLANA_WALLET}} --run-id {{run_id}} --resume
    $client show --run-id {{run_id}}

# Same, with a run whose members must be authorized by the wallet (join-authorization-create per client)
setup-solana-localnet-permissioned-test-run run_id="test" config="configs/tiny-cpu/state.toml" *args='':
    #!/usr/bin/env bash
    set -euo pipefail
    export RPC="${RPC:-http://127.0.0.1:8899}" WS_RPC="${WS_RPC:-ws://127.0.0.1:8900}"
    client="uv run --no-sync psyche-solana-client"
    $client create-run -w {{SOLANA_WALLET}} --run-id {{run_id}} --client-version test {{args}}
    $client update-config -w {{SOLANA_WALLET}} --run-id {{run_id}} --config-path {{config}}
    $client set-paused -w {{SOLANA_WALLET}} --run-id {{run_id}} --resume

# Join a local run and train (needs the training client, psyche.client)
start-training-localnet-client run_id="test" *args='':
    RPC="${RPC:-http://127.0.0.1:8899}" WS_RPC="${WS_RPC:-ws://127.0.0.1:8900}" \
        uv run --no-sync psyche-solana-client train -w {{SOLANA_WALLET}} --run-id {{run_id}} \
        --authorizer "${AUTHORIZER:-11111111111111111111111111111111}" {{args}}

# Print a run's decoded on-chain state (local endpoint unless RPC is set)
show-solana-run run_id="test" *args='':
    uv run --no-sync psyche-solana-client show --run-id {{run_id}} {{args}}

# Set up a permissionless run on devnet (programs deployed by you: set the PSYCHE_*_PROGRAM_ID)
setup-solana-devnet-test-run run_id="test" config="configs/tiny-cpu/state.toml" *args='':
    RPC={{DEVNET_RPC}} WS_RPC={{DEVNET_WS_RPC}} just setup-solana-localnet-test-run {{run_id}} {{config}} {{args}}

# Join a devnet run and train
start-training-devnet-client run_id="test" *args='':
    RPC={{DEVNET_RPC}} WS_RPC={{DEVNET_WS_RPC}} just start-training-localnet-client {{run_id}} {{args}}
