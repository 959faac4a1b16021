"""Program-derived addresses of the Psyche programs' accounts, and the treasurer's run index."""

from __future__ import annotations

import hashlib
from typing import Any

from solders.pubkey import Pubkey

from psyche.solana.program_ids import (
    ASSOCIATED_TOKEN_PROGRAM_ID,
    DEFAULT_PROGRAM_IDS,
    TOKEN_PROGRAM_ID,
    ProgramIds,
)
from psyche.solana.pubkey import to_solders
from psyche.solana.state import (
    JOIN_RUN_AUTHORIZATION_SCOPE,
    Authorization,
    CoordinatorInstance,
    Participant,
    TreasurerRun,
)

SOLANA_MAX_STRING_LEN = 64
MAX_SEED_LEN = 32


def _check_seeds(seeds: list[bytes], what: str) -> list[bytes]:
    for seed in seeds:
        if len(seed) > MAX_SEED_LEN:
            raise ValueError(
                f"{what}: a PDA seed is at most {MAX_SEED_LEN} bytes, got {len(seed)} "
                f"({seed[:40]!r})"
            )
    return seeds


def bytes_from_string(text: str) -> bytes:
    """The seed bytes of a run id: its first 64 UTF-8 bytes (upstream `bytes_from_string`)."""
    return text.encode("utf-8")[:SOLANA_MAX_STRING_LEN]


def find_coordinator_instance_with_bump(
    run_id: str, ids: ProgramIds = DEFAULT_PROGRAM_IDS
) -> tuple[Pubkey, int]:
    seeds = [CoordinatorInstance.SEEDS_PREFIX, bytes_from_string(run_id)]
    return Pubkey.find_program_address(
        _check_seeds(seeds, f"run_id {run_id!r} (run ids are 32 bytes or less)"),
        ids.coordinator_key,
    )


def find_coordinator_instance(run_id: str, ids: ProgramIds = DEFAULT_PROGRAM_IDS) -> Pubkey:
    """The run's `CoordinatorInstance` PDA; ValueError for a run id over 32 bytes."""
    return find_coordinator_instance_with_bump(run_id, ids)[0]


def find_run_verification(
    coordinator_account: Any, ids: ProgramIds = DEFAULT_PROGRAM_IDS
) -> Pubkey:
    """The run's verification account (`psyche.solana.verification`, beyond upstream):
    `["verification", coordinator_account]` of the coordinator program."""
    from psyche.solana.verification import RunVerification

    seeds = [RunVerification.SEEDS_PREFIX, bytes(to_solders(coordinator_account))]
    return Pubkey.find_program_address(seeds, ids.coordinator_key)[0]


def find_authorization(
    grantor: Any, grantee: Any, scope: bytes, ids: ProgramIds = DEFAULT_PROGRAM_IDS
) -> Pubkey:
    seeds = [Authorization.SEEDS_PREFIX, bytes(to_solders(grantor)), bytes(to_solders(grantee))]
    return Pubkey.find_program_address(
        _check_seeds([*seeds, bytes(scope)], "authorization scope"), ids.authorizer_key
    )[0]


def find_join_authorization(
    join_authority: Any, authorizer: Any | None = None, ids: ProgramIds = DEFAULT_PROGRAM_IDS
) -> Pubkey:
    """The authorization a client joins with: granted by the run's join authority to
    `authorizer`, or to everyone (the system program id) for a permissionless run."""
    grantee = to_solders(authorizer) if authorizer is not None else Pubkey.default()
    return find_authorization(join_authority, grantee, JOIN_RUN_AUTHORIZATION_SCOPE, ids)


def find_run(index: int, ids: ProgramIds = DEFAULT_PROGRAM_IDS) -> Pubkey:
    return Pubkey.find_program_address(
        [TreasurerRun.SEEDS_PREFIX, index.to_bytes(8, "little")], ids.treasurer_key
    )[0]


def find_participant(run: Any, user: Any, ids: ProgramIds = DEFAULT_PROGRAM_IDS) -> Pubkey:
    return Pubkey.find_program_address(
        [Participant.SEEDS_PREFIX, bytes(to_solders(run)), bytes(to_solders(user))],
        ids.treasurer_key,
    )[0]


def associated_token_address(owner: Any, mint: Any) -> Pubkey:
    return Pubkey.find_program_address(
        [
            bytes(to_solders(owner)),
            bytes(Pubkey.from_string(TOKEN_PROGRAM_ID)),
            bytes(to_solders(mint)),
        ],
        Pubkey.from_string(ASSOCIATED_TOKEN_PROGRAM_ID),
    )[0]


def compute_deterministic_treasurer_index(run_id: str, treasurer_index: int | None = None) -> int:
    """The treasurer run index: the given one, else the first 8 bytes of sha256(run_id) (LE)."""
    if treasurer_index is not None:
        return treasurer_index
    return int.from_bytes(hashlib.sha256(run_id.encode("utf-8")).digest()[:8], "little")
