"""The treasurer program (`psyche_solana_treasurer`), ported to Python for the local endpoint.

The treasurer owns a run through a `Run` PDA (the coordinator's main authority), holds the reward
collateral in the PDA's associated token account, and pays participants one collateral unit per
earned point. Its calls into the coordinator and the SPL programs are real cross-program
invocations here too: into the Python coordinator, and into LiteSVM's token programs.
"""

from __future__ import annotations

from typing import TypeVar

from solders.instruction import AccountMeta, Instruction
from solders.pubkey import Pubkey
from solders.token.state import Mint, TokenAccount

from psyche.solana.anchor import TREASURER_ERRORS, AnchorErrorCode
from psyche.solana.instructions import INSTRUCTIONS
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.instructions import treasurer as treasurer_ix
from psyche.solana.localnet.runtime import (
    SYSTEM_PROGRAM,
    Accounts,
    Handler,
    InvokeContext,
    ProgramPanic,
    anchor_error,
    dispatch_anchor_instruction,
    init_pda,
    load_account_data,
    load_borsh_account,
    program_error,
    require,
    require_payer,
    require_program,
    require_seeds,
    store_borsh_account,
    write_data,
)
from psyche.solana.pda import associated_token_address
from psyche.solana.program_ids import ASSOCIATED_TOKEN_PROGRAM_ID, TOKEN_PROGRAM_ID
from psyche.solana.state import (
    COORDINATOR_ACCOUNT_SPACE,
    CoordinatorInstance,
    Participant,
    TreasurerRun,
    coordinator_account_from_bytes,
    encode_anchor_account,
)

TOKEN_PROGRAM = Pubkey.from_string(TOKEN_PROGRAM_ID)
ASSOCIATED_TOKEN_PROGRAM = Pubkey.from_string(ASSOCIATED_TOKEN_PROGRAM_ID)
T = TypeVar("T", TokenAccount, Mint)
SOLANA_RUN_ID_MAX_LEN = 32


def process(ctx: InvokeContext) -> None:
    dispatch_anchor_instruction(ctx, "treasurer", _HANDLERS)


def _error(name: str) -> Exception:
    return program_error(TREASURER_ERRORS, name)


def _run_seeds(index: int) -> list[bytes]:
    return [TreasurerRun.SEEDS_PREFIX, index.to_bytes(8, "little")]


def _load_token_program_account(
    ctx: InvokeContext, meta: AccountMeta, name: str, kind: type[T]
) -> T:
    """A token program account (`TokenAccount` or `Mint`), with Anchor's errors for an
    absent account, another owner or bytes that do not decode."""
    account = ctx.get(meta.pubkey)
    if account is None:
        raise anchor_error(AnchorErrorCode.AccountNotInitialized, name)
    if account.owner != TOKEN_PROGRAM:
        raise anchor_error(AnchorErrorCode.AccountOwnedByWrongProgram, name)
    try:
        return kind.from_bytes(bytes(account.data))
    except Exception:
        raise anchor_error(AnchorErrorCode.AccountDidNotDeserialize, name) from None


def _invoke_coordinator(
    ctx: InvokeContext, name: str, accounts: dict[str, Pubkey], args: object, run: Pubkey
) -> None:
    spec = INSTRUCTIONS["coordinator"][name]
    instruction = spec.build(ctx.ledger.program_ids.coordinator, accounts, args)
    if name != "init_coordinator":
        # The run PDA signs as the coordinator's main authority.
        metas = [
            AccountMeta(m.pubkey, m.is_signer or m.pubkey == run, m.is_writable)
            for m in instruction.accounts
        ]
        instruction = Instruction(instruction.program_id, bytes(instruction.data), metas)
    ctx.invoke(instruction, [run])


