"""The hostile member of tests/e2e/hostile_client.py as a `psyche-solana-client` process, for
tests/solana/test_verifiers_e2e.py only (never a command):

    python tests/solana/hostile_solana_client.py ATTACK START -- train <train arguments>

The same hostility (its trainers' results turned by ATTACK, and with `HOSTILE_VERIFIER=1` every
result it verifies accused), with the Solana client's command in place of `psyche-client`.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import psyche.cli.client.main as client_cli
from psyche.cli.solana_client.main import main as solana_client

client_cli.main = solana_client  # hostile_client.py runs `psyche.cli.client.main.main`
runpy.run_path(
    str(Path(__file__).resolve().parents[1] / "e2e" / "hostile_client.py"), run_name="__main__"
)
