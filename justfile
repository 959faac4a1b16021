# Recipes wrap the scripts in scripts/; nothing here is needed to use the project.

default:
    @just --list

# Create .venv with every workspace package installed
setup *ARGS:
    ./scripts/setup.sh {{ARGS}}

# Run the test suite (pytest arguments pass through; --fast skips slow tests)
test *ARGS:
    ./scripts/test.sh {{ARGS}}

# ruff lint and format check (`just lint --fix` rewrites), the layer rule and mypy
lint *ARGS:
    ./scripts/lint.sh {{ARGS}}

# Run every benchmark in scripts/bench and print its ratios
bench:
    for script in scripts/bench/*.py; do echo "== $script"; .venv/bin/python "$script" || exit 1; done

# Check and measure everything GPU-only on this machine's GPU (`just gpu --dry-run`: tiny, on the CPU)
gpu *ARGS:
    ./scripts/gpu.sh {{ARGS}}

# Train the tiny CPU model with three clients (tmux panes; add --headless for one terminal)
local-testnet *ARGS:
    .venv/bin/python scripts/make_tiny_dataset.py
    .venv/bin/psyche-local-testnet start --num-clients 3 --config-path configs/tiny-cpu {{ARGS}}

# The reliability suite (docs/reliability.md; about 50 minutes): every fault scenario after a
# fault-free baseline, then the 10-minute soak; the long hostile-peer run; the fuzzers at 2000
# examples per target. Arguments go to scripts/chaos/run.py.
chaos *ARGS:
    .venv/bin/python scripts/chaos/run.py --scenarios all --duration 60 --baseline-duration 180 --soak-duration 600 --interval 30 {{ARGS}}
    .venv/bin/python -m pytest tests/chaos -m chaos_long
    PSYCHE_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest tests/fuzz -q

# Validate a run configuration (state file or run config)
validate-config STATE *ARGS:
    .venv/bin/psyche-server validate-config --state {{STATE}} {{ARGS}}

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
    .venv/bin/psyche-solana-client localnet --port {{port}} --fund {{SOLANA_WALLET}} {{args}}

# A run config as a Solana run takes it: a `Server` data location (configs/tiny-cpu's coordinator
# server, which Solana runs have not) becomes Local files, SOLANA_LOCAL_DATA (default data/tiny-cpu,
# written by scripts/make_tiny_dataset.py). Prints the config to use (data/solana/... if rewritten).
# Create, configure and resume a permissionless run on the local endpoint
setup-solana-localnet-test-run run_id="test" config="configs/tiny-cpu/solana.toml" *args='':
    #!/usr/bin/env bash
    set -euo pipefail
    export RPC="${RPC:-http://127.0.0.1:8899}" WS_RPC="${WS_RPC:-ws://127.0.0.1:8900}"
    client=".venv/bin/psyche-solana-client"
    .venv/bin/python scripts/make_tiny_dataset.py
    config="{{config}}"
    $client join-authorization-create -w {{SOLANA_WALLET}} --authorizer 11111111111111111111111111111111
    $client create-run -w {{SOLANA_WALLET}} --run-id {{run_id}} --client-version test {{args}}
    $client update-config -w {{SOLANA_WALLET}} --run-id {{run_id}} --config-path "$config" \
        --num-parameters 1100000000 --vocab-size 32768
    $client set-paused -w {{SOLANA_WALLET}} --run-id {{run_id}} --resume
    $client show --run-id {{run_id}}

# Same, with a run whose members must be authorized by the wallet (join-authorization-create per client)
setup-solana-localnet-permissioned-test-run run_id="test" config="configs/tiny-cpu/solana.toml" *args='':
    #!/usr/bin/env bash
    set -euo pipefail
    export RPC="${RPC:-http://127.0.0.1:8899}" WS_RPC="${WS_RPC:-ws://127.0.0.1:8900}"
    client=".venv/bin/psyche-solana-client"
    .venv/bin/python scripts/make_tiny_dataset.py
    config="{{config}}"
    $client create-run -w {{SOLANA_WALLET}} --run-id {{run_id}} --client-version test {{args}}
    $client update-config -w {{SOLANA_WALLET}} --run-id {{run_id}} --config-path "$config"
    $client set-paused -w {{SOLANA_WALLET}} --run-id {{run_id}} --resume

# As upstream's scripts/train-solana-test.sh: an ephemeral wallet (WALLET_FILE to use yours) funded
# with 10 SOL; clients on this machine find each other through local discovery (across machines:
# IROH_DISCOVERY=n0 BOOTSTRAP_PEERS=<id>@<host>:<port>, the address a client logs at start)
# Join a local run and train (one terminal per client)
start-training-localnet-client run_id="test" *args='':
    #!/usr/bin/env bash
    set -euo pipefail
    export RPC="${RPC:-http://127.0.0.1:8899}" WS_RPC="${WS_RPC:-ws://127.0.0.1:8900}"
    client=".venv/bin/psyche-solana-client"
    wallet="${WALLET_FILE:-}"
    if [ -z "$wallet" ]; then
        keys=$(mktemp -d)
        trap 'rm -rf "$keys"' EXIT
        wallet="$keys/wallet.json"
        $client create-wallet "$wallet"
    fi
    $client airdrop -w "$wallet" --sol 10 || true
    $client train -w "$wallet" --run-id {{run_id}} \
        --authorizer "${AUTHORIZER:-11111111111111111111111111111111}" \
        --iroh-discovery "${IROH_DISCOVERY:-local}" --logs console {{args}}

# Print a run's decoded on-chain state (local endpoint unless RPC is set)
show-solana-run run_id="test" *args='':
    .venv/bin/psyche-solana-client show --run-id {{run_id}} {{args}}

# Set up a permissionless run on devnet (programs deployed by you: set the PSYCHE_*_PROGRAM_ID)
setup-solana-devnet-test-run run_id="test" config="configs/tiny-cpu/solana.toml" *args='':
    RPC={{DEVNET_RPC}} WS_RPC={{DEVNET_WS_RPC}} just setup-solana-localnet-test-run {{run_id}} {{config}} {{args}}

# BOOTSTRAP_PEERS: a run member's <id>@<host>:<port>, the address it logs at start
# Join a devnet run and train
start-training-devnet-client run_id="test" *args='':
    RPC={{DEVNET_RPC}} WS_RPC={{DEVNET_WS_RPC}} IROH_DISCOVERY="${IROH_DISCOVERY:-n0}" \
        just start-training-localnet-client {{run_id}} {{args}}
