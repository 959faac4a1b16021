"""The local endpoint's chain: accounts, transactions, clock and slot.

Accounts live in solders' `LiteSVM`, which runs the system program and the SPL programs (token,
associated token) for real. Instructions for the three Psyche programs are executed here by their
Python ports (`coordinator_program`, `authorizer_program`, `treasurer_program`) against the same
accounts, in the exact on-chain byte layouts. This is the equivalent of upstream's in-memory
"memnet" tests, not a validator: the Psyche program logic is the Python port, not the deployed
SBF binary.

A transaction is processed the way the runtime does it: signatures verified, blockhash checked,
duplicates rejected, fee (5000 lamports per signature: the transaction's and, as the SVM counts
them, each one an `Ed25519SigVerify` instruction names, `message_fee`) charged to the fee payer, instructions run
in order, and everything but the fee rolled back when one fails. The runtime's parts a program
relies on are there too: the Ed25519 precompile (`precompiles`: an `Ed25519SigVerify`
instruction whose signature does not verify fails the transaction, as in the SVM) and the
instructions sysvar (`Sysvar1nstructions…`: while a transaction runs, its instructions and the
current index in Solana's layout, `psyche.solana.instructions.ed25519`). Each instruction of a LiteSVM
program (and each CPI from a Python program into one) runs as a one-instruction LiteSVM
transaction paid by an internal account, with LiteSVM's own signature check off: signers were
verified here, PDA signers by the calling program. Each processed transaction gets its own slot.

All methods are synchronous; a lock makes the ledger safe to share between threads.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from solders.account import Account
from solders.hash import Hash
from solders.instruction import AccountMeta, Instruction
from solders.keypair import Keypair
from solders.litesvm import LiteSVM
from solders.message import Message, MessageV0
from solders.pubkey import Pubkey
from solders.signature import Signature
from solders.transaction import Transaction, VersionedTransaction
from solders.transaction_metadata import FailedTransactionMetadata

from psyche.solana.instructions.ed25519 import (
    ED25519_PROGRAM,
    SYSVAR_INSTRUCTIONS,
    precompile_signature_count,
    serialize_instructions,
)
from psyche.solana.localnet.precompiles import ed25519_program
from psyche.solana.localnet.runtime import (
    AnchorError,
    InstructionFailure,
    InvokeContext,
    ProgramPanic,
)
from psyche.solana.program_ids import (
    DEFAULT_PROGRAM_IDS,
    SYSTEM_PROGRAM_ID,
    SYSVAR_OWNER_ID,
    ProgramIds,
)
from psyche.solana.transaction_errors import (
    describe_instruction_error,
    describe_transaction_error,
)

log = logging.getLogger(__name__)

LAMPORTS_PER_SIGNATURE = 5000
MAX_TRANSACTION_SIZE = 1232
RECENT_BLOCKHASHES = 300
MAX_PROCESSING_AGE = 150
TRANSACTION_HISTORY = 10_000
INTERNAL_PAYER_LAMPORTS = 10**18
MAX_CPI_DEPTH = 4

_SYSTEM_PROGRAM = Pubkey.from_string(SYSTEM_PROGRAM_ID)
_SYSVAR_OWNER = Pubkey.from_string(SYSVAR_OWNER_ID)
_INVOKE_DEPTH = re.compile(r" invoke \[(\d+)\]$")


# ---------------------------------------------------------------------------------------------
# Clocks


class Clock(Protocol):
    def now(self) -> int: ...

    def advance(self, seconds: int) -> None: ...


class WallClock:
    """Unix time, plus an offset that `advance` moves forward (to skip waiting)."""

    def __init__(self) -> None:
        self._offset = 0
        self._lock = threading.Lock()

    def now(self) -> int:
        with self._lock:
            return int(time.time()) + self._offset

    def advance(self, seconds: int) -> None:
        with self._lock:
            self._offset += seconds


class ManualClock:
    """A clock that only moves when told to (deterministic tests)."""

    def __init__(self, start: int = 1_700_000_000) -> None:
        self._now = start
        self._lock = threading.Lock()

    def now(self) -> int:
        with self._lock:
            return self._now

    def advance(self, seconds: int) -> None:
        with self._lock:
            self._now += seconds

    def set(self, unix_timestamp: int) -> None:
        with self._lock:
            self._now = unix_timestamp


# ---------------------------------------------------------------------------------------------
# Errors and records


class TransactionFailed(Exception):
    """A transaction error in the RPC's JSON form (`"BlockhashNotFound"`,
    `{"InstructionError": [0, {"Custom": 6000}]}`, ...), with the logs so far."""

    def __init__(self, err: Any, logs: Sequence[str] = (), units: int = 0) -> None:
        super().__init__(describe_transaction_error(err))
        self.err = err
        self.logs = list(logs)
        self.units = units


def litesvm_error_json(err: Any) -> Any:
    """The RPC JSON form of a solders/LiteSVM `TransactionError`."""
    import solders.transaction_status as ts

    if isinstance(err, ts.TransactionErrorInstructionError):
        return {"InstructionError": [err.index, _instruction_error_json(err.err)]}
    if isinstance(err, ts.TransactionErrorInsufficientFundsForRent):
        return {"InsufficientFundsForRent": {"account_index": err.account_index}}
    if isinstance(err, ts.TransactionErrorDuplicateInstruction):
        return {"DuplicateInstruction": err.index}
    return str(err).rsplit(".", 1)[-1]


def _instruction_error_json(err: Any) -> Any:
    import solders.transaction_status as ts

    if isinstance(err, ts.InstructionErrorCustom):
        return {"Custom": err.code}
    if isinstance(err, ts.InstructionErrorBorshIO):
        return {"BorshIoError": err.value if hasattr(err, "value") else str(err)}
    return str(err).rsplit(".", 1)[-1]


@dataclass
class TransactionRecord:
    """A transaction that landed (successfully or not)."""

    signature: Signature
    slot: int
    block_time: int
    transaction: VersionedTransaction
    err: Any
    logs: list[str]
    fee: int
    units: int
    pre_balances: list[int]
    post_balances: list[int]


@dataclass
class ExecutionResult:
    signature: Signature
    err: Any
    logs: list[str]
    units: int
    accounts: dict[Pubkey, Account | None] = field(default_factory=dict)


# A program written in Python: runs one instruction, raising InstructionFailure to fail it.
PythonProgram = Callable[[InvokeContext], None]

# (slot, changed account keys, landed transaction or None)
Listener = Callable[[int, list[Pubkey], TransactionRecord | None], None]


# ---------------------------------------------------------------------------------------------
# The ledger


class Ledger:
    def __init__(
        self,
        program_ids: ProgramIds = DEFAULT_PROGRAM_IDS,
        clock: Clock | None = None,
        *,
        with_psyche_programs: bool = True,
    ) -> None:
        self.program_ids = program_ids
        self.clock: Clock = clock if clock is not None else WallClock()
        self._lock = threading.RLock()
        self._svm = (
            LiteSVM().with_sigverify(False).with_blockhash_check(False).with_transaction_history(0)
        )
        self._internal_payer = Keypair()
        self._svm.set_account(
            self._internal_payer.pubkey(), Account(INTERNAL_PAYER_LAMPORTS, b"", _SYSTEM_PROGRAM)
        )
        self.slot = 1
        self.genesis_hash = Hash.new_unique()
        self._blockhashes: OrderedDict[Hash, int] = OrderedDict()  # blockhash -> slot
        self._new_blockhash()
        self._history: OrderedDict[Signature, TransactionRecord] = OrderedDict()
        self._listeners: list[Listener] = []
        self.programs: dict[Pubkey, PythonProgram] = {ED25519_PROGRAM: ed25519_program}
        self._running: list[Instruction] | None = None
        self._running_index = 0
        self.transaction_count = 0
        self._known_keys: set[Pubkey] = set()
        self._sync_clock()
        if with_psyche_programs:
            from psyche.solana.localnet import (
                authorizer_program,
                coordinator_program,
                treasurer_program,
            )

            self.programs[program_ids.coordinator_key] = coordinator_program.process
            self.programs[program_ids.authorizer_key] = authorizer_program.process
            self.programs[program_ids.treasurer_key] = treasurer_program.process

    # ---- listeners ----------------------------------------------------------------------

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _notify(self, keys: list[Pubkey], record: TransactionRecord | None) -> None:
        for listener in list(self._listeners):
            listener(self.slot, keys, record)

    # ---- reads --------------------------------------------------------------------------

    def get_account(self, key: Pubkey) -> Account | None:
        with self._lock:
            if key == SYSVAR_INSTRUCTIONS and self._running is not None:
                data = serialize_instructions(self._running, self._running_index)
                return Account(self._svm.minimum_balance_for_rent_exemption(len(data)), data,
                               _SYSVAR_OWNER)  # fmt: skip
            account = self._svm.get_account(key)
            if account is None or (account.lamports == 0 and not account.executable):
                return None
            return account

    def get_balance(self, key: Pubkey) -> int:
        account = self.get_account(key)
        return 0 if account is None else account.lamports

    def minimum_balance_for_rent_exemption(self, space: int) -> int:
        with self._lock:
            return int(self._svm.minimum_balance_for_rent_exemption(space))

    def unix_timestamp(self) -> int:
        return self.clock.now()

    @property
    def block_height(self) -> int:
        return self.slot

    def latest_blockhash(self) -> tuple[Hash, int]:
        """The newest blockhash and the last block height at which it is valid."""
        with self._lock:
            blockhash = next(reversed(self._blockhashes))
            return blockhash, self._blockhashes[blockhash] + MAX_PROCESSING_AGE

    def is_blockhash_valid(self, blockhash: Hash) -> bool:
        with self._lock:
            slot = self._blockhashes.get(blockhash)
            return slot is not None and self.slot - slot <= MAX_PROCESSING_AGE

    def get_transaction(self, signature: Signature) -> TransactionRecord | None:
        with self._lock:
            return self._history.get(signature)

    def program_accounts(self, owner: Pubkey) -> list[tuple[Pubkey, Account]]:
        """Accounts owned by `owner` among those any transaction has touched."""
        with self._lock:
            found = []
            for key in self._known_keys:
                account = self.get_account(key)
                if account is not None and account.owner == owner:
                    found.append((key, account))
            return sorted(found, key=lambda item: str(item[0]))

    # ---- administration -------------------------------------------------------------------

    def set_account(self, key: Pubkey, account: Account) -> None:
        """Put an account in place directly (fixtures, faucets); listeners are told."""
        with self._lock:
            self._known_keys.add(key)
            self._svm.set_account(key, account)
            self._advance_slot()
            self._notify([key], None)

    def airdrop(self, key: Pubkey, lamports: int) -> Signature:
        """Send lamports from the internal faucet with a real system transfer."""
        from solders import system_program

        with self._lock:
            logs: list[str] = []
            snapshot = self._snapshot([key])
            try:
                self._run_in_svm(
                    system_program.transfer(
                        system_program.TransferParams(
                            from_pubkey=self._internal_payer.pubkey(),
                            to_pubkey=key,
                            lamports=lamports,
                        )
                    ),
                    {self._internal_payer.pubkey()},
                    1,
                    logs,
                )
            except InstructionFailure as failure:
                self._restore(snapshot)
                raise TransactionFailed({"InstructionError": [0, failure.detail]}, logs) from None
            signature = Signature.from_bytes(
                hashlib.sha512(
                    b"airdrop" + bytes(key) + str(self.transaction_count).encode()
                ).digest()
            )
            blockhash, _ = self.latest_blockhash()
            message = Message.new_with_blockhash([], self._internal_payer.pubkey(), blockhash)
            tx = VersionedTransaction.populate(message, [signature])
            record = TransactionRecord(
                signature, self.slot, self.clock.now(), tx, None, logs, 0, 0, [], []
            )
            self._land(record, [key])
            return signature

    def advance_clock(self, seconds: int) -> None:
        with self._lock:
            self.clock.advance(seconds)
            self._sync_clock()

    # ---- transactions ---------------------------------------------------------------------

    def process_transaction(self, raw: bytes | Transaction | VersionedTransaction) -> Signature:
        """Execute and record a transaction; raises TransactionFailed when it is rejected before
        execution (bad signature, unknown blockhash, ...). A transaction that fails while
        executing lands (its fee is charged) and its error is in its record."""
        with self._lock:
            tx = self._parse(raw)
            result = self._execute(tx, simulate=False)
            return result.signature

    def simulate_transaction(
        self,
        raw: bytes | Transaction | VersionedTransaction,
        *,
        sig_verify: bool = True,
        return_accounts: Sequence[Pubkey] = (),
    ) -> ExecutionResult:
        """Run a transaction and roll everything back (preflight)."""
        with self._lock:
            tx = self._parse(raw)
            return self._execute(
                tx, simulate=True, sig_verify=sig_verify, return_accounts=return_accounts
            )

    def _parse(self, raw: bytes | Transaction | VersionedTransaction) -> VersionedTransaction:
        if isinstance(raw, VersionedTransaction):
            return raw
        if isinstance(raw, Transaction):
            return VersionedTransaction.from_legacy(raw)
        if len(raw) > MAX_TRANSACTION_SIZE:
            raise TransactionFailed("SanitizeFailure")
        try:
            return VersionedTransaction.from_bytes(bytes(raw))
        except Exception:
            raise TransactionFailed("SanitizeFailure") from None

    def _execute(
        self,
        tx: VersionedTransaction,
        *,
        simulate: bool,
        sig_verify: bool = True,
        return_accounts: Sequence[Pubkey] = (),
    ) -> ExecutionResult:
        message = tx.message
        if isinstance(message, MessageV0) and message.address_table_lookups:
            raise TransactionFailed("AddressLookupTableNotFound")
        keys = list(message.account_keys)
        header = message.header
        signatures = list(tx.signatures)
        if not keys or len(signatures) != header.num_required_signatures or not signatures:
            raise TransactionFailed("SanitizeFailure")
        signature = signatures[0]
        if sig_verify and not all(tx.verify_with_results()):
            raise TransactionFailed("SignatureFailure")
        if not simulate and signature in self._history:
            raise TransactionFailed("AlreadyProcessed")
        if sig_verify and not self.is_blockhash_valid(message.recent_blockhash):
            raise TransactionFailed("BlockhashNotFound")

        fee_payer = keys[0]
        fee = message_fee(message)
        payer_account = self.get_account(fee_payer)
        if payer_account is None:
            raise TransactionFailed("AccountNotFound")
        if payer_account.owner != _SYSTEM_PROGRAM:
            raise TransactionFailed("InvalidAccountForFee")
        if payer_account.lamports < fee:
            raise TransactionFailed("InsufficientFundsForFee")

        self._sync_clock()
        snapshot = self._snapshot(keys)
        pre_balances = [0 if (acc := snapshot.get(k)) is None else acc.lamports for k in keys]
        self._svm.set_account(
            fee_payer, _with_lamports(payer_account, payer_account.lamports - fee)
        )
        charged = self._snapshot([fee_payer])

        program_ids = {keys[ix.program_id_index] for ix in message.instructions}
        signers = {keys[i] for i in range(header.num_required_signatures)}
        logs: list[str] = []
        err: Any = None
        units = 0
        self._running = [
            Instruction(
                keys[compiled.program_id_index],
                bytes(compiled.data),
                [
                    AccountMeta(
                        keys[i],
                        i < header.num_required_signatures,
                        _is_writable(message, i, keys[i], program_ids),
                    )
                    for i in compiled.accounts
                ],
            )
            for compiled in message.instructions
        ]
        try:
            for index, instruction in enumerate(self._running):
                self._running_index = index  # what the instructions sysvar says
                try:
                    units += self.invoke(instruction, signers, 1, logs)
                except InstructionFailure as failure:
                    err = {"InstructionError": [index, failure.detail]}
                    break
        finally:
            self._running = None

        returned = {k: self.get_account(k) for k in return_accounts}
        if simulate:
            self._restore(snapshot)
            return ExecutionResult(signature, err, logs, units, returned)
        changed = keys if err is None else [fee_payer]
        if err is not None:
            self._restore({k: v for k, v in snapshot.items() if k != fee_payer})
            self._restore(charged)
        post_balances = [self.get_balance(k) for k in keys]
        record = TransactionRecord(
            signature,
            self.slot,
            self.clock.now(),
            tx,
            err,
            logs,
            fee,
            units,
            pre_balances,
            post_balances,
        )
        self._land(
            record, [k for k in changed if _is_writable(message, keys.index(k), k, program_ids)]
        )
        return ExecutionResult(signature, err, logs, units, returned)

    def _land(self, record: TransactionRecord, changed: list[Pubkey]) -> None:
        self._known_keys.update(record.transaction.message.account_keys)
        self._known_keys.update(changed)
        self._history[record.signature] = record
        while len(self._history) > TRANSACTION_HISTORY:
            self._history.popitem(last=False)
        self.transaction_count += 1
        self._advance_slot()
        self._notify(changed, record)

    # ---- instruction dispatch ---------------------------------------------------------------

    def invoke(
        self, instruction: Instruction, signers: set[Pubkey], depth: int, logs: list[str]
    ) -> int:
        """Run one instruction (top level when depth is 1, else a CPI); returns compute units.
        Raises InstructionFailure."""
        if depth > MAX_CPI_DEPTH:
            raise InstructionFailure("CallDepth")
        program = self.programs.get(instruction.program_id)
        if program is None:
            return self._run_in_svm(instruction, signers, depth, logs)
        for meta in instruction.accounts:
            if meta.is_signer and meta.pubkey not in signers:
                raise InstructionFailure("MissingRequiredSignature")
        program_id = instruction.program_id
        logs.append(f"Program {program_id} invoke [{depth}]")
        ctx = InvokeContext(
            self, program_id, list(instruction.accounts), bytes(instruction.data), depth, logs
        )
        try:
            program(ctx)
        except AnchorError as e:
            logs.append(f"Program log: {e.log_line()}")
            logs.append(f"Program {program_id} failed: custom program error: 0x{e.code:x}")
            raise
        except ProgramPanic as e:
            logs.append(f"Program log: panicked at '{e.panic_message}'")
            logs.append(f"Program {program_id} failed: SBF program panicked")
            raise
        except InstructionFailure as e:
            logs.append(f"Program {program_id} failed: {describe_instruction_error(e.detail)}")
            raise
        except Exception as e:  # a bug in a Python port: fail the instruction, keep the ledger
            log.exception("program %s raised", program_id)
            logs.append(f"Program log: internal error in the Python program: {e!r}")
            logs.append(f"Program {program_id} failed: SBF program panicked")
            raise ProgramPanic(f"internal error: {e!r}") from e
        logs.append(f"Program {program_id} success")
        return 0

    def _run_in_svm(
        self, instruction: Instruction, signers: set[Pubkey], depth: int, logs: list[str]
    ) -> int:
        for meta in instruction.accounts:
            if meta.is_signer and meta.pubkey not in signers:
                raise InstructionFailure("MissingRequiredSignature")
        blockhash = self._svm.latest_blockhash()
        message = Message.new_with_blockhash(
            [instruction], self._internal_payer.pubkey(), blockhash
        )
        tx = Transaction.populate(
            message, [Signature.default()] * message.header.num_required_signatures
        )
        result = self._svm.send_transaction(tx)
        tx_meta = result.meta() if isinstance(result, FailedTransactionMetadata) else result
        for line in tx_meta.logs():
            logs.append(_INVOKE_DEPTH.sub(lambda m: f" invoke [{int(m[1]) + depth - 1}]", line))
        if isinstance(result, FailedTransactionMetadata):
            err = litesvm_error_json(result.err())
            if isinstance(err, dict) and "InstructionError" in err:
                raise InstructionFailure(err["InstructionError"][1])
            raise InstructionFailure(
                "InvalidProgramForExecution"
                if err in ("InvalidProgramForExecution", "ProgramAccountNotFound")
                else "GenericError",
                str(err),
            )
        return int(tx_meta.compute_units_consumed())

    def running_instruction_datas(self) -> list[bytes]:
        """The data of each instruction of the transaction being executed (what a precompile
        reads where its offsets name another instruction)."""
        return [bytes(ix.data) for ix in self._running or ()]

    def write_account(self, key: Pubkey, account: Account) -> None:
        self._svm.set_account(key, account)

    # ---- internals --------------------------------------------------------------------------

    def _snapshot(self, keys: Iterable[Pubkey]) -> dict[Pubkey, Account | None]:
        out: dict[Pubkey, Account | None] = {}
        for key in keys:
            account = self._svm.get_account(key)
            if account is not None and account.executable:
                continue  # programs cannot change; restoring them would reload them
            out[key] = account
        return out

    def _restore(self, snapshot: dict[Pubkey, Account | None]) -> None:
        for key, account in snapshot.items():
            self._svm.set_account(
                key, account if account is not None else Account(0, b"", _SYSTEM_PROGRAM)
            )

    def _new_blockhash(self) -> None:
        self._svm.expire_blockhash()
        blockhash = self._svm.latest_blockhash()
        self._blockhashes[blockhash] = self.slot
        while len(self._blockhashes) > RECENT_BLOCKHASHES:
            self._blockhashes.popitem(last=False)

    def _advance_slot(self) -> None:
        self.slot += 1
        self._new_blockhash()
        self._sync_clock()

    def _sync_clock(self) -> None:
        from solders.clock import Clock as SvmClock

        current = self._svm.get_clock()
        self._svm.set_clock(
            SvmClock(
                slot=self.slot,
                epoch_start_timestamp=current.epoch_start_timestamp,
                epoch=current.epoch,
                leader_schedule_epoch=current.leader_schedule_epoch,
                unix_timestamp=self.clock.now(),
            )
        )


def message_fee(message: Message | MessageV0) -> int:
    """The fee of a transaction of `message` (agave's `calculate_signature_fee`, no priority
    fee): `LAMPORTS_PER_SIGNATURE` for each signature it carries and each precompile signature
    its `Ed25519SigVerify` instructions claim (`precompile_signature_count`: the first data
    byte, paid whether or not the instruction verifies)."""
    keys = message.account_keys
    precompiled = precompile_signature_count(
        [
            (keys[ix.program_id_index], bytes(ix.data))
            for ix in message.instructions
            if ix.program_id_index < len(keys)  # a malformed message given to getFeeForMessage
        ]
    )
    return LAMPORTS_PER_SIGNATURE * (message.header.num_required_signatures + precompiled)


def _is_writable(message: Any, index: int, key: Pubkey, program_ids: set[Pubkey]) -> bool:
    header = message.header
    num_keys = len(message.account_keys)
    if index < header.num_required_signatures:
        writable = index < header.num_required_signatures - header.num_readonly_signed_accounts
    else:
        writable = index < num_keys - header.num_readonly_unsigned_accounts
    # The runtime demotes programs called by the transaction to read-only.
    return writable and key not in program_ids


def _with_lamports(account: Account, lamports: int) -> Account:
    return Account(
        lamports, bytes(account.data), account.owner, account.executable, account.rent_epoch
    )


def encode_account_data(data: bytes, encoding: str) -> list[str]:
    """Account data as an RPC `[data, encoding]` pair (base64, or zstd-compressed base64)."""
    if encoding == "base64+zstd":
        import zstandard

        return [base64.b64encode(zstandard.ZstdCompressor().compress(data)).decode(), encoding]
    return [base64.b64encode(data).decode(), "base64"]
