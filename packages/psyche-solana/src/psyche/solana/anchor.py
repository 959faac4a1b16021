"""Anchor's conventions: discriminators, error numbers and the log lines errors produce.

Upstream's programs use Anchor's defaults throughout (no discriminator overrides, no events):

* instruction data starts with `sha256("global:" + name)[:8]`, account data with
  `sha256("account:" + StructName)[:8]`;
* a program's `#[error_code]` enum numbers its variants from 6000;
* Anchor's own errors (a failed constraint, a missing signer, ...) have fixed numbers below 6000.
"""

from __future__ import annotations

import enum
import hashlib
import re
from dataclasses import dataclass

DISCRIMINATOR_LEN = 8
ERROR_CODE_OFFSET = 6000


def instruction_discriminator(name: str) -> bytes:
    """Anchor's sighash of a snake_case instruction name."""
    return hashlib.sha256(f"global:{name}".encode()).digest()[:DISCRIMINATOR_LEN]


def account_discriminator(name: str) -> bytes:
    """Anchor's discriminator of an account struct (CamelCase name)."""
    return hashlib.sha256(f"account:{name}".encode()).digest()[:DISCRIMINATOR_LEN]


class AnchorErrorCode(enum.IntEnum):
    """Anchor framework errors the programs can raise (numbers from anchor-lang 0.30)."""

    InstructionMissing = 100
    InstructionFallbackNotFound = 101
    InstructionDidNotDeserialize = 102
    ConstraintMut = 2000
    ConstraintHasOne = 2001
    ConstraintSigner = 2002
    ConstraintRaw = 2003
    ConstraintOwner = 2004
    ConstraintRentExempt = 2005
    ConstraintSeeds = 2006
    ConstraintClose = 2011
    ConstraintAddress = 2012
    ConstraintZero = 2013
    ConstraintTokenMint = 2014
    ConstraintTokenOwner = 2015
    ConstraintAssociated = 2009
    ConstraintAssociatedInit = 2010
    AccountDiscriminatorAlreadySet = 3000
    AccountDiscriminatorNotFound = 3001
    AccountDiscriminatorMismatch = 3002
    AccountDidNotDeserialize = 3003
    AccountDidNotSerialize = 3004
    AccountNotEnoughKeys = 3005
    AccountNotMutable = 3006
    AccountOwnedByWrongProgram = 3007
    InvalidProgramId = 3008
    InvalidProgramExecutable = 3009
    AccountNotSigner = 3010
    AccountNotSystemOwned = 3011
    AccountNotInitialized = 3012
    AccountNotProgramData = 3013
    AccountNotAssociatedTokenAccount = 3014
    AccountSysvarMismatch = 3015


ANCHOR_ERROR_MESSAGES = {
    AnchorErrorCode.InstructionMissing: "8 byte instruction identifier not provided",
    AnchorErrorCode.InstructionFallbackNotFound: "Fallback functions are not supported",
    AnchorErrorCode.InstructionDidNotDeserialize: (
        "The program could not deserialize the given instruction"
    ),
    AnchorErrorCode.ConstraintMut: "A mut constraint was violated",
    AnchorErrorCode.ConstraintHasOne: "A has one constraint was violated",
    AnchorErrorCode.ConstraintSigner: "A signer constraint was violated",
    AnchorErrorCode.ConstraintRaw: "A raw constraint was violated",
    AnchorErrorCode.ConstraintOwner: "An owner constraint was violated",
    AnchorErrorCode.ConstraintRentExempt: "A rent exemption constraint was violated",
    AnchorErrorCode.ConstraintSeeds: "A seeds constraint was violated",
    AnchorErrorCode.ConstraintClose: "A close constraint was violated",
    AnchorErrorCode.ConstraintAddress: "An address constraint was violated",
    AnchorErrorCode.ConstraintZero: "Expected zero account discriminant",
    AnchorErrorCode.ConstraintTokenMint: "A token mint constraint was violated",
    AnchorErrorCode.ConstraintTokenOwner: "A token owner constraint was violated",
    AnchorErrorCode.ConstraintAssociated: "An associated constraint was violated",
    AnchorErrorCode.ConstraintAssociatedInit: "An associated init constraint was violated",
    AnchorErrorCode.AccountDiscriminatorAlreadySet: (
        "The account discriminator was already set on this account"
    ),
    AnchorErrorCode.AccountDiscriminatorNotFound: "No 8 byte discriminator was found on the account",
    AnchorErrorCode.AccountDiscriminatorMismatch: (
        "8 byte discriminator did not match what was expected"
    ),
    AnchorErrorCode.AccountDidNotDeserialize: "Failed to deserialize the account",
    AnchorErrorCode.AccountDidNotSerialize: "Failed to serialize the account",
    AnchorErrorCode.AccountNotEnoughKeys: "Not enough account keys given to the instruction",
    AnchorErrorCode.AccountNotMutable: "The given account is not mutable",
    AnchorErrorCode.AccountOwnedByWrongProgram: (
        "The given account is owned by a different program than expected"
    ),
    AnchorErrorCode.InvalidProgramId: "Program ID was not as expected",
    AnchorErrorCode.InvalidProgramExecutable: "Program account is not executable",
    AnchorErrorCode.AccountNotSigner: "The given account did not sign",
    AnchorErrorCode.AccountNotSystemOwned: ("The given account is not owned by the system program"),
    AnchorErrorCode.AccountNotInitialized: (
        "The program expected this account to be already initialized"
    ),
    AnchorErrorCode.AccountNotProgramData: "The given account is not a program data account",
    AnchorErrorCode.AccountNotAssociatedTokenAccount: (
        "The given account is not the associated token account"
    ),
    AnchorErrorCode.AccountSysvarMismatch: "The given public key does not match the required sysvar",
}


