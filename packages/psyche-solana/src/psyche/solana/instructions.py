"""Every instruction of the coordinator, authorizer and treasurer programs: arguments, accounts,
and builders of solders `Instruction`s.

An `InstructionSpec` is one upstream instruction: its snake_case name (which gives the Anchor
discriminator), its accounts in the order and with the flags of upstream's `#[derive(Accounts)]`
struct, and a struct whose fields are the instruction's arguments in declaration order (borsh
encodes them back to back, which is exactly how Anchor lays out several arguments).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from solders.instruction import AccountMeta, Instruction
from solders.pubkey import Pubkey as SoldersPubkey

from psyche.coordinator.committee_selection import Committee, CommitteeProof, WitnessProof
from psyche.coordinator.config import CoordinatorConfig
from psyche.coordinator.coordinator import CoordinatorProgress, Witness, WitnessMetadata
from psyche.coordinator.model import Checkpoint, Model
from psyche.core.bloom import WitnessBloom
from psyche.core.merkle_tree import MerkleRoot
from psyche.core.node_identity import NodeIdentity
from psyche.core.serde import U64, struct
from psyche.solana import pda
from psyche.solana.anchor import DISCRIMINATOR_LEN, instruction_discriminator
from psyche.solana.borsh import BorshError, take_borsh, to_borsh
from psyche.solana.program_ids import (
    ASSOCIATED_TOKEN_PROGRAM_ID,
    DEFAULT_PROGRAM_IDS,
    SYSTEM_PROGRAM_ID,
    TOKEN_PROGRAM_ID,
    ProgramIds,
)
from psyche.solana.pubkey import Pubkey, pubkey_bytes, to_solders
from psyche.solana.state import JOIN_RUN_AUTHORIZATION_SCOPE, RunMetadata

# ---------------------------------------------------------------------------------------------
# Argument types


@struct(frozen=True)
class InitCoordinatorParams:
    main_authority: Pubkey
    join_authority: Pubkey
    run_id: str
    client_version: str


@struct(frozen=True)
class FreeCoordinatorParams:
    pass


@struct(frozen=True)
class JoinRunParams:
    client_id: NodeIdentity


@struct(frozen=True)
class AuthorizationCreateParams:
    grantee: Pubkey
    scope: bytes


@struct(frozen=True)
class AuthorizationGrantorUpdateParams:
    active: bool


@struct(frozen=True)
class AuthorizationGranteeUpdateParams:
    delegates_clear: bool
    delegates_added: list[Pubkey]


@struct(frozen=True)
class AuthorizationCloseParams:
    pass


@struct(frozen=True)
class RunCreateParams:
    index: U64
    run_id: str
    client_version: str
    main_authority: Pubkey
    join_authority: Pubkey


@struct(frozen=True, kw_only=True)
class RunUpdateParams:
    metadata: RunMetadata | None = None
    config: CoordinatorConfig | None = None
    model: Model | None = None
    progress: CoordinatorProgress | None = None
    epoch_earning_rate_total_shared: U64 | None = None
    epoch_slashing_rate_per_client: U64 | None = None
    paused: bool | None = None
    client_version: str | None = None


@struct(frozen=True)
class ParticipantCreateParams:
    pass


@struct(frozen=True)
class ParticipantClaimParams:
    claim_earned_points: U64


# One struct per instruction: its fields are the instruction's arguments.


@struct(frozen=True)
class InitCoordinatorArgs:
    params: InitCoordinatorParams


@struct(frozen=True)
class FreeCoordinatorArgs:
    params: FreeCoordinatorParams = FreeCoordinatorParams()


@struct(frozen=True, kw_only=True)
class UpdateArgs:
    metadata: RunMetadata | None = None
    config: CoordinatorConfig | None = None
    model: Model | None = None
    progress: CoordinatorProgress | None = None


@struct(frozen=True)
class UpdateClientVersionArgs:
    new_version: str


@struct(frozen=True)
class SetFutureEpochRatesArgs:
    epoch_earning_rate_total_shared: U64 | None = None
    epoch_slashing_rate_per_client: U64 | None = None


@struct(frozen=True)
class JoinRunArgs:
    params: JoinRunParams


@struct(frozen=True)
class SetPausedArgs:
    paused: bool


@struct(frozen=True)
class TickArgs:
    pass


@struct
class WitnessArgs:
    proof: WitnessProof
    participant_bloom: WitnessBloom
    broadcast_bloom: WitnessBloom
    broadcast_merkle: MerkleRoot
    # Ignored by the program (kept for indexers).
    metadata: WitnessMetadata

    @classmethod
    def from_witness(cls, witness: Witness, metadata: WitnessMetadata) -> WitnessArgs:
        return cls(
            witness.proof,
            witness.participant_bloom,
            witness.broadcast_bloom,
            witness.broadcast_merkle,
            metadata,
        )

    def witness(self) -> Witness:
        return Witness(
            self.proof, self.participant_bloom, self.broadcast_bloom, self.broadcast_merkle
        )


@struct
class WarmupWitnessArgs:
    proof: WitnessProof
    participant_bloom: WitnessBloom
    broadcast_bloom: WitnessBloom
    broadcast_merkle: MerkleRoot

    @classmethod
    def from_witness(cls, witness: Witness) -> WarmupWitnessArgs:
        return cls(
            witness.proof,
            witness.participant_bloom,
            witness.broadcast_bloom,
            witness.broadcast_merkle,
        )

    def witness(self) -> Witness:
        return Witness(
            self.proof, self.participant_bloom, self.broadcast_bloom, self.broadcast_merkle
        )


@struct(frozen=True)
class HealthCheckArgs:
    id: NodeIdentity
    committee: Committee
    position: U64
    index: U64

    def proof(self) -> CommitteeProof:
        return CommitteeProof(self.committee, self.position, self.index)


@struct(frozen=True)
class CheckpointArgs:
    repo: Checkpoint


@struct(frozen=True)
class AuthorizationCreateArgs:
    params: AuthorizationCreateParams


@struct(frozen=True)
class AuthorizationGrantorUpdateArgs:
    params: AuthorizationGrantorUpdateParams


@struct(frozen=True)
class AuthorizationGranteeUpdateArgs:
    params: AuthorizationGranteeUpdateParams


@struct(frozen=True)
class AuthorizationCloseArgs:
    params: AuthorizationCloseParams = AuthorizationCloseParams()


@struct(frozen=True)
class RunCreateArgs:
    params: RunCreateParams


@struct(frozen=True)
class RunUpdateArgs:
    params: RunUpdateParams


@struct(frozen=True)
class ParticipantCreateArgs:
    params: ParticipantCreateParams = ParticipantCreateParams()


@struct(frozen=True)
class ParticipantClaimArgs:
    params: ParticipantClaimParams


# ---------------------------------------------------------------------------------------------
# Specs


@dataclass(frozen=True)
class AccountSpec:
    name: str
    writable: bool = False
    signer: bool = False


def _w(name: str) -> AccountSpec:
    return AccountSpec(name, writable=True)


def _s(name: str) -> AccountSpec:
    return AccountSpec(name, signer=True)


def _ws(name: str) -> AccountSpec:
    return AccountSpec(name, writable=True, signer=True)


def _r(name: str) -> AccountSpec:
    return AccountSpec(name)


class InstructionDecodeError(ValueError):
    """Instruction data that is not a valid call of the expected instruction."""


@dataclass(frozen=True)
class InstructionSpec:
    program: str  # "coordinator", "authorizer" or "treasurer"
    name: str
    accounts: tuple[AccountSpec, ...]
    args: type

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


_OWNER = (_s("authority"), _r("coordinator_instance"), _w("coordinator_account"))
_PERMISSIONLESS = (_s("user"), _r("coordinator_instance"), _w("coordinator_account"))

COORDINATOR_INSTRUCTIONS: tuple[InstructionSpec, ...] = (
    InstructionSpec(
        "coordinator",
        "init_coordinator",
        (_ws("payer"), _w("coordinator_instance"), _w("coordinator_account"), _r("system_program")),
        InitCoordinatorArgs,
    ),
    InstructionSpec(
        "coordinator",
        "free_coordinator",
        (_s("authority"), _w("spill"), _w("coordinator_instance"), _w("coordinator_account")),
        FreeCoordinatorArgs,
    ),
    InstructionSpec("coordinator", "update", _OWNER, UpdateArgs),
    InstructionSpec("coordinator", "update_client_version", _OWNER, UpdateClientVersionArgs),
    InstructionSpec("coordinator", "set_future_epoch_rates", _OWNER, SetFutureEpochRatesArgs),
    InstructionSpec(
        "coordinator",
        "join_run",
        (_s("user"), _r("authorization"), _r("coordinator_instance"), _w("coordinator_account")),
        JoinRunArgs,
    ),
    InstructionSpec("coordinator", "set_paused", _OWNER, SetPausedArgs),
    InstructionSpec("coordinator", "tick", _PERMISSIONLESS, TickArgs),
    InstructionSpec("coordinator", "witness", _PERMISSIONLESS, WitnessArgs),
    InstructionSpec("coordinator", "warmup_witness", _PERMISSIONLESS, WarmupWitnessArgs),
    InstructionSpec("coordinator", "health_check", _PERMISSIONLESS, HealthCheckArgs),
    InstructionSpec("coordinator", "checkpoint", _PERMISSIONLESS, CheckpointArgs),
)

AUTHORIZER_INSTRUCTIONS: tuple[InstructionSpec, ...] = (
    InstructionSpec(
        "authorizer",
        "authorization_create",
        (_ws("payer"), _s("grantor"), _w("authorization"), _r("system_program")),
        AuthorizationCreateArgs,
    ),
    InstructionSpec(
        "authorizer",
        "authorization_grantor_update",
        (_s("grantor"), _w("authorization")),
        AuthorizationGrantorUpdateArgs,
    ),
    InstructionSpec(
        "authorizer",
        "authorization_grantee_update",
        (_ws("payer"), _s("grantee"), _w("authorization"), _r("system_program")),
        AuthorizationGranteeUpdateArgs,
    ),
    InstructionSpec(
        "authorizer",
        "authorization_close",
        (_s("grantor"), _w("spill"), _w("authorization"), _r("system_program")),
        AuthorizationCloseArgs,
    ),
)

TREASURER_INSTRUCTIONS: tuple[InstructionSpec, ...] = (
    InstructionSpec(
        "treasurer",
        "run_create",
        (
            _ws("payer"),
            _w("run"),
            _w("run_collateral"),
            _r("collateral_mint"),
            _w("coordinator_instance"),
            _w("coordinator_account"),
            _r("coordinator_program"),
            _r("associated_token_program"),
            _r("token_program"),
            _r("system_program"),
        ),
        RunCreateArgs,
    ),
    InstructionSpec(
        "treasurer",
        "run_update",
        (
            _s("authority"),
            _r("run"),
            _r("coordinator_instance"),
            _w("coordinator_account"),
            _r("coordinator_program"),
        ),
        RunUpdateArgs,
    ),
    InstructionSpec(
        "treasurer",
        "participant_create",
        (_ws("payer"), _s("user"), _r("run"), _w("participant"), _r("system_program")),
        ParticipantCreateArgs,
    ),
    InstructionSpec(
        "treasurer",
        "participant_claim",
        (
            _s("user"),
            _w("user_collateral"),
            _w("run"),
            _w("run_collateral"),
            _r("coordinator_account"),
            _w("participant"),
            _r("token_program"),
        ),
        ParticipantClaimArgs,
    ),
)

INSTRUCTIONS: dict[str, dict[str, InstructionSpec]] = {
    "coordinator": {spec.name: spec for spec in COORDINATOR_INSTRUCTIONS},
    "authorizer": {spec.name: spec for spec in AUTHORIZER_INSTRUCTIONS},
    "treasurer": {spec.name: spec for spec in TREASURER_INSTRUCTIONS},
}


def spec_for_data(program: str, data: bytes) -> InstructionSpec | None:
    """The instruction of `program` whose discriminator starts `data`."""
    head = bytes(data[:DISCRIMINATOR_LEN])
    for spec in INSTRUCTIONS[program].values():
        if spec.discriminator == head:
            return spec
    return None


# ---------------------------------------------------------------------------------------------
# Builders (upstream `psyche_solana_rpc::instructions`)


def _spec(program: str, name: str) -> InstructionSpec:
    return INSTRUCTIONS[program][name]


def coordinator_init_coordinator(
    payer: Any,
    run_id: str,
    client_version: str,
    coordinator_account: Any,
    main_authority: Any,
    join_authority: Any,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _spec("coordinator", "init_coordinator").build(
        ids.coordinator,
        {
            "payer": payer,
            "coordinator_instance": pda.find_coordinator_instance(run_id, ids),
            "coordinator_account": coordinator_account,
            "system_program": SYSTEM_PROGRAM_ID,
        },
        InitCoordinatorArgs(
            InitCoordinatorParams(
                pubkey_bytes(main_authority), pubkey_bytes(join_authority), run_id, client_version
            )
        ),
    )


def coordinator_close_run(
    coordinator_instance: Any,
    coordinator_account: Any,
    main_authority: Any,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    """`free_coordinator` with the rent going back to the main authority."""
    return _spec("coordinator", "free_coordinator").build(
        ids.coordinator,
        {
            "authority": main_authority,
            "spill": main_authority,
            "coordinator_instance": coordinator_instance,
            "coordinator_account": coordinator_account,
        },
        FreeCoordinatorArgs(),
    )


def _owner_accounts(
    run_id: str, coordinator_account: Any, main_authority: Any, ids: ProgramIds
) -> dict[str, Any]:
    return {
        "authority": main_authority,
        "coordinator_instance": pda.find_coordinator_instance(run_id, ids),
        "coordinator_account": coordinator_account,
    }


def coordinator_update(
    run_id: str,
    coordinator_account: Any,
    main_authority: Any,
    metadata: RunMetadata | None = None,
    config: CoordinatorConfig | None = None,
    model: Model | None = None,
    progress: CoordinatorProgress | None = None,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _spec("coordinator", "update").build(
        ids.coordinator,
        _owner_accounts(run_id, coordinator_account, main_authority, ids),
        UpdateArgs(metadata=metadata, config=config, model=model, progress=progress),
    )


def coordinator_update_client_version(
    run_id: str,
    coordinator_account: Any,
    main_authority: Any,
    new_version: str,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _spec("coordinator", "update_client_version").build(
        ids.coordinator,
        _owner_accounts(run_id, coordinator_account, main_authority, ids),
        UpdateClientVersionArgs(new_version),
    )


def coordinator_set_future_epoch_rates(
    run_id: str,
    coordinator_account: Any,
    main_authority: Any,
    epoch_earning_rate_total_shared: int | None,
    epoch_slashing_rate_per_client: int | None,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _spec("coordinator", "set_future_epoch_rates").build(
        ids.coordinator,
        _owner_accounts(run_id, coordinator_account, main_authority, ids),
        SetFutureEpochRatesArgs(epoch_earning_rate_total_shared, epoch_slashing_rate_per_client),
    )


def coordinator_set_paused(
    run_id: str,
    coordinator_account: Any,
    main_authority: Any,
    paused: bool,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _spec("coordinator", "set_paused").build(
        ids.coordinator,
        _owner_accounts(run_id, coordinator_account, main_authority, ids),
        SetPausedArgs(paused),
    )


def coordinator_join_run(
    coordinator_instance: Any,
    coordinator_account: Any,
    authorization: Any,
    client_id: NodeIdentity,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    """`join_run`, signed by the client's wallet (the identity's signer key)."""
    return _spec("coordinator", "join_run").build(
        ids.coordinator,
        {
            "user": SoldersPubkey.from_bytes(client_id.signer),
            "authorization": authorization,
            "coordinator_instance": coordinator_instance,
            "coordinator_account": coordinator_account,
        },
        JoinRunArgs(JoinRunParams(client_id)),
    )


def _permissionless(
    name: str,
    coordinator_instance: Any,
    coordinator_account: Any,
    user: Any,
    args: Any,
    ids: ProgramIds,
) -> Instruction:
    return _spec("coordinator", name).build(
        ids.coordinator,
        {
            "user": user,
            "coordinator_instance": coordinator_instance,
            "coordinator_account": coordinator_account,
        },
        args,
    )


def coordinator_tick(
    coordinator_instance: Any,
    coordinator_account: Any,
    user: Any,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _permissionless("tick", coordinator_instance, coordinator_account, user, TickArgs(), ids)


def coordinator_witness(
    coordinator_instance: Any,
    coordinator_account: Any,
    user: Any,
    witness: Witness,
    metadata: WitnessMetadata,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _permissionless(
        "witness",
        coordinator_instance,
        coordinator_account,
        user,
        WitnessArgs.from_witness(witness, metadata),
        ids,
    )


def coordinator_warmup_witness(
    coordinator_instance: Any,
    coordinator_account: Any,
    user: Any,
    witness: Witness,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _permissionless(
        "warmup_witness",
        coordinator_instance,
        coordinator_account,
        user,
        WarmupWitnessArgs.from_witness(witness),
        ids,
    )


def coordinator_health_check(
    coordinator_instance: Any,
    coordinator_account: Any,
    user: Any,
    client_id: NodeIdentity,
    check: CommitteeProof,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _permissionless(
        "health_check",
        coordinator_instance,
        coordinator_account,
        user,
        HealthCheckArgs(client_id, check.committee, check.position, check.index),
        ids,
    )


def coordinator_checkpoint(
    coordinator_instance: Any,
    coordinator_account: Any,
    user: Any,
    repo: Checkpoint,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _permissionless(
        "checkpoint", coordinator_instance, coordinator_account, user, CheckpointArgs(repo), ids
    )


def treasurer_run_create(
    payer: Any,
    run_id: str,
    client_version: str,
    treasurer_index: int,
    collateral_mint: Any,
    coordinator_account: Any,
    main_authority: Any,
    join_authority: Any,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    run = pda.find_run(treasurer_index, ids)
    return _spec("treasurer", "run_create").build(
        ids.treasurer,
        {
            "payer": payer,
            "run": run,
            "run_collateral": pda.associated_token_address(run, collateral_mint),
            "collateral_mint": collateral_mint,
            "coordinator_instance": pda.find_coordinator_instance(run_id, ids),
            "coordinator_account": coordinator_account,
            "coordinator_program": ids.coordinator,
            "associated_token_program": ASSOCIATED_TOKEN_PROGRAM_ID,
            "token_program": TOKEN_PROGRAM_ID,
            "system_program": SYSTEM_PROGRAM_ID,
        },
        RunCreateArgs(
            RunCreateParams(
                treasurer_index,
                run_id,
                client_version,
                pubkey_bytes(main_authority),
                pubkey_bytes(join_authority),
            )
        ),
    )


def treasurer_run_update(
    run_id: str,
    treasurer_index: int,
    coordinator_account: Any,
    main_authority: Any,
    params: RunUpdateParams,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _spec("treasurer", "run_update").build(
        ids.treasurer,
        {
            "authority": main_authority,
            "run": pda.find_run(treasurer_index, ids),
            "coordinator_instance": pda.find_coordinator_instance(run_id, ids),
            "coordinator_account": coordinator_account,
            "coordinator_program": ids.coordinator,
        },
        RunUpdateArgs(params),
    )


def treasurer_participant_create(
    payer: Any, treasurer_index: int, user: Any, ids: ProgramIds = DEFAULT_PROGRAM_IDS
) -> Instruction:
    run = pda.find_run(treasurer_index, ids)
    return _spec("treasurer", "participant_create").build(
        ids.treasurer,
        {
            "payer": payer,
            "user": user,
            "run": run,
            "participant": pda.find_participant(run, user, ids),
            "system_program": SYSTEM_PROGRAM_ID,
        },
        ParticipantCreateArgs(),
    )


def treasurer_participant_claim(
    treasurer_index: int,
    collateral_mint: Any,
    coordinator_account: Any,
    user: Any,
    claim_earned_points: int,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    run = pda.find_run(treasurer_index, ids)
    return _spec("treasurer", "participant_claim").build(
        ids.treasurer,
        {
            "user": user,
            "user_collateral": pda.associated_token_address(user, collateral_mint),
            "run": run,
            "run_collateral": pda.associated_token_address(run, collateral_mint),
            "coordinator_account": coordinator_account,
            "participant": pda.find_participant(run, user, ids),
            "token_program": TOKEN_PROGRAM_ID,
        },
        ParticipantClaimArgs(ParticipantClaimParams(claim_earned_points)),
    )


def authorizer_authorization_create(
    payer: Any,
    grantor: Any,
    grantee: Any,
    scope: bytes = JOIN_RUN_AUTHORIZATION_SCOPE,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _spec("authorizer", "authorization_create").build(
        ids.authorizer,
        {
            "payer": payer,
            "grantor": grantor,
            "authorization": pda.find_authorization(grantor, grantee, scope, ids),
            "system_program": SYSTEM_PROGRAM_ID,
        },
        AuthorizationCreateArgs(AuthorizationCreateParams(pubkey_bytes(grantee), bytes(scope))),
    )


def authorizer_authorization_grantor_update(
    grantor: Any,
    grantee: Any,
    scope: bytes,
    active: bool,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _spec("authorizer", "authorization_grantor_update").build(
        ids.authorizer,
        {"grantor": grantor, "authorization": pda.find_authorization(grantor, grantee, scope, ids)},
        AuthorizationGrantorUpdateArgs(AuthorizationGrantorUpdateParams(active)),
    )


def authorizer_authorization_grantee_update(
    payer: Any,
    grantor: Any,
    grantee: Any,
    scope: bytes,
    delegates_clear: bool,
    delegates_added: list[Any],
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _spec("authorizer", "authorization_grantee_update").build(
        ids.authorizer,
        {
            "payer": payer,
            "grantee": grantee,
            "authorization": pda.find_authorization(grantor, grantee, scope, ids),
            "system_program": SYSTEM_PROGRAM_ID,
        },
        AuthorizationGranteeUpdateArgs(
            AuthorizationGranteeUpdateParams(
                delegates_clear, [pubkey_bytes(d) for d in delegates_added]
            )
        ),
    )


def authorizer_authorization_close(
    grantor: Any,
    grantee: Any,
    scope: bytes,
    spill: Any,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return _spec("authorizer", "authorization_close").build(
        ids.authorizer,
        {
            "grantor": grantor,
            "spill": spill,
            "authorization": pda.find_authorization(grantor, grantee, scope, ids),
            "system_program": SYSTEM_PROGRAM_ID,
        },
        AuthorizationCloseArgs(),
    )
