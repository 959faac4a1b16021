"""What a run, or one user of it, looks like on chain right now: the reads behind
`show`/`json-dump-run` and `json-dump-user` (upstream run-manager), without the printing."""

from __future__ import annotations

from dataclasses import dataclass

from solders.pubkey import Pubkey

from psyche.coordinator import Client
from psyche.solana import pda
from psyche.solana.admin import RunRef, load_run
from psyche.solana.backend import SolanaBackend
from psyche.solana.state import CoordinatorAccount, Participant, SolanaClient
from psyche.solana.treasury import Treasury, find_participant, find_treasury, token_amount
from psyche.solana.verification import RunVerification


@dataclass(frozen=True)
class RunSnapshot:
    run: RunRef
    account: CoordinatorAccount
    treasury: Treasury | None
    verification: RunVerification | None = None
    """The run's verification account (`psyche.solana.verification`), when it has one."""


async def fetch_run(
    backend: SolanaBackend, run_id: str, treasurer_index: int | None = None
) -> RunSnapshot:
    run = await load_run(backend, run_id)
    account = await backend.get_coordinator_account(run.account_address)
    treasury = await find_treasury(backend, run_id, treasurer_index)
    verification = await backend.get_run_verification(run.account_address)
    return RunSnapshot(run, account, treasury, verification)


@dataclass(frozen=True)
class UserTreasury:
    """A user's side of a treasurer run: its collateral balance (0 without a token account)
    and its participant account (None before its first claim)."""

    treasury: Treasury
    collateral_amount: int
    participant: Participant | None


@dataclass(frozen=True)
class UserSnapshot:
    """One address in a run: its SOL, its entry among the run's known clients, its entry in
    the current epoch (alive or exited), and its rewards account on a treasurer run."""

    address: Pubkey
    lamports: int
    client: SolanaClient | None
    epoch_alive: Client | None
    epoch_exited: Client | None
    treasurer: UserTreasury | None


async def fetch_user(
    backend: SolanaBackend, run_id: str, address: Pubkey, treasurer_index: int | None = None
) -> UserSnapshot:
    lamports = await backend.get_balance(address)
    run = await load_run(backend, run_id)
    account = await backend.get_coordinator_account(run.account_address)
    signer = bytes(address)
    epoch = account.state.coordinator.epoch_state
    treasury = await find_treasury(backend, run_id, treasurer_index)
    user_treasury = None
    if treasury is not None:
        held = await token_amount(
            backend, pda.associated_token_address(address, treasury.collateral_mint)
        )
        user_treasury = UserTreasury(
            treasury, held or 0, await find_participant(backend, treasury, address)
        )
    return UserSnapshot(
        address,
        lamports,
        next((c for c in account.state.clients_state.clients if c.id.signer == signer), None),
        next((c for c in epoch.clients if c.id.signer == signer), None),
        next((c for c in epoch.exited_clients if c.id.signer == signer), None),
        user_treasury,
    )
