"""The Psyche programs' on-chain accounts and how their bytes are read and written.

Two encodings, kept apart:

* `CoordinatorAccount` (the big zero-copy account, 119 160 bytes) is the Rust structs' memory
  layout, read and written by `psyche.solana.repr_c` with `COORDINATOR_LAYOUT_RULES`;
* every other account (`CoordinatorInstance`, `Authorization`, the treasurer's `Run` and
  `Participant`) is an 8-byte discriminator followed by borsh.

The coordinator's own types (`Coordinator` and everything in it) are `psyche.coordinator`'s; the
types here are the Solana program's wrappers around them.
"""

from __future__ import annotations

import dataclasses
import enum
import struct as _struct
from typing import Annotated, Any, TypeVar

from psyche.coordinator import ClientState, Coordinator, RunState
from psyche.coordinator.model import GcsRepo, HubRepo
from psyche.core.definitions import DilocoTransmission
from psyche.core.node_identity import NodeIdentity
from psyche.core.serde import I64, U8, U64, FixedBytes, FixedStr, FixedVec, SmallBool, struct
from psyche.solana.anchor import DISCRIMINATOR_LEN, account_discriminator
from psyche.solana.borsh import BorshError, take_borsh, to_borsh
from psyche.solana.pubkey import SYSTEM_PROGRAM_ID, Pubkey, pubkey_bytes
from psyche.solana.repr_c import ReprC, ReprCError, ReprCRules

T = TypeVar("T")

SOLANA_MAX_NUM_PENDING_CLIENTS = 256
CLIENT_VERSION_LEN = 96
JOIN_RUN_AUTHORIZATION_SCOPE = b"CoordinatorJoinRun"

# ---------------------------------------------------------------------------------------------
# The zero-copy coordinator account


@struct
class RunMetadata:
    """What a run shows about itself (name, description, size); changeable while running."""

    name: Annotated[str, FixedStr(64)] = ""
    description: Annotated[str, FixedStr(280)] = ""
    num_parameters: U64 = 0
    vocab_size: U64 = 0


@struct
class SolanaClient:
    """A client known to the run (upstream `psyche_solana_coordinator::Client`).

    `active` equal to the run's `next_active` means "joined for the coming epoch"; `earned` and
    `slashed` are reward points.
    """

    id: NodeIdentity
    unused: Annotated[bytes, FixedBytes(8)] = bytes(8)
    earned: U64 = 0
    slashed: U64 = 0
    active: U64 = 0

    def claimable(self) -> int:
        """The points the treasurer pays for: `earned` less `slashed` (never below 0).
        Upstream pays `earned`; its clients are never slashed (nothing ejects one), so the two
        agree there; a member slashed for losing a verification dispute
        (`psyche.solana.verification`) loses that much of its reward."""
        return max(0, self.earned - self.slashed)


@struct
class ClientsEpochRates:
    earning_rate_total_shared: U64 = 0
    slashing_rate_per_client: U64 = 0


@struct
class ClientsState:
    clients: Annotated[list[SolanaClient], FixedVec(SOLANA_MAX_NUM_PENDING_CLIENTS)] = (
        dataclasses.field(default_factory=list)
    )
    next_active: U64 = 0
    current_epoch_rates: ClientsEpochRates = dataclasses.field(default_factory=ClientsEpochRates)
    future_epoch_rates: ClientsEpochRates = dataclasses.field(default_factory=ClientsEpochRates)

    def get_active_clients_ids(self) -> list[NodeIdentity]:
        """Clients that joined for the coming epoch, in join order."""
        return [c.id for c in self.clients if c.active == self.next_active]

    def find_signer(self, signer: bytes) -> NodeIdentity | None:
        for client in self.clients:
            if client.id.signer == signer:
                return client.id
        return None


@struct(kw_only=True)
class CoordinatorInstanceState:
    metadata: RunMetadata = dataclasses.field(default_factory=RunMetadata)
    coordinator: Coordinator
    clients_state: ClientsState = dataclasses.field(default_factory=ClientsState)
    is_warmup_first_tick: SmallBool = False
    is_training_first_tick: SmallBool = False
    client_version: Annotated[str, FixedStr(CLIENT_VERSION_LEN)] = ""


@struct(kw_only=True)
class CoordinatorAccount:
    version: U64 = 1
    state: CoordinatorInstanceState
    nonce: U64 = 0

    VERSION = 1

    @classmethod
    def zeroed(cls) -> CoordinatorAccount:
        """What `init_coordinator` starts from: every byte zero."""
        return cls(
            version=0,
            state=CoordinatorInstanceState(coordinator=Coordinator.zeroed()),
            nonce=0,
        )


