"""The local endpoint's Ed25519 precompile and instructions sysvar, in Solana's layouts
(`psyche.solana.instructions.ed25519`, `psyche.solana.localnet.precompiles`): a transaction whose
`Ed25519SigVerify` instruction names a signature that does not verify fails with the runtime's
`InstructionError(index, Custom(PrecompileError))` and pays its fee; one that verifies passes,
its offsets read wherever they point (its own data or another instruction's); the sysvar's bytes
are the documented layout and read back instruction by instruction; each signature is checked
with ed25519-dalek's `verify_strict`, as agave's precompile does (small-order keys and `R`,
non-canonical `S` and `R` refused, on real vectors). The coordinator program's use of it:
tests/solana/test_verification.py (a drawn report)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from solders.instruction import AccountMeta, Instruction
from solders.keypair import Keypair
from solders.message import Message
from solders.pubkey import Pubkey
from solders.transaction import Transaction

from psyche.core.ed25519_strict import (
    IDENTITY,
    L,
    P,
    compress,
    decompress,
    is_small_order,
    verify_rfc8032,
    verify_strict,
)
from psyche.core.identity import SecretKey, verify_signature
from psyche.solana.instructions.ed25519 import (
    DATA_START,
    ED25519_PROGRAM,
    SIGNATURE_OFFSETS_SERIALIZED_SIZE,
    THIS_INSTRUCTION,
    Ed25519SignatureOffsets,
    PrecompileError,
    is_ed25519_point,
    load_current_index,
    load_instruction_at,
    load_instruction_count,
    new_ed25519_instruction,
    serialize_instructions,
    signed_messages,
    verify_ed25519_instruction,
)
from psyche.solana.localnet.ledger import LAMPORTS_PER_SIGNATURE, Ledger, message_fee

KEY = SecretKey.from_bytes(bytes(range(32)))
MESSAGE = b"psyche-verification-draw" + bytes(32)


def run(ledger: Ledger, payer: Keypair, instructions: list[Instruction]) -> Any:
    """The landed transaction's error (None: it succeeded)."""
    blockhash, _ = ledger.latest_blockhash()
    tx = Transaction.new_signed_with_payer(instructions, payer.pubkey(), [payer], blockhash)
    record = ledger.get_transaction(ledger.process_transaction(tx))
    assert record is not None
    return record.err


def with_data(instruction: Instruction, data: bytes) -> Instruction:
    return Instruction(instruction.program_id, data, list(instruction.accounts))


def test_the_precompile_passes_good_signatures_and_fails_bad_ones_with_the_runtimes_codes() -> None:
    ledger = Ledger(with_psyche_programs=False)
    payer = Keypair()
    ledger.airdrop(payer.pubkey(), 10**9)
    good = new_ed25519_instruction(KEY.public_key, MESSAGE, KEY.sign(MESSAGE))
    data = bytes(good.data)
    # the layout: one signature, padding, the offsets, then key, signature, message
    assert data[:2] == b"\x01\x00"
    assert Ed25519SignatureOffsets.entries(data) == [
        Ed25519SignatureOffsets(DATA_START + 32, THIS_INSTRUCTION, DATA_START, THIS_INSTRUCTION,
                                DATA_START + 96, len(MESSAGE), THIS_INSTRUCTION)
    ]  # fmt: skip
    assert data[DATA_START : DATA_START + 32] == KEY.public_key
    assert run(ledger, payer, [good]) is None

    before = ledger.get_balance(payer.pubkey())
    forged = bytearray(data)
    forged[-1] ^= 1  # the message it claims is not what was signed
    offsets = bytearray(data)
    offsets[DATA_START - 4 : DATA_START - 2] = (len(data)).to_bytes(2, "little")  # message size
    elsewhere = bytearray(data)
    elsewhere[DATA_START - 2 : DATA_START] = (5).to_bytes(2, "little")  # no instruction 5
    cases = {
        bytes(forged): PrecompileError.InvalidSignature,
        bytes(offsets): PrecompileError.InvalidDataOffsets,
        bytes(elsewhere): PrecompileError.InvalidDataOffsets,
        data[:1]: PrecompileError.InvalidInstructionDataSize,
        b"\x02\x00" + data[2:DATA_START]: PrecompileError.InvalidInstructionDataSize,
    }
    for bad, code in cases.items():
        err = run(ledger, payer, [good, with_data(good, bad)])
        assert err == {"InstructionError": [1, {"Custom": int(code)}]}, (bad, code)
    # a failed transaction lands and pays its fee, as in the SVM: a signature's for the
    # transaction's and each precompile signature claimed (the first data byte: one for `good`,
    # one or two for the bad ones)
    claimed = sum(1 + 1 + bad[0] for bad in cases)
    assert ledger.get_balance(payer.pubkey()) == before - claimed * LAMPORTS_PER_SIGNATURE

    # offsets may point into another instruction of the transaction: its message is read there
    memo = Instruction(Pubkey.new_unique(), MESSAGE, [])
    pointing = bytearray(data[: DATA_START + 96])
    pointing[DATA_START - 6 : DATA_START - 4] = (0).to_bytes(2, "little")  # message offset
    pointing[DATA_START - 2 : DATA_START] = (1).to_bytes(2, "little")  # instruction 1
    err = run(ledger, payer, [with_data(good, bytes(pointing)), memo])
    # the precompile passed; instruction 1 is no program (the runtime's error for it)
    assert err is not None
    assert err["InstructionError"][0] == 1


