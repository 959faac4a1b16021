"""The shell every program's instructions share: an `InstructionSpec` is one upstream
instruction: its snake_case name (which gives the Anchor discriminator), its accounts in the
order and with the flags of upstream's `#[derive(Accounts)]` struct, and a struct whose fields
are the instruction's arguments in declaration order (borsh encodes them back to back, which is
exactly how Anchor lays out several arguments).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from solders.instruction import AccountMeta, Instruction

from psyche.solana import pda
from psyche.solana.anchor import DISCRIMINATOR_LEN, instruction_discriminator
from psyche.solana.borsh import BorshError, take_borsh, to_borsh
from psyche.solana.program_ids import (
    ASSOCIATED_TOKEN_PROGRAM_ID,
    SYSTEM_PROGRAM_ID,
    TOKEN_PROGRAM_ID,
    ProgramIds,
)
from psyche.solana.pubkey import to_solders


@dataclass(frozen=True)
class AccountSpec:
    name: str
    writable: bool = False
    signer: bool = False


def writable(name: str) -> AccountSpec:
    return AccountSpec(name, writable=True)


def signer(name: str) -> AccountSpec:
    return AccountSpec(name, signer=True)


def writable_signer(name: str) -> AccountSpec:
    return AccountSpec(name, writable=True, signer=True)


def readonly(name: str) -> AccountSpec:
    return AccountSpec(name)


class InstructionDecodeError(ValueError):
    """Instruction data that is not a valid call of the expected instruction."""


@dataclass(frozen=True)
class InstructionSpec:
    program: str  # "coordinator", "authorizer" or "treasurer"
    name: str
    accounts: tuple[AccountSpec, ...]
    args: type[Any]

    @property
    def discriminator(self) -> bytes:
        return instruction_discriminator(self.name)

    def encode(self, args: Any) -> bytes:
        if not isinstance(args, self.args):
            raise TypeError(f"{self.name} takes {self.args.__name__}, got {type(args).__name__}")
        return self.discriminator + to_borsh(args, self.args)

    def decode(self, data: bytes) -> Any:
        """The arguments of an instruction's data (Anchor ignores trailing bytes; so do we)."""
        if bytes(data[:DISCRIMINATOR_LEN]) != self.discriminator:
            raise InstructionDecodeError(f"not a {self.name} instruction")
        try:
            value, _ = take_borsh(memoryview(data)[DISCRIMINATOR_LEN:], self.args)
        except BorshError as e:
            raise InstructionDecodeError(f"{self.name}: {e}") from e
        return value

    def metas(self, accounts: Mapping[str, Any]) -> list[AccountMeta]:
        missing = [a.name for a in self.accounts if a.name not in accounts]
        extra = set(accounts) - {a.name for a in self.accounts}
        if missing or extra:
            raise ValueError(f"{self.name}: missing accounts {missing}, unknown {sorted(extra)}")
        return [
            AccountMeta(to_solders(accounts[a.name]), is_signer=a.signer, is_writable=a.writable)
            for a in self.accounts
        ]

    def build(self, program_id: Any, accounts: Mapping[str, Any], args: Any) -> Instruction:
        return Instruction(to_solders(program_id), self.encode(args), self.metas(accounts))

    def call(self, ids: ProgramIds, accounts: Mapping[str, Any], args: Any) -> Instruction:
        """This instruction of its program as `ids` deploys it, with the program accounts it
        names (system, token, associated token, coordinator) and the run's `verification`
        account (the PDA of its `coordinator_account`) filled in: `accounts` gives the others."""
        names = {a.name for a in self.accounts}
        known = {k: v for k, v in program_accounts(ids).items() if k in names}
        if "verification" in names and "coordinator_account" in accounts:
            known["verification"] = pda.find_run_verification(accounts["coordinator_account"], ids)
        return self.build(getattr(ids, self.program), {**known, **accounts}, args)


def program_accounts(ids: ProgramIds) -> dict[str, Any]:
    """The accounts that are a program, by the name every instruction gives them."""
    return {
        "system_program": SYSTEM_PROGRAM_ID,
        "token_program": TOKEN_PROGRAM_ID,
        "associated_token_program": ASSOCIATED_TOKEN_PROGRAM_ID,
        "coordinator_program": ids.coordinator,
    }


def by_name(*specs: InstructionSpec) -> dict[str, InstructionSpec]:
    """A program's instructions by name, in declaration order."""
    return {spec.name: spec for spec in specs}
