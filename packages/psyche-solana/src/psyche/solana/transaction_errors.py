"""Human-readable text of Solana transaction errors in their RPC JSON form.

A transaction error travels as JSON: a bare name (`"BlockhashNotFound"`) or an object
(`{"InstructionError": [0, {"Custom": 6000}]}`). These functions give the text validators
print for them (the Rust `Display` impls), which retry decisions and users read.
"""

from __future__ import annotations

import re
from typing import Any

_FIELDLESS_MESSAGES = {
    "AccountInUse": "Account in use",
    "AccountNotFound": "Attempt to debit an account but found no record of a prior credit.",
    "ProgramAccountNotFound": "Attempt to load a program that does not exist",
    "InsufficientFundsForFee": "Insufficient funds for fee",
    "InvalidAccountForFee": "This account may not be used to pay transaction fees",
    "AlreadyProcessed": "This transaction has already been processed",
    "BlockhashNotFound": "Blockhash not found",
    "SignatureFailure": "Transaction did not pass signature verification",
    "SanitizeFailure": "Transaction failed to sanitize accounts offsets correctly",
    "InvalidProgramForExecution": "This program may not be used for executing instructions",
    "UnsupportedVersion": "Transaction version is unsupported",
    "AddressLookupTableNotFound": "Transaction loads an address table account that doesn't exist",
    "MissingSignatureForFee": "Transaction requires a fee but has no signature present",
}


def describe_instruction_error(detail: Any) -> str:
    if isinstance(detail, dict) and "Custom" in detail:
        return f"custom program error: 0x{detail['Custom']:x}"
    if isinstance(detail, dict) and "BorshIoError" in detail:
        return f"Failed to serialize or deserialize account data: {detail['BorshIoError']}"
    name = str(detail)
    special = {
        "ProgramFailedToComplete": "Program failed to complete",
        "MissingRequiredSignature": "missing required signature for instruction",
        "PrivilegeEscalation": "Cross-program invocation with unauthorized signer or writable account",
        "InvalidAccountData": "invalid account data for instruction",
        "InvalidArgument": "invalid program argument",
    }
    return special.get(name, re.sub(r"(?<!^)(?=[A-Z])", " ", name).lower())


def describe_transaction_error(err: Any) -> str:
    if isinstance(err, dict) and "InstructionError" in err:
        index, detail = err["InstructionError"]
        return f"Error processing Instruction {index}: {describe_instruction_error(detail)}"
    if isinstance(err, dict) and "InsufficientFundsForRent" in err:
        index = err["InsufficientFundsForRent"]["account_index"]
        return f"Transaction results in an account ({index}) with insufficient funds for rent"
    return _FIELDLESS_MESSAGES.get(str(err), str(err))