def two_entries(first: bytes, second_offsets: Ed25519SignatureOffsets) -> bytes:
    """Precompile data of two entries: `first` (a one-entry data's offsets, moved past the second
    entry's) and `second_offsets`."""
    shift = SIGNATURE_OFFSETS_SERIALIZED_SIZE
    (o,) = Ed25519SignatureOffsets.entries(first)
    moved = dataclasses.replace(
        o,
        signature_offset=o.signature_offset + shift,
        public_key_offset=o.public_key_offset + shift,
        message_data_offset=o.message_data_offset + shift,
    )
    return b"\x02\x00" + moved.to_bytes() + second_offsets.to_bytes() + first[DATA_START:]


def test_the_precompile_checks_entry_by_entry_in_agaves_order_and_charges_each_signature() -> None:
    """agave's `ed25519::verify`: each entry is read, its key decompressed and its signature
    verified before the next entry is read, so the first failing entry decides the error: an
    entry badly signed before one whose offsets point nowhere fails `InvalidSignature` (the
    emulation read every entry first: `InvalidDataOffsets`); a key that is no curve point fails
    `InvalidPublicKey`, checked before the message is read. The fee counts each signature the
    precompile claims (its first data byte), as the SVM's."""
    ledger = Ledger(with_psyche_programs=False)
    payer = Keypair()
    ledger.airdrop(payer.pubkey(), 10**9)
    good = new_ed25519_instruction(KEY.public_key, MESSAGE, KEY.sign(MESSAGE))
    data = bytes(good.data)
    forged = bytearray(data)
    forged[-1] ^= 1
    nowhere = Ed25519SignatureOffsets(0, 9, 0, 9, 0, 1, 9)  # instruction 9: none
    not_a_point = (2).to_bytes(32, "little")  # y = 2: (y² - 1) / (d·y² + 1) is not a square
    assert not is_ed25519_point(not_a_point)
    assert is_ed25519_point(KEY.public_key)
    bad_key = bytearray(data)
    bad_key[DATA_START : DATA_START + 32] = not_a_point
    bad_key_no_message = bytearray(bad_key)
    bad_key_no_message[DATA_START - 4 : DATA_START - 2] = (1000).to_bytes(2, "little")
    cases = {
        two_entries(bytes(forged), nowhere): PrecompileError.InvalidSignature,
        two_entries(data, nowhere): PrecompileError.InvalidDataOffsets,  # entry 0 passes
        bytes(bad_key): PrecompileError.InvalidPublicKey,
        bytes(bad_key_no_message): PrecompileError.InvalidPublicKey,
    }
    for bad, code in cases.items():
        before = ledger.get_balance(payer.pubkey())
        err = run(ledger, payer, [with_data(good, bad)])
        assert err == {"InstructionError": [0, {"Custom": int(code)}]}, (bad.hex(), code)
        paid = before - ledger.get_balance(payer.pubkey())
        assert paid == (1 + bad[0]) * LAMPORTS_PER_SIGNATURE
    # a good one pays the same: two signatures checked, the transaction's and the precompile's
    before = ledger.get_balance(payer.pubkey())
    assert run(ledger, payer, [good, good]) is None
    assert before - ledger.get_balance(payer.pubkey()) == 3 * LAMPORTS_PER_SIGNATURE
    # what getFeeForMessage answers is the same fee
    blockhash, _ = ledger.latest_blockhash()
    message = Message.new_with_blockhash([good, good], payer.pubkey(), blockhash)
    assert message_fee(message) == 3 * LAMPORTS_PER_SIGNATURE
    assert verify_ed25519_instruction(data, [], verify_signature) is None


