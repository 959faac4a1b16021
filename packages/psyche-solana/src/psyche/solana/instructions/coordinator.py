"""The coordinator program (upstream `solana-coordinator`), which holds a run's coordinator:
its owner creates, updates, pauses and frees it; clients join, tick, witness, health-check and
checkpoint. Each instruction's arguments, its accounts (`SPECS`) and its builder, named as
upstream's `psyche_solana_rpc::instructions`."""

from __future__ import annotations

from typing import Annotated, Any, Self

from solders.instruction import AccountMeta, Instruction
from solders.pubkey import Pubkey as SoldersPubkey

from psyche.coordinator import CoordinatorProgress, Witness, WitnessMetadata
from psyche.coordinator.committee_selection import Committee, CommitteeProof, WitnessProof
from psyche.coordinator.config import CoordinatorConfig
from psyche.coordinator.model import Checkpoint, Model
from psyche.coordinator.verification import NO_DRAW, Finding, VerificationReport
from psyche.core.bloom import WitnessBloom
from psyche.core.merkle_tree import MerkleRoot
from psyche.core.node_identity import NodeIdentity
from psyche.core.serde import U16, U32, U64, FixedBytes, struct
from psyche.solana import pda
from psyche.solana.instructions.ed25519 import SYSVAR_INSTRUCTIONS, new_ed25519_instruction
from psyche.solana.instructions.spec import (
    InstructionSpec,
    by_name,
    readonly,
    signer,
    writable,
    writable_signer,
)
from psyche.solana.program_ids import DEFAULT_PROGRAM_IDS, ProgramIds
from psyche.solana.pubkey import Pubkey, pubkey_bytes, to_solders
from psyche.solana.state import RunMetadata

# ---------------------------------------------------------------------------------------------
# Arguments


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


# One struct per instruction: its fields are the instruction's arguments.


@struct(frozen=True)
class InitCoordinatorArgs:
    params: InitCoordinatorParams


@struct(frozen=True)
class FreeCoordinatorArgs:
    params: FreeCoordinatorParams = FreeCoordinatorParams()


@struct(frozen=True, kw_only=True)
class CoordinatorUpdate:
    """What the owner's `update` changes, each field given or None (left as it is): declared
    once for the `update` instruction's arguments and the first fields of the treasurer's
    `RunUpdateParams`, which forwards them to `update` (`treasurer.coordinator_updates`)."""

    metadata: RunMetadata | None = None
    config: CoordinatorConfig | None = None
    model: Model | None = None
    progress: CoordinatorProgress | None = None


@struct(frozen=True, kw_only=True)
class UpdateArgs(CoordinatorUpdate):
    """`update`'s four arguments (`CoordinatorUpdate`)."""


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
class WarmupWitnessArgs:
    proof: WitnessProof
    participant_bloom: WitnessBloom
    broadcast_bloom: WitnessBloom
    broadcast_merkle: MerkleRoot

    @classmethod
    def from_witness(cls, witness: Witness, *rest: Any) -> Self:
        """The witness's fields, then the instruction's own (`WitnessArgs`: the metadata)."""
        return cls(
            witness.proof,
            witness.participant_bloom,
            witness.broadcast_bloom,
            witness.broadcast_merkle,
            *rest,
        )

    def witness(self) -> Witness:
        return Witness(
            self.proof, self.participant_bloom, self.broadcast_bloom, self.broadcast_merkle
        )


@struct
class WitnessArgs(WarmupWitnessArgs):
    """A warmup witness's arguments, then the metadata."""

    # Ignored by the program (kept for indexers).
    metadata: WitnessMetadata


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
class InitVerificationArgs:
    pass


@struct(frozen=True)
class VerificationReportArgs:
    """A `VerificationReport` as a borsh `Vec` of findings (its `FixedVec` would fill every
    slot: more than a transaction holds)."""

    step: U32
    findings: list[Finding]
    draw: Annotated[bytes, FixedBytes(64)] = NO_DRAW
    """The verifier's draw signature (`VerificationReport.draw`: the program checks it)."""

    def report(self) -> VerificationReport:
        return VerificationReport(self.step, list(self.findings), self.draw)


@struct(frozen=True)
class SetVerifiersTrainArgs:
    """The run's `CoordinatorConfig.verifiers_train`, kept in its verification account (the
    coordinator account has no room for it: `psyche.solana.verification`)."""

    verifiers_train: bool


@struct(frozen=True)
class SetExactVerificationThreadsArgs:
    """The run's `CoordinatorConfig.exact_verification_threads` (0: off), kept in its
    verification account beside `verifiers_train`."""

    exact_verification_threads: U16