@dataclass(frozen=True)
class ProgramErrorSpec:
    """One variant of a program's `#[error_code]` enum."""

    name: str
    message: str

    def code(self, index: int) -> int:
        return ERROR_CODE_OFFSET + index


COORDINATOR_ERRORS: tuple[ProgramErrorSpec, ...] = tuple(
    ProgramErrorSpec(name, message)
    for name, message in (
        ("UpdateConfigFinished", "Cannot update config of finished run"),
        ("UpdateConfigNotHalted", "Cannot update config when not halted"),
        ("CoordinatorAccountIncorrectSize", "Coordinator account incorrect size"),
        ("ClientsFull", "Clients list full"),
        ("ConfigSanityCheckFailed", "Config sanity check failed"),
        ("ModelSanityCheckFailed", "Model sanity check failed"),
        ("ProgressSanityCheckFailed", "Progress sanity check failed"),
        ("SignerNotAClient", "Signer not a client"),
        ("SignerMismatch", "Signer mismatch"),
        ("CloseCoordinatorNotHalted", "Cannot close coordinator account when not halted"),
        ("CoordinatorErrorNoActiveRound", "Coordinator error: No active round"),
        ("CoordinatorErrorInvalidWitness", "Coordinator error: Invalid witness"),
        ("CoordinatorErrorInvalidRunState", "Coordinator error: Invalid run state"),
        ("CoordinatorErrorDuplicateWitness", "Coordinator error: Duplicate witness"),
        ("CoordinatorErrorInvalidHealthCheck", "Coordinator error: Invalid health check"),
        ("CoordinatorErrorHalted", "Coordinator error: Halted"),
        ("CoordinatorErrorInvalidCheckpoint", "Coordinator error: Invalid checkpoint"),
        ("CoordinatorErrorWitnessesFull", "Coordinator error: Witnesses full"),
        ("CoordinatorErrorCannotResume", "Coordinator error: Cannot resume"),
        ("CoordinatorErrorInvalidWithdraw", "Coordinator error: Invalid withdraw"),
        (
            "CoordinatorErrorInvalidCommitteeSelection",
            "Coordinator error: Invalid committee selection",
        ),
        ("CoordinatorErrorInvalidCommitteeProof", "Coordinator error: Invalid committee proof"),
        ("MoreClientsThanBatches", "There are more clients than total number of batches to assign"),
        ("RunIdInvalidLength", "run_id must be 32 bytes or less"),
        # Beyond upstream (issue 27, `psyche.solana.verification`): appended, so upstream's
        # codes are unchanged.
        ("VerificationOff", "The run does not verify (verification_percent is 0)"),
        ("VerificationReportRefused", "Verification report refused"),
        ("ClientBanned", "Client banned for losing a verification dispute"),
    )
)

AUTHORIZER_ERRORS: tuple[ProgramErrorSpec, ...] = (
    ProgramErrorSpec("AuthorizationActiveIsTrue", "AuthorizationActive is true"),
    ProgramErrorSpec(
        "AuthorizationClosingConditionsNotReachedYet",
        "Authorization closing conditions not reached yet",
    ),
)

TREASURER_ERRORS: tuple[ProgramErrorSpec, ...] = (
    ProgramErrorSpec("InvalidParameter", "Invalid parameter"),
    ProgramErrorSpec("RunIdInvalidLength", "run_id must be 32 bytes or less"),
)


def error_code(errors: tuple[ProgramErrorSpec, ...], name: str) -> int:
    for index, spec in enumerate(errors):
        if spec.name == name:
            return spec.code(index)
    raise KeyError(f"no program error named {name!r}")


_ANCHOR_ERROR_LOG = re.compile(
    r"AnchorError .*?Error Code: (?P<name>\w+)\. Error Number: (?P<number>\d+)\. "
    r"Error Message: (?P<message>.*?)\.?$"
)


@dataclass(frozen=True)
class AnchorErrorLog:
    name: str
    number: int
    message: str


def find_anchor_error(logs: list[str]) -> AnchorErrorLog | None:
    """The Anchor error a transaction's logs report (the last one), if any."""
    found = None
    for line in logs:
        match = _ANCHOR_ERROR_LOG.search(line)
        if match:
            found = AnchorErrorLog(match["name"], int(match["number"]), match["message"])
    return found
