"""The Ed25519 signature-verification precompile (`Ed25519SigVerify111…`) and the instructions
sysvar a program reads it back through: Solana's byte layouts (`solana-ed25519-program`,
`solana-instructions-sysvar`), for the transactions clients build, the local endpoint's runtime
and the coordinator program's check.

A Solana program has no ed25519 call. A transaction that wants a signature checked carries an
`Ed25519SigVerify` instruction: the runtime verifies every signature it names and fails the
transaction otherwise (`InstructionError(index, Custom(PrecompileError))`); a program that
relies on it reads the transaction's instructions from the instructions sysvar and checks that
one of them is that precompile, naming exactly the key, message and signature it needs.

Instruction data: `num_signatures: u8`, a padding byte, then `num_signatures`
`Ed25519SignatureOffsets` (seven little-endian u16: signature offset and instruction index,
public key offset and instruction index, message offset, size and instruction index; an index
of `u16::MAX` is this instruction's own data), then the bytes they point at (`new_ed25519_
instruction` writes key, signature and message after one offsets entry, as
`solana_ed25519_program::new_ed25519_instruction` does).

Instructions sysvar data: `u16` count, a `u16` offset per instruction, each instruction as a
`u16` account count, per account a flags byte (1 signer, 2 writable) and its key, the program
id, a `u16` data length and the data; the index of the instruction being executed in the last
two bytes (all little-endian).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from solders.instruction import AccountMeta, Instruction
from solders.pubkey import Pubkey

from psyche.core.identity import is_ed25519_point
from psyche.solana.program_ids import ED25519_PROGRAM_ID, SYSVAR_INSTRUCTIONS_ID

ED25519_PROGRAM = Pubkey.from_string(ED25519_PROGRAM_ID)
SYSVAR_INSTRUCTIONS = Pubkey.from_string(SYSVAR_INSTRUCTIONS_ID)

PUBKEY_SERIALIZED_SIZE = 32
SIGNATURE_SERIALIZED_SIZE = 64
SIGNATURE_OFFSETS_SERIALIZED_SIZE = 14
SIGNATURE_OFFSETS_START = 2
DATA_START = SIGNATURE_OFFSETS_START + SIGNATURE_OFFSETS_SERIALIZED_SIZE
THIS_INSTRUCTION = 0xFFFF
"""An offsets entry's instruction index meaning "this instruction's own data" (`u16::MAX`)."""

_OFFSETS = struct.Struct("<7H")


class PrecompileError(enum.IntEnum):
    """`solana_precompile_error::PrecompileError`: the `Custom` code a failed precompile gives."""

    InvalidPublicKey = 0
    InvalidRecoveryId = 1
    InvalidSignature = 2
    InvalidDataOffsets = 3
    InvalidInstructionDataSize = 4


@dataclass(frozen=True)
class Ed25519SignatureOffsets:
    signature_offset: int
    signature_instruction_index: int
    public_key_offset: int
    public_key_instruction_index: int
    message_data_offset: int
    message_data_size: int
    message_instruction_index: int

    def to_bytes(self) -> bytes:
        return _OFFSETS.pack(
            self.signature_offset,
            self.signature_instruction_index,
            self.public_key_offset,
            self.public_key_instruction_index,
            self.message_data_offset,
            self.message_data_size,
            self.message_instruction_index,
        )

    @classmethod
    def entries(cls, data: bytes) -> list[Ed25519SignatureOffsets]:
        """The offsets entries of precompile instruction data whose size is checked
        (`check_size`)."""
        return [
            cls(*_OFFSETS.unpack_from(data, SIGNATURE_OFFSETS_START + i * _OFFSETS.size))
            for i in range(data[0])
        ]


