"""The two SPL instructions the treasurer commands send besides the Psyche programs' (upstream
takes them from `anchor_spl`): creating a wallet's associated token account if it has none, and
a token transfer. They are not Anchor instructions (no discriminator), so they are not in the
registry of `psyche.solana.instructions`."""

from __future__ import annotations

import struct
from typing import Any

from solders.instruction import AccountMeta, Instruction
from solders.pubkey import Pubkey

from psyche.solana import pda
from psyche.solana.program_ids import (
    ASSOCIATED_TOKEN_PROGRAM_ID,
    SYSTEM_PROGRAM_ID,
    TOKEN_PROGRAM_ID,
)
from psyche.solana.pubkey import to_solders

# The associated token program's `CreateIdempotent` and the token program's `Transfer` tags.
_CREATE_IDEMPOTENT = 1
_TRANSFER = 3


def create_associated_token_account_idempotent(payer: Any, owner: Any, mint: Any) -> Instruction:
    """`owner`'s token account for `mint` at its canonical address, paid by `payer`; a no-op
    when it exists already (`spl_associated_token_account::create_associated_token_account_idempotent`)."""
    return Instruction(
        Pubkey.from_string(ASSOCIATED_TOKEN_PROGRAM_ID),
        bytes([_CREATE_IDEMPOTENT]),
        [
            AccountMeta(to_solders(payer), is_signer=True, is_writable=True),
            AccountMeta(pda.associated_token_address(owner, mint), False, True),
            AccountMeta(to_solders(owner), False, False),
            AccountMeta(to_solders(mint), False, False),
            AccountMeta(Pubkey.from_string(SYSTEM_PROGRAM_ID), False, False),
            AccountMeta(Pubkey.from_string(TOKEN_PROGRAM_ID), False, False),
        ],
    )


def transfer(source: Any, destination: Any, owner: Any, amount: int) -> Instruction:
    """Move `amount` base units from the token account `source` to `destination`, signed by
    `source`'s owner (`spl_token::instruction::transfer`, no multisig)."""
    return Instruction(
        Pubkey.from_string(TOKEN_PROGRAM_ID),
        struct.pack("<BQ", _TRANSFER, amount),
        [
            AccountMeta(to_solders(source), False, True),
            AccountMeta(to_solders(destination), False, True),
            AccountMeta(to_solders(owner), True, False),
        ],
    )