def _run_create(ctx: InvokeContext, accounts: Accounts, args: treasurer_ix.RunCreateArgs) -> None:
    params = args.params
    payer = require_payer(accounts)
    run_meta = accounts["run"]
    bump = init_pda(
        ctx, payer.pubkey, run_meta, _run_seeds(params.index), TreasurerRun.SPACE, "run"
    )
    # `init, associated_token::mint = collateral_mint, associated_token::authority = run`
    collateral_meta = accounts.mutable("run_collateral")
    mint_meta = accounts["collateral_mint"]
    if collateral_meta.pubkey != associated_token_address(run_meta.pubkey, mint_meta.pubkey):
        raise anchor_error(AnchorErrorCode.ConstraintAssociated, "run_collateral")
    ctx.invoke(
        Instruction(
            ASSOCIATED_TOKEN_PROGRAM,
            b"",
            [
                AccountMeta(payer.pubkey, True, True),
                AccountMeta(collateral_meta.pubkey, False, True),
                AccountMeta(run_meta.pubkey, False, False),
                AccountMeta(mint_meta.pubkey, False, False),
                AccountMeta(SYSTEM_PROGRAM, False, False),
                AccountMeta(TOKEN_PROGRAM, False, False),
            ],
        )
    )
    _load_token_program_account(ctx, mint_meta, "collateral_mint", Mint)
    instance_meta = accounts.mutable("coordinator_instance")
    account_meta = accounts.mutable("coordinator_account")
    coordinator_program = ctx.ledger.program_ids.coordinator_key
    require_program(accounts["coordinator_program"], coordinator_program, "coordinator_program")
    require_program(
        accounts["associated_token_program"], ASSOCIATED_TOKEN_PROGRAM, "associated_token_program"
    )
    require_program(accounts["token_program"], TOKEN_PROGRAM, "token_program")
    require_program(accounts["system_program"], SYSTEM_PROGRAM, "system_program")

    if len(params.run_id.encode("utf-8")) > SOLANA_RUN_ID_MAX_LEN:
        raise _error("RunIdInvalidLength")
    run = TreasurerRun(
        bump=bump,
        index=params.index,
        main_authority=params.main_authority,
        join_authority=params.join_authority,
        coordinator_account=bytes(account_meta.pubkey),
        coordinator_instance=bytes(instance_meta.pubkey),
        collateral_mint=bytes(mint_meta.pubkey),
        total_claimed_collateral_amount=0,
        total_claimed_earned_points=0,
    )
    write_data(ctx, run_meta.pubkey, encode_anchor_account(run, space=TreasurerRun.SPACE))
    _invoke_coordinator(
        ctx,
        "init_coordinator",
        {
            "payer": payer.pubkey,
            "coordinator_instance": instance_meta.pubkey,
            "coordinator_account": account_meta.pubkey,
            "system_program": SYSTEM_PROGRAM,
        },
        coordinator_ix.InitCoordinatorArgs(
            coordinator_ix.InitCoordinatorParams(
                main_authority=bytes(run_meta.pubkey),
                join_authority=params.join_authority,
                run_id=params.run_id,
                client_version=params.client_version,
            )
        ),
        run_meta.pubkey,
    )


def _run_owner_accounts(ctx: InvokeContext, accounts: Accounts) -> tuple[Pubkey, dict[str, Pubkey]]:
    """`run_update`'s checks (the run's main authority signs, the run's coordinator accounts):
    the run PDA and the accounts of the coordinator's owner instructions it signs as."""
    authority = accounts.signer("authority")
    run_meta = accounts["run"]
    run = load_borsh_account(ctx, run_meta, TreasurerRun, ctx.program_id, "run")
    coordinator_program = ctx.ledger.program_ids.coordinator_key
    instance_meta = accounts["coordinator_instance"]
    load_borsh_account(
        ctx, instance_meta, CoordinatorInstance, coordinator_program, "coordinator_instance"
    )
    account_meta = accounts.mutable("coordinator_account")
    load_account_data(
        ctx, account_meta, coordinator_program, "CoordinatorAccount", "coordinator_account"
    )
    require_program(accounts["coordinator_program"], coordinator_program, "coordinator_program")
    require(run.main_authority == bytes(authority.pubkey), "run")
    require(run.coordinator_instance == bytes(instance_meta.pubkey), "run")
    require(run.coordinator_account == bytes(account_meta.pubkey), "run")

    return run_meta.pubkey, {
        "authority": run_meta.pubkey,
        "coordinator_instance": instance_meta.pubkey,
        "coordinator_account": account_meta.pubkey,
    }


def _run_update(ctx: InvokeContext, accounts: Accounts, args: treasurer_ix.RunUpdateArgs) -> None:
    run, owner_accounts = _run_owner_accounts(ctx, accounts)
    for name, coordinator_args in treasurer_ix.coordinator_updates(args.params):
        _invoke_coordinator(ctx, name, owner_accounts, coordinator_args, run)


def _run_set_verifiers_train(
    ctx: InvokeContext, accounts: Accounts, args: treasurer_ix.RunSetVerifiersTrainArgs
) -> None:
    """Beyond upstream (issue 27): `run_update`'s checks, then the coordinator's
    `set_verifiers_train` signed by the run."""
    coordinator_args = coordinator_ix.SetVerifiersTrainArgs(args.verifiers_train)
    _run_set_verification(ctx, accounts, "set_verifiers_train", coordinator_args)


def _run_set_exact_verification_threads(
    ctx: InvokeContext,
    accounts: Accounts,
    args: treasurer_ix.RunSetExactVerificationThreadsArgs,
) -> None:
    """Beyond upstream (issue 27): `run_update`'s checks, then the coordinator's
    `set_exact_verification_threads` signed by the run."""
    threads = args.exact_verification_threads
    coordinator_args = coordinator_ix.SetExactVerificationThreadsArgs(threads)
    _run_set_verification(ctx, accounts, "set_exact_verification_threads", coordinator_args)


def _run_set_verification(
    ctx: InvokeContext, accounts: Accounts, name: str, coordinator_args: object
) -> None:
    """`run_update`'s checks, then the coordinator's setter `name` of the run's verification
    account (`set_verifiers_train`, `set_exact_verification_threads`), signed by the run."""
    run, owner_accounts = _run_owner_accounts(ctx, accounts)
    owner_accounts["verification"] = accounts.key("verification")
    _invoke_coordinator(ctx, name, owner_accounts, coordinator_args, run)