def new_ed25519_instruction(public_key: bytes, message: bytes, signature: bytes) -> Instruction:
    """One signature to verify, its key, signature and message in the instruction's own data."""
    if len(public_key) != PUBKEY_SERIALIZED_SIZE or len(signature) != SIGNATURE_SERIALIZED_SIZE:
        raise ValueError("an Ed25519 key is 32 bytes and a signature 64")
    key_at = DATA_START
    signature_at = key_at + PUBKEY_SERIALIZED_SIZE
    message_at = signature_at + SIGNATURE_SERIALIZED_SIZE
    offsets = Ed25519SignatureOffsets(
        signature_at, THIS_INSTRUCTION, key_at, THIS_INSTRUCTION,
        message_at, len(message), THIS_INSTRUCTION,
    )  # fmt: skip
    data = bytes([1, 0]) + offsets.to_bytes() + public_key + signature + message
    return Instruction(ED25519_PROGRAM, data, [])


def check_size(data: bytes) -> PrecompileError | None:
    """The precompile's size checks of its instruction data."""
    if len(data) < SIGNATURE_OFFSETS_START:
        return PrecompileError.InvalidInstructionDataSize
    count = data[0]
    if count == 0 and len(data) > SIGNATURE_OFFSETS_START:
        return PrecompileError.InvalidInstructionDataSize
    if len(data) < count * SIGNATURE_OFFSETS_SERIALIZED_SIZE + SIGNATURE_OFFSETS_START:
        return PrecompileError.InvalidInstructionDataSize
    return None


def _slice(
    data: bytes, datas: Sequence[bytes], index: int, start: int, size: int
) -> bytes | PrecompileError:
    if index == THIS_INSTRUCTION:
        source = data
    elif index >= len(datas):
        return PrecompileError.InvalidDataOffsets
    else:
        source = datas[index]
    if start + size > len(source):
        return PrecompileError.InvalidDataOffsets
    return source[start : start + size]


@dataclass(frozen=True)
class SignedMessage:
    public_key: bytes
    message: bytes
    signature: bytes


def _entry(
    data: bytes,
    datas: Sequence[bytes],
    o: Ed25519SignatureOffsets,
    key_ok: Callable[[bytes], bool] | None = None,
) -> SignedMessage | PrecompileError:
    """One offsets entry's signature, key and message, read in agave's order (signature, key,
    the key's decompression when `key_ok` is given, message), or the first error."""
    signature = _slice(data, datas, o.signature_instruction_index, o.signature_offset,
                       SIGNATURE_SERIALIZED_SIZE)  # fmt: skip
    if isinstance(signature, PrecompileError):
        return signature
    key = _slice(data, datas, o.public_key_instruction_index, o.public_key_offset,
                 PUBKEY_SERIALIZED_SIZE)  # fmt: skip
    if isinstance(key, PrecompileError):
        return key
    if key_ok is not None and not key_ok(key):
        return PrecompileError.InvalidPublicKey
    message = _slice(data, datas, o.message_instruction_index, o.message_data_offset,
                     o.message_data_size)  # fmt: skip
    if isinstance(message, PrecompileError):
        return message
    return SignedMessage(key, message, signature)


def signed_messages(data: bytes, datas: Sequence[bytes]) -> list[SignedMessage] | PrecompileError:
    """What precompile instruction data names (each entry's key, message and signature, read
    where its offsets point among the transaction's instruction `datas`), or the first error."""
    error = check_size(data)
    if error is not None:
        return error
    out = []
    for o in Ed25519SignatureOffsets.entries(data):
        entry = _entry(data, datas, o)
        if isinstance(entry, PrecompileError):
            return entry
        out.append(entry)
    return out


def verify_ed25519_instruction(
    data: bytes, datas: Sequence[bytes], verify: Callable[[bytes, bytes, bytes], bool]
) -> PrecompileError | None:
    """What the runtime does with a precompile instruction (agave's
    `solana_precompiles::ed25519::verify`): after the size checks, entry by entry, each read
    (`InvalidDataOffsets`), its key decompressed (`InvalidPublicKey`) and its signature verified
    (`verify(key, message, signature)`, `InvalidSignature`) before the next entry is read, so
    the first failing entry decides the error. The error, or None."""
    error = check_size(data)
    if error is not None:
        return error
    for o in Ed25519SignatureOffsets.entries(data):
        entry = _entry(data, datas, o, is_ed25519_point)
        if isinstance(entry, PrecompileError):
            return entry
        if not verify(entry.public_key, entry.message, entry.signature):
            return PrecompileError.InvalidSignature
    return None