@pytest.mark.parametrize("current", [0, 2])
def test_the_instructions_sysvar_is_solanas_layout_and_reads_back(current: int) -> None:
    signer, other, program = Pubkey.new_unique(), Pubkey.new_unique(), Pubkey.new_unique()
    instructions = [
        new_ed25519_instruction(KEY.public_key, MESSAGE, KEY.sign(MESSAGE)),
        Instruction(program, b"\x07\x08", [AccountMeta(signer, True, True),
                                          AccountMeta(other, False, False)]),
        Instruction(program, b"", []),
    ]  # fmt: skip
    data = serialize_instructions(instructions, current)
    first = 2 + 2 * 3
    second = first + 2 + 32 + 2 + len(instructions[0].data)
    assert data[:first] == (
        (3).to_bytes(2, "little") + first.to_bytes(2, "little") + second.to_bytes(2, "little")
        + (second + 2 + 2 * 33 + 32 + 2 + 2).to_bytes(2, "little")
    )  # fmt: skip
    assert data[second : second + 2 + 33] == b"\x02\x00" + b"\x03" + bytes(signer)
    assert data[second + 35 : second + 36] == b"\x00"  # neither signer nor writable
    assert data[-2:] == current.to_bytes(2, "little")
    assert load_current_index(data) == current
    assert load_instruction_count(data) == 3
    assert [load_instruction_at(data, i) for i in range(3)] == instructions
    assert load_instruction_at(data, 0).program_id == ED25519_PROGRAM


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.lists(st.binary(max_size=64), max_size=3))
def test_any_precompile_data_gives_its_signatures_or_an_error_never_a_crash(
    data: bytes, others: list[bytes]
) -> None:
    """A member writes the precompile's data: whatever it is, the runtime's check gives None or a
    `PrecompileError` and the program's reading entries or a `PrecompileError`, never an
    exception."""
    checked = verify_ed25519_instruction(data, others, verify_signature)
    assert checked is None or isinstance(checked, PrecompileError)
    found = signed_messages(data, others)
    if isinstance(found, PrecompileError):
        return
    assert len(found) == data[0]
    for entry in found:
        assert len(entry.public_key) == 32
        assert len(entry.signature) == 64


# ---------------------------------------------------------------------------------------------
# verify_strict: agave's precompile runs ed25519-dalek's `verify_strict` on every signature


def _double(point: tuple[int, int]) -> tuple[int, int]:
    """Twisted Edwards doubling (a = -1), written out here to check the module's torsion set
    independently of it."""
    x, y = point
    d = -121665 * pow(121666, P - 2, P) % P
    t = d * x * x * y * y % P
    return (2 * x * y * pow(1 + t, P - 2, P) % P, (y * y + x * x) * pow(1 - t, P - 2, P) % P)