# ---------------------------------------------------------------------------------------------
# Specs


_OWNER = (signer("authority"), readonly("coordinator_instance"), writable("coordinator_account"))
_PERMISSIONLESS = (
    signer("user"),
    readonly("coordinator_instance"),
    writable("coordinator_account"),
)

SPECS: dict[str, InstructionSpec] = by_name(
    InstructionSpec(
        "coordinator",
        "init_coordinator",
        (
            writable_signer("payer"),
            writable("coordinator_instance"),
            writable("coordinator_account"),
            readonly("system_program"),
        ),
        InitCoordinatorArgs,
    ),
    InstructionSpec(
        "coordinator",
        "free_coordinator",
        (
            signer("authority"),
            writable("spill"),
            writable("coordinator_instance"),
            writable("coordinator_account"),
        ),
        FreeCoordinatorArgs,
    ),
    InstructionSpec("coordinator", "update", _OWNER, UpdateArgs),
    InstructionSpec("coordinator", "update_client_version", _OWNER, UpdateClientVersionArgs),
    InstructionSpec("coordinator", "set_future_epoch_rates", _OWNER, SetFutureEpochRatesArgs),
    InstructionSpec(
        "coordinator",
        "join_run",
        (
            signer("user"),
            readonly("authorization"),
            readonly("coordinator_instance"),
            writable("coordinator_account"),
        ),
        JoinRunArgs,
    ),
    InstructionSpec("coordinator", "set_paused", _OWNER, SetPausedArgs),
    InstructionSpec("coordinator", "tick", _PERMISSIONLESS, TickArgs),
    InstructionSpec("coordinator", "witness", _PERMISSIONLESS, WitnessArgs),
    InstructionSpec("coordinator", "warmup_witness", _PERMISSIONLESS, WarmupWitnessArgs),
    InstructionSpec("coordinator", "health_check", _PERMISSIONLESS, HealthCheckArgs),
    InstructionSpec("coordinator", "checkpoint", _PERMISSIONLESS, CheckpointArgs),
    # Beyond upstream (issue 27, `psyche.solana.verification`).
    InstructionSpec(
        "coordinator",
        "init_verification",
        (
            writable_signer("payer"),
            readonly("coordinator_instance"),
            readonly("coordinator_account"),
            writable("verification"),
            readonly("system_program"),
        ),
        InitVerificationArgs,
    ),
    InstructionSpec(
        "coordinator",
        "verification_report",
        (*_PERMISSIONLESS, writable("verification"), readonly("instructions")),
        VerificationReportArgs,
    ),
    InstructionSpec(
        "coordinator",
        "set_verifiers_train",
        (*_OWNER, writable("verification")),
        SetVerifiersTrainArgs,
    ),
    InstructionSpec(
        "coordinator",
        "set_exact_verification_threads",
        (*_OWNER, writable("verification")),
        SetExactVerificationThreadsArgs,
    ),
)


# ---------------------------------------------------------------------------------------------
# Builders