def precompile_signature_count(instructions: Sequence[tuple[Pubkey, bytes]]) -> int:
    """The precompile signatures a transaction pays for (agave's
    `get_precompile_signature_details`): each `Ed25519SigVerify` instruction's first data byte
    (its `num_signatures`, 0 for empty data), whatever the rest holds. (`(program id, data)` per
    instruction.)"""
    return sum(data[0] for program, data in instructions if program == ED25519_PROGRAM and data)


# ---------------------------------------------------------------------------------------------
# The instructions sysvar


def serialize_instructions(instructions: Sequence[Instruction], current: int) -> bytes:
    """The instructions sysvar's data while instruction `current` of `instructions` runs."""
    out = bytearray(len(instructions).to_bytes(2, "little"))
    out += bytes(2 * len(instructions))
    for i, ix in enumerate(instructions):
        out[2 + 2 * i : 4 + 2 * i] = len(out).to_bytes(2, "little")
        out += len(ix.accounts).to_bytes(2, "little")
        for meta in ix.accounts:
            out.append((1 if meta.is_signer else 0) | (2 if meta.is_writable else 0))
            out += bytes(meta.pubkey)
        out += bytes(ix.program_id)
        out += len(ix.data).to_bytes(2, "little") + bytes(ix.data)
    out += current.to_bytes(2, "little")
    return bytes(out)


class SysvarDecodeError(ValueError):
    """Instructions sysvar data that does not hold what was asked (`InvalidArgument`)."""


def _u16(data: bytes, at: int) -> int:
    if at + 2 > len(data):
        raise SysvarDecodeError("instructions sysvar data too short")
    return int.from_bytes(data[at : at + 2], "little")


def load_current_index(data: bytes) -> int:
    """`load_current_index_checked`: the index of the instruction being executed."""
    return _u16(data, len(data) - 2)


def load_instruction_count(data: bytes) -> int:
    return _u16(data, 0)


def load_instruction_at(data: bytes, index: int) -> Instruction:
    """`load_instruction_at_checked`: instruction `index` of the running transaction."""
    if index >= load_instruction_count(data):
        raise SysvarDecodeError(f"no instruction {index}")
    at = _u16(data, 2 + 2 * index)
    count = _u16(data, at)
    at += 2
    accounts = []
    for _ in range(count):
        if at + 33 > len(data):
            raise SysvarDecodeError("instructions sysvar data too short")
        flags = data[at]
        key = Pubkey.from_bytes(data[at + 1 : at + 33])
        accounts.append(AccountMeta(key, bool(flags & 1), bool(flags & 2)))
        at += 33
    if at + 34 > len(data):
        raise SysvarDecodeError("instructions sysvar data too short")
    program = Pubkey.from_bytes(data[at : at + 32])
    size = _u16(data, at + 32)
    start = at + 34
    if start + size > len(data):
        raise SysvarDecodeError("instructions sysvar data too short")
    return Instruction(program, data[start : start + size], accounts)


__all__ = [
    "DATA_START",
    "ED25519_PROGRAM",
    "SYSVAR_INSTRUCTIONS",
    "THIS_INSTRUCTION",
    "Ed25519SignatureOffsets",
    "PrecompileError",
    "SignedMessage",
    "SysvarDecodeError",
    "is_ed25519_point",
    "load_current_index",
    "load_instruction_at",
    "load_instruction_count",
    "new_ed25519_instruction",
    "precompile_signature_count",
    "serialize_instructions",
    "signed_messages",
    "verify_ed25519_instruction",
]