def small_order_encodings() -> list[bytes]:
    """The canonical encodings of the 8 points of order dividing 8: y = 1 (the identity),
    y = -1 (order 2), y = 0 (order 4, both x) and the four of order 8 (the points whose double
    has y = 0), each checked to be a curve point that 8 multiplies to the identity."""
    order_4 = [decompress(compress((0, 0))), decompress(compress((1, 0)))]
    out = {compress(IDENTITY), compress((0, P - 1))}
    out |= {compress(p) for p in order_4 if p is not None}
    # the four of order 8: y with d·y⁴ + 2·y² - 1 = 0, searched among the curve's points whose
    # double is of order 4 (both roots y² are tried; each y gives two x)
    d = -121665 * pow(121666, P - 2, P) % P
    for sign in (1, -1):
        s = pow((1 + d) % P, (P + 3) // 8, P)
        if (s * s - (1 + d)) % P:
            s = s * pow(2, (P - 1) // 4, P) % P
        y2 = (-1 + sign * s) * pow(d, P - 2, P) % P
        y = pow(y2, (P + 3) // 8, P)
        if (y * y - y2) % P:
            y = y * pow(2, (P - 1) // 4, P) % P
        if (y * y - y2) % P:
            continue
        for yy in (y, P - y):
            for bit in (0, 1):
                point = decompress((yy | (bit << 255)).to_bytes(32, "little"))
                assert point is not None
                out.add(compress(point))
    encodings = sorted(out)
    assert len(encodings) == 8
    for e in encodings:
        point = decompress(e)
        assert point is not None
        for _ in range(3):
            point = _double(point)
        assert point == IDENTITY, e.hex()
    return encodings


SMALL_ORDER = small_order_encodings()
IDENTITY_R_ZERO_S = compress(IDENTITY) + bytes(32)
"""A "signature" (R = identity, S = 0): [0]B = R + [k]A holds whenever [k]A is the identity,
for every message under the identity key, for a message in 2 under the key of order 2, 4 under those of order 4, 8 under those of
order 8 (k ≡ 0 mod the order)."""
MESSAGES = [b"draw %d" % i for i in range(64)]
# C2SP CCTV ed25519 vector 5 (as agave's `test_ed25519_malleability`): R = 0, of order 4
CCTV_KEY = bytes.fromhex("10eb7c3acfb2bed3e0d6ab89bf5a3d6afddd1176ce4812e38d9fd485058fdb1f")
CCTV_SIGNATURE = bytes.fromhex(
    "0000000000000000000000000000000000000000000000000000000000000000"
    "9472a69cd9a701a50d130ed52189e2455b23767db52cacb8716fb896ffeeac09"
)
CCTV_MESSAGE = b"ed25519vectors 3"


def test_verify_strict_refuses_small_order_keys_and_r_and_non_canonical_s_on_real_vectors() -> None:
    """The forgeries plain RFC 8032 verification (OpenSSL's, `verify_rfc8032`) accepts and
    dalek's `verify_strict` refuses: under each of the 8 small-order keys, (R = identity, S = 0)
    verifies for some of 64 messages (for all under the identity key); CCTV vector 5's R is of
    small order. S + L (the same signature with a non-canonical scalar) is refused by both, a
    valid signature accepted by both. The refusals are checked on the decompressed points: a
    small-order key or R is refused whatever its encoding (here its canonical one and, for y = 0
    and y = 1, y + p)."""
    messages = MESSAGES
    for key in SMALL_ORDER:
        point = decompress(key)
        assert point is not None
        assert is_small_order(point)
        plain = [verify_rfc8032(key, m, IDENTITY_R_ZERO_S) for m in messages]
        assert any(plain), key.hex()  # a real forgery under OpenSSL's rules
        assert not any(verify_strict(key, m, IDENTITY_R_ZERO_S) for m in messages), key.hex()
    identity_key = compress(IDENTITY)
    assert all(verify_rfc8032(identity_key, m, IDENTITY_R_ZERO_S) for m in messages)
    for y in (0, 1):  # non-canonical encodings (y + p) of small-order points decompress too
        noncanonical = (y + P).to_bytes(32, "little")
        point = decompress(noncanonical)
        assert point is not None
        assert is_small_order(point)
        assert not verify_strict(noncanonical, messages[0], IDENTITY_R_ZERO_S)

    assert verify_rfc8032(CCTV_KEY, CCTV_MESSAGE, CCTV_SIGNATURE)
    assert not is_small_order(decompress(CCTV_KEY) or IDENTITY)
    assert not verify_strict(CCTV_KEY, CCTV_MESSAGE, CCTV_SIGNATURE)

    signature = KEY.sign(MESSAGE)
    s = int.from_bytes(signature[32:], "little")
    assert s < L
    high_s = signature[:32] + (s + L).to_bytes(32, "little")
    assert not verify_rfc8032(KEY.public_key, MESSAGE, high_s)
    assert not verify_strict(KEY.public_key, MESSAGE, high_s)
    assert verify_rfc8032(KEY.public_key, MESSAGE, signature)
    assert verify_strict(KEY.public_key, MESSAGE, signature)
    # random honest keys: strict and plain agree
    for i in range(8):
        key = SecretKey.from_bytes(bytes([i + 1]) * 32)
        assert verify_strict(key.public_key, MESSAGE, key.sign(MESSAGE))
        assert not verify_strict(key.public_key, MESSAGE + b"x", key.sign(MESSAGE))


def test_the_precompile_refuses_what_verify_strict_refuses_with_agaves_invalid_signature() -> None:
    """Through the local endpoint's runtime: a precompile naming a small-order key (each of the
    8) with the (identity, 0) signature that key "signs" a message with, the CCTV small-order-R
    vector or a signature with S + L fails the transaction with
    `InstructionError(0, Custom(InvalidSignature))` (agave: `VerifyingKey::from_bytes` passes a
    small-order key, `verify_strict` refuses, mapped to `InvalidSignature`); the valid one
    passes."""
    ledger = Ledger(with_psyche_programs=False)
    payer = Keypair()
    ledger.airdrop(payer.pubkey(), 10**9)
    cases = []
    for key in SMALL_ORDER:
        message = next(
            m for m in MESSAGES if verify_rfc8032(key, m, IDENTITY_R_ZERO_S)
        )  # fmt: skip
        cases.append(new_ed25519_instruction(key, message, IDENTITY_R_ZERO_S))
    cases.append(new_ed25519_instruction(CCTV_KEY, CCTV_MESSAGE, CCTV_SIGNATURE))
    signature = KEY.sign(MESSAGE)
    s = int.from_bytes(signature[32:], "little")
    high_s = signature[:32] + (s + L).to_bytes(32, "little")
    cases.append(new_ed25519_instruction(KEY.public_key, MESSAGE, high_s))
    invalid = {"InstructionError": [0, {"Custom": int(PrecompileError.InvalidSignature)}]}
    for instruction in cases:
        assert run(ledger, payer, [instruction]) == invalid, bytes(instruction.data).hex()
    assert run(ledger, payer, [new_ed25519_instruction(KEY.public_key, MESSAGE, signature)]) is None
