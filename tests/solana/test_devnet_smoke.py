"""Opt-in, read-only smoke test against a real cluster (devnet): decode a live run.

Set PSYCHE_SOLANA_DEVNET_RUN_ID (and optionally PSYCHE_SOLANA_DEVNET_RPC, default
https://api.devnet.solana.com, and the PSYCHE_*_PROGRAM_ID overrides of the deployment) to run
it. CI leaves it unset, so it is skipped there; nothing is signed or sent.
"""

from __future__ import annotations

import os

import pytest
import trio
from solders.keypair import Keypair

from psyche.solana import snapshots
from psyche.solana.backend import DEVNET_RPC, DEVNET_WS_RPC, Cluster, SolanaBackend
from psyche.solana.program_ids import ProgramIds

RUN_ID = os.environ.get("PSYCHE_SOLANA_DEVNET_RUN_ID")


@pytest.mark.skipif(not RUN_ID, reason="set PSYCHE_SOLANA_DEVNET_RUN_ID to query devnet")
def test_show_a_devnet_run() -> None:
    rpc = os.environ.get("PSYCHE_SOLANA_DEVNET_RPC", DEVNET_RPC)
    ws = os.environ.get("PSYCHE_SOLANA_DEVNET_WS_RPC", DEVNET_WS_RPC)
    assert RUN_ID is not None

    async def main() -> None:
        async with SolanaBackend(Cluster(rpc, ws), Keypair(), ids=ProgramIds.from_env()) as backend:
            snapshot = await snapshots.fetch_run(backend, RUN_ID)
        account = snapshot.account
        assert account.version == 1
        assert account.state.coordinator.run_id == RUN_ID
        assert snapshot.run.account_address is not None

    trio.run(main)
