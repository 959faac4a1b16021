"""What a Psyche program written in Python sees while it runs an instruction.

`InvokeContext` gives a program its instruction (program id, accounts with their signer and
writable flags, data), the accounts' current state, the clock, and cross-program invocation.
`AnchorError` and `ProgramPanic` are how a program fails; the ledger turns them into the same
transaction errors and log lines the real programs produce. The helpers at the end implement the
checks Anchor's `#[derive(Accounts)]` generates (signer, mut, owner, discriminator, seeds,
`init`, `close`, `realloc`) for the programs in this package.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from solders.account import Account
from solders.instruction import AccountMeta, Instruction
from solders.pubkey import Pubkey

from psyche.solana.anchor import (
    ANCHOR_ERROR_MESSAGES,
    DISCRIMINATOR_LEN,
    AnchorErrorCode,
    ProgramErrorSpec,
    account_discriminator,
)
from psyche.solana.borsh import BorshError, take_borsh
from psyche.solana.instructions import spec_for_data
from psyche.solana.instructions.spec import InstructionDecodeError
from psyche.solana.program_ids import SYSTEM_PROGRAM_ID
from psyche.solana.state import anchor_account_name

if TYPE_CHECKING:
    from psyche.solana.localnet.ledger import Ledger

T = TypeVar("T")

SYSTEM_PROGRAM = Pubkey.from_string(SYSTEM_PROGRAM_ID)


class InstructionFailure(Exception):
    """An instruction failed; `detail` is the RPC form of the `InstructionError` payload."""

    def __init__(self, detail: Any, message: str = "") -> None:
        super().__init__(message or str(detail))
        self.detail = detail


class AnchorError(InstructionFailure):
    """A program or Anchor error: `InstructionError(_, Custom(code))` plus Anchor's log line."""

    def __init__(self, code: int, name: str, message: str, account: str | None = None) -> None:
        super().__init__({"Custom": code}, f"{name}: {message}")
        self.code = code
        self.name = name
        self.error_message = message
        self.account = account

    def log_line(self) -> str:
        cause = f"caused by account: {self.account}. " if self.account else "occurred. "
        return (
            f"AnchorError {cause}Error Code: {self.name}. Error Number: {self.code}. "
            f"Error Message: {self.error_message}."
        )


def anchor_error(code: AnchorErrorCode, account: str | None = None) -> AnchorError:
    return AnchorError(int(code), code.name, ANCHOR_ERROR_MESSAGES.get(code, ""), account)


def program_error(errors: Sequence[ProgramErrorSpec], name: str) -> AnchorError:
    for index, spec in enumerate(errors):
        if spec.name == name:
            return AnchorError(spec.code(index), spec.name, spec.message)
    raise KeyError(f"no program error {name!r}")


class ProgramPanic(InstructionFailure):
    """Where the Rust program would panic: the instruction fails to complete."""

    def __init__(self, message: str) -> None:
        super().__init__("ProgramFailedToComplete", message)
        self.panic_message = message


@dataclass
class InvokeContext:
    """One program invocation (top level or CPI) inside a transaction."""

    ledger: Ledger
    program_id: Pubkey
    metas: list[AccountMeta]
    data: bytes
    depth: int
    logs: list[str]

    def log(self, message: str) -> None:
        self.logs.append(f"Program log: {message}")

    # ---- accounts ---------------------------------------------------------------------------

    def get(self, key: Pubkey) -> Account | None:
        """The account, or None when it does not exist (no lamports)."""
        return self.ledger.get_account(key)

    def set(self, key: Pubkey, account: Account) -> None:
        self.ledger.write_account(key, account)

    def signers(self) -> builtins.set[Pubkey]:  # `set` here is the method above
        return {m.pubkey for m in self.metas if m.is_signer}

    # ---- sysvars ----------------------------------------------------------------------------

    def unix_timestamp(self) -> int:
        return self.ledger.unix_timestamp()

    def slot(self) -> int:
        return self.ledger.slot

    def rent_exempt_minimum(self, space: int) -> int:
        return self.ledger.minimum_balance_for_rent_exemption(space)

    # ---- cross-program invocation -----------------------------------------------------------

    def invoke(self, instruction: Instruction, pda_signers: Sequence[Pubkey] = ()) -> None:
        """Call another program. Signers are this invocation's signers plus the PDAs of this
        program that it signs for (`invoke_signed`)."""
        allowed = self.signers() | set(pda_signers)
        for meta in instruction.accounts:
            if meta.is_signer and meta.pubkey not in allowed:
                raise InstructionFailure(
                    "PrivilegeEscalation", f"{meta.pubkey} signs a CPI it did not sign"
                )
        self.ledger.invoke(instruction, allowed, self.depth + 1, self.logs)


