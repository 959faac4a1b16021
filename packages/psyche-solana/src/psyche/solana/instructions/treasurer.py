"""The treasurer program (upstream `solana-treasurer`): a run whose coordinator it owns, with a
collateral account that pays the participants the points they earned. Each instruction's
arguments, its accounts (`SPECS`) and its builder, named as upstream's
`psyche_solana_rpc::instructions`."""

from __future__ import annotations

from typing import Any

from solders.instruction import Instruction

from psyche.core.serde import U16, U64, struct
from psyche.solana import pda
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.instructions.spec import (
    InstructionSpec,
    by_name,
    readonly,
    signer,
    writable,
    writable_signer,
)
from psyche.solana.program_ids import (
    DEFAULT_PROGRAM_IDS,
    ProgramIds,
)
from psyche.solana.pubkey import Pubkey, pubkey_bytes

# ---------------------------------------------------------------------------------------------
# Arguments


@struct(frozen=True)
class RunCreateParams:
    index: U64
    run_id: str
    client_version: str
    main_authority: Pubkey
    join_authority: Pubkey


@struct(frozen=True, kw_only=True)
class RunUpdateParams(coordinator_ix.CoordinatorUpdate):
    """The coordinator's `update` (`CoordinatorUpdate`: metadata, config, model, progress),
    then the other settings the run's authority changes, in upstream's field order."""

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


def coordinator_updates(params: RunUpdateParams) -> list[tuple[str, Any]]:
    """The coordinator instructions (name, arguments) that `params` stands for, in the order
    upstream's `run_update` invokes them: one for each group of fields that is given. The
    treasurer program invokes them as the run; a run without a treasurer sends them itself."""
    updates: list[tuple[str, Any]] = []
    if any(x is not None for x in (params.metadata, params.config, params.model, params.progress)):
        args = coordinator_ix.UpdateArgs(
            metadata=params.metadata,
            config=params.config,
            model=params.model,
            progress=params.progress,
        )
        updates.append(("update", args))
    earning = params.epoch_earning_rate_total_shared
    slashing = params.epoch_slashing_rate_per_client
    if earning is not None or slashing is not None:
        rates = coordinator_ix.SetFutureEpochRatesArgs(earning, slashing)
        updates.append(("set_future_epoch_rates", rates))
    if params.paused is not None:
        updates.append(("set_paused", coordinator_ix.SetPausedArgs(params.paused)))
    if params.client_version is not None:
        version = coordinator_ix.UpdateClientVersionArgs(params.client_version)
        updates.append(("update_client_version", version))
    return updates


# One struct per instruction: its fields are the instruction's arguments.


@struct(frozen=True)
class RunCreateArgs:
    params: RunCreateParams


@struct(frozen=True)
class RunUpdateArgs:
    params: RunUpdateParams


@struct(frozen=True)
class RunSetVerifiersTrainArgs:
    """Beyond upstream (issue 27): the run's `CoordinatorConfig.verifiers_train`, which the
    treasurer's run (the coordinator's main authority) sets through the coordinator's
    `set_verifiers_train` (upstream's `run_update` has no field for it)."""

    verifiers_train: bool


@struct(frozen=True)
class RunSetExactVerificationThreadsArgs:
    """Beyond upstream (issue 27): the run's `CoordinatorConfig.exact_verification_threads`,
    which the treasurer's run sets through the coordinator's `set_exact_verification_threads`
    (as `run_set_verifiers_train`)."""

    exact_verification_threads: U16


@struct(frozen=True)
class ParticipantCreateArgs:
    params: ParticipantCreateParams = ParticipantCreateParams()


@struct(frozen=True)
class ParticipantClaimArgs:
    params: ParticipantClaimParams


# ---------------------------------------------------------------------------------------------
# Specs


# The accounts of the instructions the run's authority signs on its coordinator.
_RUN_AUTHORITY = (
    signer("authority"),
    readonly("run"),
    readonly("coordinator_instance"),
    writable("coordinator_account"),
)
_RUN_AUTHORITY_VERIFICATION = (
    *_RUN_AUTHORITY,
    writable("verification"),
    readonly("coordinator_program"),
)

