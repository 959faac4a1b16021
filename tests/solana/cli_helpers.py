"""What the `psyche-solana-client` command tests share: funded wallets, running the command
in-process, and a run config (upstream's `config/solana-test`). Their fixtures (`net`: a local
endpoint in a thread, `clean_env`) are in conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from solders.keypair import Keypair

from psyche.cli.solana_client.main import main
from psyche.solana.keypair import write_keypair_file
from psyche.solana.localnet.server import LocalnetThread

EVERYONE = "11111111111111111111111111111111"

RUN_CONFIG = """
[config]
warmup_time = 15
cooldown_time = 30
epoch_time = 60
max_round_train_time = 15
round_witness_time = 1
min_clients = 1
init_min_clients = 1
verification_percent = 0
witness_nodes = 0
global_batch_size_start = 2048
global_batch_size_end = 2048
global_batch_size_warmup_tokens = 0
total_steps = 25000
waiting_for_members_extra_time = 3

[model.LLM]
architecture = "HfLlama"
data_type = "Pretraining"
max_seq_len = 2048
cold_start_warmup_steps = 0

[model.LLM.checkpoint.Hub]
repo_id = "emozilla/llama2-1.1b-gqa-init"

[model.LLM.data_location.Http]
token_size_in_bytes = "TwoBytes"
shuffle = "DontShuffle"

[model.LLM.data_location.Http.location.Gcp]
bucket_name = "nous-pretraining-public-us"
filter_directory = "fineweb-edu-tokenized-llama2"

[model.LLM.lr_schedule.Cosine]
base_lr = 4.0e-4
warmup_steps = 250
warmup_init_lr = 0.0
total_steps = 25000
final_lr = 4.0e-5

[model.LLM.optimizer.Distro]
clip_grad_norm = 1.0
compression_decay = 0.999
compression_chunk = 64
compression_topk = 2
quantize_1bit = false
"""


def funded_wallet(net: LocalnetThread, path: Path) -> Keypair:
    """A new keypair file at `path` holding 100 SOL."""
    keypair = Keypair()
    write_keypair_file(keypair, path)
    net.ledger.airdrop(keypair.pubkey(), 100 * 10**9)
    return keypair


def run_cli(
    capsys: pytest.CaptureFixture[str], net: LocalnetThread, *args: str, wallet: Path | None = None
) -> tuple[int, str, str]:
    """`psyche-solana-client COMMAND --rpc .. --ws-rpc .. ARGS [-w wallet]`: (exit code,
    stdout, stderr)."""
    argv = [args[0], "--rpc", net.rpc_url, "--ws-rpc", net.ws_url, *args[1:]]
    if wallet is not None:
        argv += ["--wallet-private-key-path", str(wallet)]
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def ok(
    capsys: pytest.CaptureFixture[str], net: LocalnetThread, *args: str, wallet: Path | None = None
) -> str:
    """`run_cli` that must succeed; its stdout."""
    code, out, err = run_cli(capsys, net, *args, wallet=wallet)
    assert code == 0, err
    return out