def coordinator_init_coordinator(
    payer: Any,
    run_id: str,
    client_version: str,
    coordinator_account: Any,
    main_authority: Any,
    join_authority: Any,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return SPECS["init_coordinator"].call(
        ids,
        {
            "payer": payer,
            "coordinator_instance": pda.find_coordinator_instance(run_id, ids),
            "coordinator_account": coordinator_account,
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
    return SPECS["free_coordinator"].call(
        ids,
        {
            "authority": main_authority,
            "spill": main_authority,
            "coordinator_instance": coordinator_instance,
            "coordinator_account": coordinator_account,
        },
        FreeCoordinatorArgs(),
    )


def coordinator_owner_call(
    name: str,
    run_id: str,
    coordinator_account: Any,
    main_authority: Any,
    args: Any,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    """`name`, one of the instructions the main authority signs on the run's accounts (`update`,
    `update_client_version`, `set_future_epoch_rates`, `set_paused`; `set_verifiers_train` and
    `set_exact_verification_threads` on its verification account too), with `args`."""
    return SPECS[name].call(
        ids, _owner_accounts(run_id, coordinator_account, main_authority, ids), args
    )


def _owner_accounts(
    run_id: str, coordinator_account: Any, main_authority: Any, ids: ProgramIds
) -> dict[str, Any]:
    """The accounts of every instruction the main authority signs (`_OWNER`)."""
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
    args = UpdateArgs(metadata=metadata, config=config, model=model, progress=progress)
    return coordinator_owner_call("update", run_id, coordinator_account, main_authority, args, ids)


def coordinator_update_client_version(
    run_id: str,
    coordinator_account: Any,
    main_authority: Any,
    new_version: str,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    args = UpdateClientVersionArgs(new_version)
    return coordinator_owner_call(
        "update_client_version", run_id, coordinator_account, main_authority, args, ids
    )


def coordinator_set_future_epoch_rates(
    run_id: str,
    coordinator_account: Any,
    main_authority: Any,
    epoch_earning_rate_total_shared: int | None,
    epoch_slashing_rate_per_client: int | None,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    args = SetFutureEpochRatesArgs(epoch_earning_rate_total_shared, epoch_slashing_rate_per_client)
    return coordinator_owner_call(
        "set_future_epoch_rates", run_id, coordinator_account, main_authority, args, ids
    )


def coordinator_set_paused(
    run_id: str,
    coordinator_account: Any,
    main_authority: Any,
    paused: bool,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    args = SetPausedArgs(paused)
    return coordinator_owner_call(
        "set_paused", run_id, coordinator_account, main_authority, args, ids
    )


def coordinator_join_run(
    coordinator_instance: Any,
    coordinator_account: Any,
    authorization: Any,
    client_id: NodeIdentity,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    """`join_run`, signed by the client's wallet (the identity's signer key)."""
    return SPECS["join_run"].call(
        ids,
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
    return SPECS[name].call(
        ids,
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


# ---------------------------------------------------------------------------------------------
# Verification (beyond upstream: `psyche.solana.verification`)


def with_verification(instruction: Instruction, verification: Any | None) -> Instruction:
    """`instruction` with the run's verification account appended (writable), which `tick`,
    `witness`, `warmup_witness`, `health_check`, `checkpoint` and `join_run` need in a run with
    `verification_percent > 0`; unchanged when `verification` is None."""
    if verification is None:
        return instruction
    meta = AccountMeta(to_solders(verification), is_signer=False, is_writable=True)
    return Instruction(instruction.program_id, instruction.data, [*instruction.accounts, meta])


def coordinator_init_verification(
    payer: Any,
    coordinator_instance: Any,
    coordinator_account: Any,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    return SPECS["init_verification"].call(
        ids,
        {
            "payer": payer,
            "coordinator_instance": coordinator_instance,
            "coordinator_account": coordinator_account,
        },
        InitVerificationArgs(),
    )


def coordinator_verification_report(
    coordinator_instance: Any,
    coordinator_account: Any,
    user: Any,
    report: VerificationReport,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    """The report alone; a report with a draw goes with the precompile that verifies it
    (`verification_report_instructions`)."""
    return SPECS["verification_report"].call(
        ids,
        {
            "user": user,
            "coordinator_instance": coordinator_instance,
            "coordinator_account": coordinator_account,
            "instructions": SYSVAR_INSTRUCTIONS,
        },
        VerificationReportArgs(report.step, list(report.findings), report.draw),
    )


def verification_report_instructions(
    coordinator_instance: Any,
    coordinator_account: Any,
    user: Any,
    report: VerificationReport,
    draw_signer: tuple[bytes, bytes] | None,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> list[Instruction]:
    """A report's transaction: with a draw, the `Ed25519SigVerify` instruction of the draw
    (`draw_signer`: the verifier's p2p public key and the round's draw message) first, which the
    program reads back through the instructions sysvar; the report alone without one."""
    instruction = coordinator_verification_report(
        coordinator_instance, coordinator_account, user, report, ids
    )
    if report.draw == NO_DRAW or draw_signer is None:
        return [instruction]
    key, message = draw_signer
    return [new_ed25519_instruction(key, message, report.draw), instruction]


def coordinator_set_verifiers_train(
    run_id: str,
    coordinator_account: Any,
    main_authority: Any,
    verifiers_train: bool,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    """The owner's `set_verifiers_train` (signed by the run's main authority, while the run is
    halted, as `update`)."""
    args = SetVerifiersTrainArgs(verifiers_train)
    return coordinator_owner_call(
        "set_verifiers_train", run_id, coordinator_account, main_authority, args, ids
    )


def coordinator_set_exact_verification_threads(
    run_id: str,
    coordinator_account: Any,
    main_authority: Any,
    threads: int,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    """The owner's `set_exact_verification_threads` (signed by the run's main authority, while
    the run is halted, as `update`)."""
    args = SetExactVerificationThreadsArgs(threads)
    return coordinator_owner_call(
        "set_exact_verification_threads", run_id, coordinator_account, main_authority, args, ids
    )