SPECS: dict[str, InstructionSpec] = by_name(
    InstructionSpec(
        "treasurer",
        "run_create",
        (
            writable_signer("payer"),
            writable("run"),
            writable("run_collateral"),
            readonly("collateral_mint"),
            writable("coordinator_instance"),
            writable("coordinator_account"),
            readonly("coordinator_program"),
            readonly("associated_token_program"),
            readonly("token_program"),
            readonly("system_program"),
        ),
        RunCreateArgs,
    ),
    InstructionSpec(
        "treasurer", "run_update", (*_RUN_AUTHORITY, readonly("coordinator_program")), RunUpdateArgs
    ),
    InstructionSpec(
        "treasurer",
        "run_set_verifiers_train",
        _RUN_AUTHORITY_VERIFICATION,
        RunSetVerifiersTrainArgs,
    ),
    InstructionSpec(
        "treasurer",
        "run_set_exact_verification_threads",
        _RUN_AUTHORITY_VERIFICATION,
        RunSetExactVerificationThreadsArgs,
    ),
    InstructionSpec(
        "treasurer",
        "participant_create",
        (
            writable_signer("payer"),
            signer("user"),
            readonly("run"),
            writable("participant"),
            readonly("system_program"),
        ),
        ParticipantCreateArgs,
    ),
    InstructionSpec(
        "treasurer",
        "participant_claim",
        (
            signer("user"),
            writable("user_collateral"),
            writable("run"),
            writable("run_collateral"),
            readonly("coordinator_account"),
            writable("participant"),
            readonly("token_program"),
        ),
        ParticipantClaimArgs,
    ),
)


# ---------------------------------------------------------------------------------------------
# Builders


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
    return SPECS["run_create"].call(
        ids,
        {
            "payer": payer,
            "run": run,
            "run_collateral": pda.associated_token_address(run, collateral_mint),
            "collateral_mint": collateral_mint,
            "coordinator_instance": pda.find_coordinator_instance(run_id, ids),
            "coordinator_account": coordinator_account,
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
    args = RunUpdateArgs(params)
    return _run_authority_call(
        "run_update", run_id, treasurer_index, coordinator_account, main_authority, args, ids
    )


def _run_authority_call(
    name: str,
    run_id: str,
    treasurer_index: int,
    coordinator_account: Any,
    main_authority: Any,
    args: Any,
    ids: ProgramIds,
) -> Instruction:
    """`name`, one of the instructions the run's authority signs on its coordinator
    (`run_update`; `run_set_verifiers_train` and `run_set_exact_verification_threads` on the
    run's verification account too), with `args`."""
    accounts = {
        "authority": main_authority,
        "run": pda.find_run(treasurer_index, ids),
        "coordinator_instance": pda.find_coordinator_instance(run_id, ids),
        "coordinator_account": coordinator_account,
    }
    return SPECS[name].call(ids, accounts, args)


def treasurer_run_set_verifiers_train(
    run_id: str,
    treasurer_index: int,
    coordinator_account: Any,
    main_authority: Any,
    verifiers_train: bool,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    args = RunSetVerifiersTrainArgs(verifiers_train)
    return _run_authority_call(
        "run_set_verifiers_train",
        run_id,
        treasurer_index,
        coordinator_account,
        main_authority,
        args,
        ids,
    )


def treasurer_run_set_exact_verification_threads(
    run_id: str,
    treasurer_index: int,
    coordinator_account: Any,
    main_authority: Any,
    threads: int,
    ids: ProgramIds = DEFAULT_PROGRAM_IDS,
) -> Instruction:
    args = RunSetExactVerificationThreadsArgs(threads)
    return _run_authority_call(
        "run_set_exact_verification_threads",
        run_id,
        treasurer_index,
        coordinator_account,
        main_authority,
        args,
        ids,
    )


def treasurer_participant_create(
    payer: Any, treasurer_index: int, user: Any, ids: ProgramIds = DEFAULT_PROGRAM_IDS
) -> Instruction:
    run = pda.find_run(treasurer_index, ids)
    return SPECS["participant_create"].call(
        ids,
        {
            "payer": payer,
            "user": user,
            "run": run,
            "participant": pda.find_participant(run, user, ids),
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
    return SPECS["participant_claim"].call(
        ids,
        {
            "user": user,
            "user_collateral": pda.associated_token_address(user, collateral_mint),
            "run": run,
            "run_collateral": pda.associated_token_address(run, collateral_mint),
            "coordinator_account": coordinator_account,
            "participant": pda.find_participant(run, user, ids),
        },
        ParticipantClaimArgs(ParticipantClaimParams(claim_earned_points)),
    )