# ---------------------------------------------------------------------------------------------
# Anchor account checks


@dataclass(frozen=True)
class Accounts:
    """An instruction's accounts by the names of upstream's `#[derive(Accounts)]` fields."""

    metas: dict[str, AccountMeta]

    def __getitem__(self, name: str) -> AccountMeta:
        return self.metas[name]

    def key(self, name: str) -> Pubkey:
        return self.metas[name].pubkey

    def signer(self, name: str) -> AccountMeta:
        """The account `name`, which must sign (Anchor's `Signer<'info>`)."""
        meta = self.metas[name]
        require_signer(meta, name)
        return meta

    def mutable(self, name: str) -> AccountMeta:
        """The account `name`, which must be writable (Anchor's `#[account(mut)]`)."""
        meta = self.metas[name]
        require_mut(meta, name)
        return meta


def name_accounts(ctx: InvokeContext, names: Sequence[str]) -> Accounts:
    if len(ctx.metas) < len(names):
        raise anchor_error(AnchorErrorCode.AccountNotEnoughKeys)
    return Accounts({name: ctx.metas[i] for i, name in enumerate(names)})


Handler = Callable[[InvokeContext, Accounts, Any], None]


def dispatch_anchor_instruction(
    ctx: InvokeContext, program: str, handlers: Mapping[str, Handler]
) -> None:
    """Anchor's entry point: find the instruction by discriminator, decode its arguments, name
    its accounts, run its handler; each failure is the error code Anchor raises for it."""
    spec = spec_for_data(program, ctx.data)
    if spec is None:
        raise anchor_error(
            AnchorErrorCode.InstructionMissing
            if len(ctx.data) < DISCRIMINATOR_LEN
            else AnchorErrorCode.InstructionFallbackNotFound
        )
    ctx.log("Instruction: " + "".join(p.capitalize() for p in spec.name.split("_")))
    try:
        args = spec.decode(ctx.data)
    except InstructionDecodeError:
        raise anchor_error(AnchorErrorCode.InstructionDidNotDeserialize) from None
    accounts = name_accounts(ctx, [a.name for a in spec.accounts])
    handlers[spec.name](ctx, accounts, args)


def require_signer(meta: AccountMeta, name: str) -> None:
    if not meta.is_signer:
        raise anchor_error(AnchorErrorCode.AccountNotSigner, name)


def require_mut(meta: AccountMeta, name: str) -> None:
    if not meta.is_writable:
        raise anchor_error(AnchorErrorCode.ConstraintMut, name)


def require_payer(accounts: Accounts) -> AccountMeta:
    """The `payer` account of an instruction that creates one: a mutable signer (Anchor's
    `#[account(mut)] payer: Signer`)."""
    payer = accounts.signer("payer")
    require_mut(payer, "payer")
    return payer


def require(
    condition: bool, name: str, code: AnchorErrorCode = AnchorErrorCode.ConstraintRaw
) -> None:
    if not condition:
        raise anchor_error(code, name)


def require_program(meta: AccountMeta, program_id: Pubkey, name: str) -> None:
    if meta.pubkey != program_id:
        raise anchor_error(AnchorErrorCode.InvalidProgramId, name)


