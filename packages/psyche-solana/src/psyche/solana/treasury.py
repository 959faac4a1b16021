"""A treasurer run's rewards: reading its collateral vault, topping it up, and a participant
claiming what it earned (upstream run-manager `treasurer-top-up-rewards` and
`treasurer-claim-rewards`), without the printing.

Earned points and collateral map 1:1 (upstream's rule): a client that earned N points may take
N base units of the collateral mint, as far as the vault holds them. Every step reads first, so
what the command prints before sending is what the transaction will do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from solders.pubkey import Pubkey
from solders.signature import Signature

from psyche.solana import pda
from psyche.solana.admin import AdminError, check_run_id
from psyche.solana.backend import SolanaBackend, SolanaBackendError
from psyche.solana.instructions import token as token_ix
from psyche.solana.instructions import treasurer as treasurer_ix
from psyche.solana.rpc import AccountNotFound
from psyche.solana.state import Participant, SolanaClient, TreasurerRun


@dataclass(frozen=True)
class Treasury:
    """A treasurer run and its collateral vault (the run PDA's associated token account)."""

    index: int
    address: Pubkey
    run: TreasurerRun
    collateral_mint: Pubkey
    decimals: int
    collateral_address: Pubkey
    collateral_amount: int

    @property
    def coordinator_account(self) -> Pubkey:
        return Pubkey.from_bytes(self.run.coordinator_account)


async def find_treasury(
    backend: SolanaBackend, run_id: str, treasurer_index: int | None = None
) -> Treasury | None:
    """The run's treasurer run (at `treasurer_index`, else at the index derived from the run
    id), or None when the run has no treasurer."""
    check_run_id(run_id)
    index = await backend.resolve_treasurer_index(run_id, treasurer_index)
    if index is None:
        return None
    address = pda.find_run(index, backend.ids)
    run = await backend.get_treasurer_run(address)
    mint = Pubkey.from_bytes(run.collateral_mint)
    decimals = (await backend.get_token_mint(mint)).decimals
    vault = pda.associated_token_address(address, mint)
    amount = (await backend.get_token_account(vault)).amount
    return Treasury(index, address, run, mint, decimals, vault, amount)


async def load_treasury(
    backend: SolanaBackend, run_id: str, treasurer_index: int | None = None
) -> Treasury:
    """`find_treasury`, for commands that need one: AdminError when there is none."""
    treasury = await find_treasury(backend, run_id, treasurer_index)
    if treasury is None:
        index = pda.compute_deterministic_treasurer_index(run_id, treasurer_index)
        raise AdminError(
            f"Failed to resolve treasurer: run {run_id!r} has no treasurer run at index "
            f"0x{index:08x} (treasurer program {backend.ids.treasurer}; pass --treasurer-index "
            "if it was created with one)"
        )
    return treasury


async def token_amount(backend: SolanaBackend, address: Pubkey) -> int | None:
    """The balance of a token account, None when it does not exist."""
    try:
        return (await backend.get_token_account(address)).amount
    except SolanaBackendError as e:
        if isinstance(e.cause, AccountNotFound):
            return None
        raise


async def find_participant(
    backend: SolanaBackend, treasury: Treasury, user: Pubkey
) -> Participant | None:
    try:
        return await backend.get_treasurer_participant(
            pda.find_participant(treasury.address, user, backend.ids)
        )
    except SolanaBackendError as e:
        if isinstance(e.cause, AccountNotFound):
            return None
        raise


def earned_points(clients: Sequence[SolanaClient], user: Pubkey) -> int:
    """What the treasurer pays `user` for in the run (`SolanaClient.claimable`; 0 when it
    never joined)."""
    signer = bytes(user)
    return next((c.claimable() for c in clients if c.id.signer == signer), 0)


# ---------------------------------------------------------------------------------------------
# Top up


@dataclass(frozen=True)
class TopUp:
    """A transfer from the wallet's collateral account into the vault, checked, not yet sent."""

    user: Pubkey
    user_collateral_address: Pubkey
    user_collateral_amount: int
    amount: int


async def prepare_top_up(backend: SolanaBackend, treasury: Treasury, amount: int) -> TopUp:
    """Check that the wallet holds `amount` base units of the collateral mint."""
    user = backend.get_payer()
    address = pda.associated_token_address(user, treasury.collateral_mint)
    held = await token_amount(backend, address)
    if held is None:
        raise AdminError(
            f"wallet {user} has no token account for the collateral mint "
            f"{treasury.collateral_mint} (expected at {address})"
        )
    if amount > held:
        raise AdminError(
            f"wallet {user} holds {held} base units of {treasury.collateral_mint}, "
            f"cannot top up {amount}"
        )
    return TopUp(user, address, held, amount)


async def top_up(backend: SolanaBackend, treasury: Treasury, plan: TopUp) -> Signature:
    return await backend.send_and_retry(
        "Top-up rewards",
        [
            token_ix.transfer(
                plan.user_collateral_address, treasury.collateral_address, plan.user, plan.amount
            )
        ],
    )


# ---------------------------------------------------------------------------------------------
# Claim


@dataclass(frozen=True)
class Claim:
    """What a participant may claim now; the accounts the claim needs exist."""

    user: Pubkey
    created_user_collateral: Signature | None
    user_collateral_amount: int
    created_participant: Signature | None
    earned_points: int
    claimed_earned_points: int

    @property
    def claimable_earned_points(self) -> int:
        return max(0, self.earned_points - self.claimed_earned_points)

    def claim_amount(self, vault_amount: int) -> int:
        """Points (= collateral base units) to claim: what is owed, as far as the vault holds."""
        return min(self.claimable_earned_points, vault_amount)


async def prepare_claim(backend: SolanaBackend, treasury: Treasury) -> Claim:
    """Create the wallet's collateral account and its participant account if missing (as
    upstream, each in its own transaction), and read what it earned and already claimed."""
    user = backend.get_payer()
    user_collateral = pda.associated_token_address(user, treasury.collateral_mint)
    created_ata = await backend.create_if_missing(
        "Create user ATA",
        user_collateral,
        token_ix.create_associated_token_account_idempotent(user, user, treasury.collateral_mint),
    )
    user_amount = (await backend.get_token_account(user_collateral)).amount
    participant_address = pda.find_participant(treasury.address, user, backend.ids)
    created_participant = await backend.create_if_missing(
        "Create participant PDA",
        participant_address,
        treasurer_ix.treasurer_participant_create(user, treasury.index, user, backend.ids),
    )
    account = await backend.get_coordinator_account(treasury.coordinator_account)
    participant = await backend.get_treasurer_participant(participant_address)
    return Claim(
        user,
        created_ata,
        user_amount,
        created_participant,
        earned_points(account.state.clients_state.clients, user),
        participant.claimed_earned_points,
    )


async def claim(backend: SolanaBackend, treasury: Treasury, amount: int) -> Signature:
    return await backend.send_and_retry(
        "Claim rewards",
        [
            treasurer_ix.treasurer_participant_claim(
                treasury.index,
                treasury.collateral_mint,
                treasury.coordinator_account,
                backend.get_payer(),
                amount,
                backend.ids,
            )
        ],
    )