# `RunState` and `ClientState` are `#[repr(u8)]`; `HubRepo` and `GcsRepo` are not `repr(C)` and
# rustc stores their `Option` field first (confirmed against the upstream account dumps).
# `DilocoTransmission` (a port extension) is one byte so that `DiLoCo` fits Distro's 28 bytes.
COORDINATOR_LAYOUT_RULES = ReprCRules(
    u8_enums=frozenset({RunState, ClientState, DilocoTransmission}),
    field_orders={HubRepo: ("revision", "repo_id"), GcsRepo: ("prefix", "bucket")},
)
REPR_C = ReprC(COORDINATOR_LAYOUT_RULES)

COORDINATOR_ACCOUNT_DISCRIMINATOR = account_discriminator("CoordinatorAccount")
COORDINATOR_ACCOUNT_SPACE = DISCRIMINATOR_LEN + REPR_C.layout(CoordinatorAccount).size
# The pre-`version` layout (June 2025): recognised, not decoded.
COORDINATOR_ACCOUNT_V0_SPACE = 119_072
_NONCE_OFFSET = DISCRIMINATOR_LEN + REPR_C.layout(CoordinatorAccount).offset_of("nonce")
_VERSION_OFFSET = DISCRIMINATOR_LEN + REPR_C.layout(CoordinatorAccount).offset_of("version")
_U64 = _struct.Struct("<Q")


class CoordinatorAccountErrorKind(enum.Enum):
    IncorrectSize = "IncorrectSize"
    InvalidDiscriminator = "InvalidDiscriminator"
    InvalidVersion = "InvalidVersion"
    UnsupportedLayoutVersion = "UnsupportedLayoutVersion"
    InvalidContent = "InvalidContent"