def require_system_account(ctx: InvokeContext, meta: AccountMeta, name: str) -> None:
    account = ctx.get(meta.pubkey)
    if account is not None and account.owner != SYSTEM_PROGRAM:
        raise anchor_error(AnchorErrorCode.AccountNotSystemOwned, name)


def require_owner(ctx: InvokeContext, meta: AccountMeta, owner: Pubkey, name: str) -> Account:
    """The `owner = ...` constraint on an unchecked account."""
    account = ctx.get(meta.pubkey)
    if account is None or account.owner != owner:
        raise anchor_error(AnchorErrorCode.ConstraintOwner, name)
    return account


def load_account_data(
    ctx: InvokeContext, meta: AccountMeta, owner: Pubkey, account_name: str, name: str
) -> tuple[Account, bytes]:
    """`Account<T>`/`AccountLoader<T>`: initialized, owned by `owner`, right discriminator."""
    account = ctx.get(meta.pubkey)
    if account is None or (account.owner == SYSTEM_PROGRAM and not account.data):
        raise anchor_error(AnchorErrorCode.AccountNotInitialized, name)
    if account.owner != owner:
        raise anchor_error(AnchorErrorCode.AccountOwnedByWrongProgram, name)
    data = bytes(account.data)
    if len(data) < DISCRIMINATOR_LEN:
        raise anchor_error(AnchorErrorCode.AccountDiscriminatorNotFound, name)
    if data[:DISCRIMINATOR_LEN] != account_discriminator(account_name):
        raise anchor_error(AnchorErrorCode.AccountDiscriminatorMismatch, name)
    return account, data


def load_borsh_account(
    ctx: InvokeContext, meta: AccountMeta, tp: type[T], owner: Pubkey, name: str
) -> T:
    _, data = load_account_data(ctx, meta, owner, anchor_account_name(tp), name)
    try:
        value, _ = take_borsh(memoryview(data)[DISCRIMINATOR_LEN:], tp)
    except BorshError:
        raise anchor_error(AnchorErrorCode.AccountDidNotDeserialize, name) from None
    return value


def store_borsh_account(
    ctx: InvokeContext, key: Pubkey, value: Any, *, zero_tail: bool = False
) -> None:
    """Anchor's exit: serialize the account back over its data (its size is unchanged). The
    bytes past the encoding stay as they were, as Anchor leaves them (an encoding that shrank
    leaves its old end there), unless `zero_tail`: what a program that appends fields to an
    account with variable-length parts must do (`data[len..].fill(0)`), so that a field
    appended later reads its zero default however the encoding shrank before."""
    from psyche.solana.state import encode_anchor_account

    account = ctx.get(key)
    assert account is not None, "storing an account that does not exist"
    encoded = encode_anchor_account(value)
    data = bytes(account.data)
    if len(encoded) > len(data):
        raise anchor_error(AnchorErrorCode.AccountDidNotSerialize)
    tail = bytes(len(data) - len(encoded)) if zero_tail else data[len(encoded) :]
    ctx.set(key, _with_data(account, encoded + tail))


def require_seeds(
    meta: AccountMeta,
    seeds: Sequence[bytes],
    program_id: Pubkey,
    name: str,
    bump: int | None = None,
) -> int:
    """The `seeds = [...], bump` constraint; returns the bump."""
    if any(len(seed) > 32 for seed in seeds):
        # `Pubkey::find_program_address` panics on an over-long seed.
        raise ProgramPanic("Unable to find a viable program address bump seed")
    if bump is None:
        expected, bump = Pubkey.find_program_address(list(seeds), program_id)
    else:
        try:
            expected = Pubkey.create_program_address([*seeds, bytes([bump])], program_id)
        except Exception:
            raise anchor_error(AnchorErrorCode.ConstraintSeeds, name) from None
    if meta.pubkey != expected:
        raise anchor_error(AnchorErrorCode.ConstraintSeeds, name)
    return bump