def _participant_create(
    ctx: InvokeContext, accounts: Accounts, args: treasurer_ix.ParticipantCreateArgs
) -> None:
    payer, user = require_payer(accounts), accounts.signer("user")
    run_meta = accounts["run"]
    load_borsh_account(ctx, run_meta, TreasurerRun, ctx.program_id, "run")
    participant_meta = accounts["participant"]
    bump = init_pda(
        ctx,
        payer.pubkey,
        participant_meta,
        [Participant.SEEDS_PREFIX, bytes(run_meta.pubkey), bytes(user.pubkey)],
        Participant.SPACE,
        "participant",
    )
    require_program(accounts["system_program"], SYSTEM_PROGRAM, "system_program")
    write_data(
        ctx,
        participant_meta.pubkey,
        encode_anchor_account(Participant(bump, 0, 0), space=Participant.SPACE),
    )


def _participant_claim(
    ctx: InvokeContext, accounts: Accounts, args: treasurer_ix.ParticipantClaimArgs
) -> None:
    user = accounts.signer("user")
    user_collateral_meta = accounts.mutable("user_collateral")
    user_collateral = _load_token_program_account(
        ctx, user_collateral_meta, "user_collateral", TokenAccount
    )
    run_meta = accounts.mutable("run")
    run = load_borsh_account(ctx, run_meta, TreasurerRun, ctx.program_id, "run")
    run_collateral_meta = accounts.mutable("run_collateral")
    run_collateral = _load_token_program_account(
        ctx, run_collateral_meta, "run_collateral", TokenAccount
    )
    account_meta = accounts["coordinator_account"]
    coordinator_program = ctx.ledger.program_ids.coordinator_key
    _, coordinator_data = load_account_data(
        ctx, account_meta, coordinator_program, "CoordinatorAccount", "coordinator_account"
    )
    participant_meta = accounts.mutable("participant")
    participant = load_borsh_account(
        ctx, participant_meta, Participant, ctx.program_id, "participant"
    )
    require_program(accounts["token_program"], TOKEN_PROGRAM, "token_program")

    collateral_mint = Pubkey.from_bytes(run.collateral_mint)
    require(user_collateral.mint == collateral_mint, "user_collateral")
    require(user_collateral.owner == user.pubkey, "user_collateral")
    require(user_collateral.delegate is None, "user_collateral")
    require(run.coordinator_account == bytes(account_meta.pubkey), "run")
    if run_collateral.owner != run_meta.pubkey:
        raise anchor_error(AnchorErrorCode.ConstraintTokenOwner, "run_collateral")
    if run_collateral_meta.pubkey != associated_token_address(run_meta.pubkey, collateral_mint):
        raise anchor_error(AnchorErrorCode.AccountNotAssociatedTokenAccount, "run_collateral")
    version = int.from_bytes(coordinator_data[8:16], "little")
    require(
        version == 1 and len(coordinator_data) == COORDINATOR_ACCOUNT_SPACE, "coordinator_account"
    )
    require_seeds(
        participant_meta,
        [Participant.SEEDS_PREFIX, bytes(run_meta.pubkey), bytes(user.pubkey)],
        ctx.program_id,
        "participant",
        participant.bump,
    )

    coordinator_account = coordinator_account_from_bytes(coordinator_data)
    client = next(
        (
            c
            for c in coordinator_account.state.clients_state.clients
            if c.id.signer == bytes(user.pubkey)
        ),
        None,
    )
    earned = 0 if client is None else client.earned
    if earned < participant.claimed_earned_points:
        raise ProgramPanic("attempt to subtract with overflow")
    # Beyond upstream: points slashed for losing a verification dispute are not paid
    # (`SolanaClient.claimable`; upstream never slashes, so this is upstream's rule there).
    claimable = 0 if client is None else client.claimable()
    unclaimed = max(0, claimable - participant.claimed_earned_points)
    claim = args.params.claim_earned_points
    if claim > unclaimed:
        raise _error("InvalidParameter")
    # One collateral unit per earned point.
    participant.claimed_collateral_amount += claim
    participant.claimed_earned_points += claim
    run.total_claimed_collateral_amount += claim
    run.total_claimed_earned_points += claim
    store_borsh_account(ctx, participant_meta.pubkey, participant)
    store_borsh_account(ctx, run_meta.pubkey, run)
    ctx.invoke(
        Instruction(
            TOKEN_PROGRAM,
            # SPL Token `Transfer { amount }`
            bytes([3]) + claim.to_bytes(8, "little"),
            [
                AccountMeta(run_collateral_meta.pubkey, False, True),
                AccountMeta(user_collateral_meta.pubkey, False, True),
                AccountMeta(run_meta.pubkey, True, False),
            ],
        ),
        [run_meta.pubkey],
    )


_HANDLERS: dict[str, Handler] = {
    "run_create": _run_create,
    "run_update": _run_update,
    "run_set_verifiers_train": _run_set_verifiers_train,
    "run_set_exact_verification_threads": _run_set_exact_verification_threads,
    "participant_create": _participant_create,
    "participant_claim": _participant_claim,
}