class CoordinatorAccountError(ValueError):
    """Bytes that are not a coordinator account this code can read (upstream
    `DeserializeCoordinatorFromBytes`, plus the layout-version and content errors)."""

    def __init__(self, kind: CoordinatorAccountErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _check_coordinator_account_bytes(data: bytes | bytearray | memoryview) -> None:
    size = len(data)
    disc = bytes(data[:DISCRIMINATOR_LEN])
    if size != COORDINATOR_ACCOUNT_SPACE:
        if size == COORDINATOR_ACCOUNT_V0_SPACE and disc == COORDINATOR_ACCOUNT_DISCRIMINATOR:
            raise CoordinatorAccountError(
                CoordinatorAccountErrorKind.UnsupportedLayoutVersion,
                f"unsupported layout version: this is a v0 coordinator account (the layout before "
                f"the version field, {COORDINATOR_ACCOUNT_V0_SPACE} bytes); only version "
                f"{CoordinatorAccount.VERSION} ({COORDINATOR_ACCOUNT_SPACE} bytes) can be read. "
                "Upstream's current programs reject it too (IncorrectSize).",
            )
        raise CoordinatorAccountError(
            CoordinatorAccountErrorKind.IncorrectSize,
            f"Coordinator has an incorrect size. Expected {COORDINATOR_ACCOUNT_SPACE}, got {size}.",
        )
    if disc != COORDINATOR_ACCOUNT_DISCRIMINATOR:
        raise CoordinatorAccountError(
            CoordinatorAccountErrorKind.InvalidDiscriminator,
            "Coordinator has an invalid discriminator. Expected "
            f"{list(COORDINATOR_ACCOUNT_DISCRIMINATOR)}, got {list(disc)}.",
        )
    (version,) = _U64.unpack_from(data, _VERSION_OFFSET)
    if version != CoordinatorAccount.VERSION:
        raise CoordinatorAccountError(
            CoordinatorAccountErrorKind.InvalidVersion,
            f"Coordinator has an invalid version. Expected {CoordinatorAccount.VERSION}, "
            f"got {version}.",
        )


def coordinator_account_from_bytes(data: bytes | bytearray | memoryview) -> CoordinatorAccount:
    """Decode a coordinator account's data (discriminator included), checked as upstream."""
    _check_coordinator_account_bytes(data)
    try:
        account: CoordinatorAccount = REPR_C.decode(data, CoordinatorAccount, DISCRIMINATOR_LEN)
    except ReprCError as e:
        raise CoordinatorAccountError(
            CoordinatorAccountErrorKind.InvalidContent, f"invalid coordinator account: {e}"
        ) from e
    return account


def coordinator_account_to_bytes(account: CoordinatorAccount) -> bytes:
    """The account data (discriminator included); padding and unused slots are zero."""
    buf = bytearray(COORDINATOR_ACCOUNT_SPACE)
    buf[:DISCRIMINATOR_LEN] = COORDINATOR_ACCOUNT_DISCRIMINATOR
    REPR_C.encode_into(account, CoordinatorAccount, buf, DISCRIMINATOR_LEN)
    return bytes(buf)


def coordinator_account_nonce(data: bytes | bytearray | memoryview) -> int:
    """The nonce of a (checked) coordinator account without decoding the rest."""
    _check_coordinator_account_bytes(data)
    (nonce,) = _U64.unpack_from(data, _NONCE_OFFSET)
    return int(nonce)


# ---------------------------------------------------------------------------------------------
# borsh accounts


@struct
class CoordinatorInstance:
    """The run's PDA (`["coordinator", run_id]`): who owns it and where its state lives."""

    bump: U8
    main_authority: Pubkey
    join_authority: Pubkey
    coordinator_account: Pubkey
    run_id: str

    SEEDS_PREFIX = b"coordinator"
    # 8 + 1 + 3 * 32 + (4 + 64): run_id has room for 64 bytes.
    SPACE = 173


@struct
class Authorization:
    """A grantor allows a grantee (or anyone, when the grantee is the zero key) and its
    delegates to act within a scope; PDA `["Authorization", grantor, grantee, scope]`."""

    bump: U8
    grantor: Pubkey
    grantee: Pubkey
    scope: bytes
    active: bool
    delegates: list[Pubkey]
    grantor_update_unix_timestamp: I64

    SEEDS_PREFIX = b"Authorization"

    @staticmethod
    def space_with_discriminator(scope_len: int, delegates_len: int) -> int:
        return 8 + 1 + 32 + 32 + (4 + scope_len) + 1 + (4 + 32 * delegates_len) + 8

    def is_valid_for(self, grantor: Any, grantee: Any, scope: bytes) -> bool:
        grantor, grantee = pubkey_bytes(grantor), pubkey_bytes(grantee)
        if not self.active or self.grantor != grantor or self.scope != bytes(scope):
            return False
        return (
            self.grantee == SYSTEM_PROGRAM_ID
            or self.grantee == grantee
            or grantee in self.delegates
        )


@struct
class TreasurerRun:
    """The treasurer's run PDA (`["Run", index]`); upstream calls it `Run`."""

    bump: U8
    index: U64
    main_authority: Pubkey
    join_authority: Pubkey
    coordinator_account: Pubkey
    coordinator_instance: Pubkey
    collateral_mint: Pubkey
    total_claimed_collateral_amount: U64
    total_claimed_earned_points: U64

    SEEDS_PREFIX = b"Run"
    ACCOUNT_NAME = "Run"
    # 8 + size_of::<Run>() (repr(Rust): 8+8+8 + 5*32 + 1, rounded to 8)
    SPACE = 200


@struct
class Participant:
    bump: U8
    claimed_collateral_amount: U64
    claimed_earned_points: U64

    SEEDS_PREFIX = b"Participant"
    SPACE = 32


class AccountDecodeError(ValueError):
    """Account data that is not the expected Anchor account."""


def anchor_account_name(tp: type) -> str:
    return str(getattr(tp, "ACCOUNT_NAME", tp.__name__))


def encode_anchor_account(value: Any, tp: type | None = None, space: int | None = None) -> bytes:
    """Discriminator + borsh, zero padded to `space` when given."""
    tp = type(value) if tp is None else tp
    data = account_discriminator(anchor_account_name(tp)) + to_borsh(value, tp)
    if space is not None:
        if len(data) > space:
            raise AccountDecodeError(f"{tp.__name__} needs {len(data)} bytes, space is {space}")
        data += bytes(space - len(data))
    return data


def decode_anchor_account(data: bytes | bytearray | memoryview, tp: type[T]) -> T:
    """Anchor's `try_deserialize`: check the discriminator, then borsh (trailing bytes allowed)."""
    name = anchor_account_name(tp)
    if len(data) < DISCRIMINATOR_LEN:
        raise AccountDecodeError(f"{name}: account data too short ({len(data)} bytes)")
    if bytes(data[:DISCRIMINATOR_LEN]) != account_discriminator(name):
        raise AccountDecodeError(f"{name}: account discriminator mismatch")
    try:
        value, _ = take_borsh(memoryview(data)[DISCRIMINATOR_LEN:], tp)
    except BorshError as e:
        raise AccountDecodeError(f"{name}: {e}") from e
    return value