def init_pda(
    ctx: InvokeContext,
    payer: Pubkey,
    meta: AccountMeta,
    seeds: Sequence[bytes],
    space: int,
    name: str,
) -> int:
    """`init, payer = payer, space = space, seeds = seeds, bump`: create the account (owned by
    this program) through the system program, signed by the PDA. Returns the bump."""
    from solders import system_program

    bump = require_seeds(meta, seeds, ctx.program_id, name)
    require_mut(meta, name)
    lamports = ctx.rent_exempt_minimum(space)
    existing = ctx.get(meta.pubkey)
    if existing is None:
        ctx.invoke(
            system_program.create_account(
                system_program.CreateAccountParams(
                    from_pubkey=payer,
                    to_pubkey=meta.pubkey,
                    lamports=lamports,
                    space=space,
                    owner=ctx.program_id,
                )
            ),
            [meta.pubkey],
        )
    else:
        # Anchor tops up, allocates and assigns an account that already holds lamports;
        # allocate fails (already in use) when it has data or an owner.
        if existing.lamports < lamports:
            ctx.invoke(
                system_program.transfer(
                    system_program.TransferParams(
                        from_pubkey=payer,
                        to_pubkey=meta.pubkey,
                        lamports=lamports - existing.lamports,
                    )
                )
            )
        ctx.invoke(
            system_program.allocate(system_program.AllocateParams(pubkey=meta.pubkey, space=space)),
            [meta.pubkey],
        )
        ctx.invoke(
            system_program.assign(
                system_program.AssignParams(pubkey=meta.pubkey, owner=ctx.program_id)
            ),
            [meta.pubkey],
        )
    return bump


def close_account(ctx: InvokeContext, key: Pubkey, spill: Pubkey) -> None:
    """`close = spill`: move all lamports to `spill`, give the account back to the system
    program with no data."""
    account = ctx.get(key)
    if account is None:
        return
    spill_account = ctx.get(spill)
    spill_lamports = 0 if spill_account is None else spill_account.lamports
    ctx.set(
        spill,
        Account(
            spill_lamports + account.lamports,
            b"" if spill_account is None else bytes(spill_account.data),
            SYSTEM_PROGRAM if spill_account is None else spill_account.owner,
            False if spill_account is None else spill_account.executable,
            0 if spill_account is None else spill_account.rent_epoch,
        ),
    )
    ctx.set(key, Account(0, b"", SYSTEM_PROGRAM, False, 0))


def realloc(ctx: InvokeContext, key: Pubkey, new_space: int, payer: Pubkey) -> None:
    """`realloc = new_space, realloc::payer = payer, realloc::zero = true`."""
    from solders import system_program

    account = ctx.get(key)
    assert account is not None
    needed = ctx.rent_exempt_minimum(new_space)
    if needed > account.lamports:
        ctx.invoke(
            system_program.transfer(
                system_program.TransferParams(
                    from_pubkey=payer, to_pubkey=key, lamports=needed - account.lamports
                )
            )
        )
        account = ctx.get(key)
        assert account is not None
    elif needed < account.lamports:
        excess = account.lamports - needed
        payer_account = ctx.get(payer)
        assert payer_account is not None
        ctx.set(payer, _with_lamports(payer_account, payer_account.lamports + excess))
        account = _with_lamports(account, needed)
    data = bytes(account.data)
    resized = data[:new_space] + bytes(max(0, new_space - len(data)))
    ctx.set(key, _with_data(account, resized))


def _with_data(account: Account, data: bytes) -> Account:
    return Account(account.lamports, data, account.owner, account.executable, account.rent_epoch)


def _with_lamports(account: Account, lamports: int) -> Account:
    return Account(
        lamports, bytes(account.data), account.owner, account.executable, account.rent_epoch
    )


def write_data(ctx: InvokeContext, key: Pubkey, data: bytes) -> None:
    """Replace the data of an account this program owns (same size)."""
    account = ctx.get(key)
    assert account is not None, "not this program's account"
    assert account.owner == ctx.program_id, "not this program's account"
    assert len(data) == len(account.data), "a program cannot resize an account by writing"
    ctx.set(key, _with_data(account, data))
