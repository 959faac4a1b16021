"""The coordinator program (`psyche_solana_coordinator`), ported to Python for the local endpoint.

Each handler checks its accounts as upstream's `#[derive(Accounts)]` struct does, then runs the
instruction with `psyche.coordinator`'s state machine on the decoded `CoordinatorAccount` and
writes the account back in its on-chain layout. Behaviour follows upstream's `lib.rs`,
`instance_state.rs` and `logic/*.rs`, including the nonce bump, the automatic tick after joins,
witnesses and health checks, the seed derived from the clock, and epoch rewards.

Beyond upstream (issue 27, `psyche.solana.verification`): in a run with `verification_percent >
0`, `tick`, `witness`, `warmup_witness`, `health_check`, `checkpoint` and `join_run` need the
run's verification account after their own accounts. Each of them records the duties of the
round it finds (as `ServerCore` does on every tick), `join_run` refuses a banned member, and
`verification_report` hears a member's report and applies what the tie-breakers decide: the loser
dropped, banned, slashed, and the members that found it out credited. `set_verifiers_train` and
`set_exact_verification_threads` (the owner's, while halted) keep the run's
`CoordinatorConfig.verifiers_train` and `exact_verification_threads` in the verification account,
and every instruction that loads that account puts them on the config it runs with. In a run
that verifies exactly, each round's follower duties are recorded beside its verifier duties, and
a follower's report (`FOLLOW_DRAW`) is heard through `psyche.coordinator.following`'s
`RoundFollowing`: its loser is dropped, banned, slashed and its deciders credited as above.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from solders.instruction import AccountMeta
from solders.pubkey import Pubkey

from psyche.coordinator import ClientState, Coordinator, RunState, TickResult
from psyche.coordinator.data_selection import verification_duties_for_state
from psyche.coordinator.errors import CoordinatorError, CoordinatorPanic
from psyche.coordinator.following import is_follow_report, round_following
from psyche.coordinator.run_config import MAX_EXACT_VERIFICATION_THREADS
from psyche.coordinator.verification import (
    Resolution,
    RoundVerification,
    SignatureCheck,
    VerificationReport,
)
from psyche.core.node_identity import NodeIdentity
from psyche.solana.anchor import COORDINATOR_ERRORS, DISCRIMINATOR_LEN, AnchorErrorCode
from psyche.solana.borsh import fixed_str_bytes
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.instructions.ed25519 import (
    ED25519_PROGRAM,
    SYSVAR_INSTRUCTIONS,
    PrecompileError,
    SysvarDecodeError,
    load_instruction_at,
    load_instruction_count,
    signed_messages,
)
from psyche.solana.localnet.runtime import (
    SYSTEM_PROGRAM,
    Accounts,
    Handler,
    InvokeContext,
    ProgramPanic,
    anchor_error,
    close_account,
    dispatch_anchor_instruction,
    init_pda,
    load_account_data,
    load_borsh_account,
    program_error,
    require,
    require_mut,
    require_owner,
    require_payer,
    require_program,
    require_seeds,
    require_system_account,
    store_borsh_account,
    write_data,
)
from psyche.solana.pda import bytes_from_string
from psyche.solana.state import (
    COORDINATOR_ACCOUNT_DISCRIMINATOR,
    COORDINATOR_ACCOUNT_SPACE,
    JOIN_RUN_AUTHORIZATION_SCOPE,
    REPR_C,
    Authorization,
    CoordinatorAccount,
    CoordinatorAccountError,
    CoordinatorInstance,
    CoordinatorInstanceState,
    SolanaClient,
    coordinator_account_from_bytes,
    coordinator_account_to_bytes,
    encode_anchor_account,
)
from psyche.solana.verification import (
    RUN_VERIFICATION_SPACE,
    RunVerification,
    VerificationEntry,
    deciders,
    entry_line,
    finding_limit,
    findings_entries,
    follow_deciders,
    punishment,
)

SOLANA_RUN_ID_MAX_LEN = 32
_LAYOUT = REPR_C.layout(CoordinatorAccount)
_OFFSETS = {
    name: DISCRIMINATOR_LEN + _LAYOUT.offset_of(path)
    for name, path in (
        ("version", "version"),
        ("nonce", "nonce"),
        ("run_id", "state.coordinator.run_id"),
        ("run_state", "state.coordinator.run_state"),
        ("client_version", "state.client_version"),
    )
}


def _error(name: str) -> Exception:
    return program_error(COORDINATOR_ERRORS, name)


def _from_coordinator_error(error: CoordinatorError) -> Exception:
    return _error(f"CoordinatorError{error.kind.name}")


def process(ctx: InvokeContext) -> None:
    try:
        dispatch_anchor_instruction(ctx, "coordinator", _HANDLERS)
    except CoordinatorPanic as e:
        raise ProgramPanic(str(e)) from None


# ---------------------------------------------------------------------------------------------
# Account contexts


def _load_instance(ctx: InvokeContext, meta: AccountMeta) -> CoordinatorInstance:
    """`Account<CoordinatorInstance>` with `seeds = [b"coordinator", run_id], bump = bump`."""
    instance = load_borsh_account(
        ctx, meta, CoordinatorInstance, ctx.program_id, "coordinator_instance"
    )
    require_seeds(
        meta,
        [CoordinatorInstance.SEEDS_PREFIX, bytes_from_string(instance.run_id)],
        ctx.program_id,
        "coordinator_instance",
        instance.bump,
    )
    return instance


def _check_account(
    ctx: InvokeContext,
    meta: AccountMeta,
    instance: CoordinatorInstance,
    *,
    version: bool = True,
) -> bytes:
    """`AccountLoader<CoordinatorAccount>`, `mut`, the instance's account, version 1."""
    require_mut(meta, "coordinator_account")
    _, data = load_account_data(
        ctx, meta, ctx.program_id, "CoordinatorAccount", "coordinator_account"
    )
    require(bytes(meta.pubkey) == instance.coordinator_account, "coordinator_account")
    if version:
        version_value = int.from_bytes(
            data[_OFFSETS["version"] : _OFFSETS["version"] + 8], "little"
        )
        require(version_value == CoordinatorAccount.VERSION, "coordinator_account")
    return data


def _owner_accounts(ctx: InvokeContext, accounts: Accounts) -> tuple[CoordinatorInstance, bytes]:
    accounts.signer("authority")
    instance = _load_instance(ctx, accounts["coordinator_instance"])
    data = _check_account(ctx, accounts["coordinator_account"], instance)
    require(bytes(accounts.key("authority")) == instance.main_authority, "coordinator_instance")
    return instance, data


def _permissionless_accounts(ctx: InvokeContext, accounts: Accounts) -> bytes:
    accounts.signer("user")
    instance = _load_instance(ctx, accounts["coordinator_instance"])
    return _check_account(ctx, accounts["coordinator_account"], instance)


def _owner_account(ctx: InvokeContext, accounts: Accounts) -> CoordinatorAccount:
    """The coordinator account an owner's instruction changes, its nonce already counted up
    (the first thing those instructions do upstream)."""
    _, data = _owner_accounts(ctx, accounts)
    account = _load_mut(data)
    _increment_nonce(ctx, account)
    return account


def _load_mut(data: bytes) -> CoordinatorAccount:
    try:
        return coordinator_account_from_bytes(data)
    except CoordinatorAccountError:
        raise anchor_error(
            AnchorErrorCode.AccountDidNotDeserialize, "coordinator_account"
        ) from None


def _store(ctx: InvokeContext, key: Pubkey, account: CoordinatorAccount) -> None:
    write_data(ctx, key, coordinator_account_to_bytes(account))


def _increment_nonce(ctx: InvokeContext, account: CoordinatorAccount) -> None:
    account.nonce += 1
    ctx.log(f"Nonce: {account.nonce}")


# ---------------------------------------------------------------------------------------------
# The instance state (upstream `CoordinatorInstanceState`)


def random_seed(unix_timestamp: int, slot: int) -> int:
    """`sha256(unix_timestamp.to_ne_bytes() ‖ slot.to_ne_bytes())[..8]` as a little-endian u64."""
    digest = hashlib.sha256(
        unix_timestamp.to_bytes(8, "little", signed=True) + slot.to_bytes(8, "little")
    ).digest()
    return int.from_bytes(digest[:8], "little")


def _tick(ctx: InvokeContext, state: CoordinatorInstanceState) -> None:
    coordinator = state.coordinator
    clients_state = state.clients_state
    active_ids = None
    if coordinator.run_state is RunState.WaitingForMembers:
        state.is_warmup_first_tick = True
        state.is_training_first_tick = True
        active_ids = clients_state.get_active_clients_ids()
        ctx.log(f"Pending active clients ids: {len(active_ids)}")
    ctx.log(f"Pre-tick run state: {coordinator.run_state}")
    now = ctx.unix_timestamp()
    try:
        result = coordinator.tick(active_ids, now, random_seed(now, ctx.slot()))
    except CoordinatorError as e:
        raise _from_coordinator_error(e) from None
    match result:
        case TickResult.Ticked():
            if coordinator.is_warmup_just_starting() and state.is_warmup_first_tick:
                ctx.log("New epoch just starting, save epoch rewards rate")
                rates = clients_state.future_epoch_rates
                clients_state.current_epoch_rates = type(rates)(
                    rates.earning_rate_total_shared, rates.slashing_rate_per_client
                )
                state.is_warmup_first_tick = False
            elif coordinator.is_training_just_starting() and state.is_training_first_tick:
                ctx.log("New epoch just starting, save epoch active clients")
                clients_state.next_active = _checked_add(clients_state.next_active, 1)
                state.is_training_first_tick = False
        case TickResult.EpochEnd(success):
            ctx.log(f"Epoch end, sucecsss: {'true' if success else 'false'}")
            _distribute_rewards(state)
    ctx.log(f"Post-tick run state: {coordinator.run_state}")


def _distribute_rewards(state: CoordinatorInstanceState) -> None:
    finished = state.coordinator.epoch_state.clients
    exited = state.coordinator.epoch_state.exited_clients
    rates = state.clients_state.current_epoch_rates
    finished_index = exited_index = 0
    for client in state.clients_state.clients:
        if finished_index < len(finished) and client.id == finished[finished_index].id:
            if finished[finished_index].state is ClientState.Healthy:
                share = rates.earning_rate_total_shared // len(finished)
                client.earned = _checked_add(client.earned, share)
            finished_index += 1
        if exited_index < len(exited) and client.id == exited[exited_index].id:
            if exited[exited_index].state is ClientState.Ejected:
                client.slashed = _checked_add(client.slashed, rates.slashing_rate_per_client)
            exited_index += 1


def _checked_add(a: int, b: int) -> int:
    # The programs are built with overflow checks on.
    if a + b >= 1 << 64:
        raise ProgramPanic("attempt to add with overflow")
    return a + b


def _find_signer(state: CoordinatorInstanceState, signer: Pubkey) -> Any:
    identity = state.clients_state.find_signer(bytes(signer))
    if identity is None:
        raise _error("SignerNotAClient")
    return identity


# ---------------------------------------------------------------------------------------------
# Instructions


def _init_coordinator(
    ctx: InvokeContext, accounts: Accounts, args: coordinator_ix.InitCoordinatorArgs
) -> None:
    params = args.params
    payer = require_payer(accounts)
    instance_meta = accounts["coordinator_instance"]
    bump = init_pda(
        ctx,
        payer.pubkey,
        instance_meta,
        [CoordinatorInstance.SEEDS_PREFIX, bytes_from_string(params.run_id)],
        CoordinatorInstance.SPACE,
        "coordinator_instance",
    )
    account_meta = accounts.mutable("coordinator_account")
    account = require_owner(ctx, account_meta, ctx.program_id, "coordinator_account")
    require_program(accounts["system_program"], SYSTEM_PROGRAM, "system_program")

    if len(params.run_id.encode("utf-8")) > SOLANA_RUN_ID_MAX_LEN:
        raise _error("RunIdInvalidLength")
    instance = CoordinatorInstance(
        bump,
        params.main_authority,
        params.join_authority,
        bytes(account_meta.pubkey),
        params.run_id,
    )
    data = bytearray(account.data)
    if len(data) != COORDINATOR_ACCOUNT_SPACE:
        raise _error("CoordinatorAccountIncorrectSize")
    if any(data[:DISCRIMINATOR_LEN]):
        raise anchor_error(AnchorErrorCode.AccountDiscriminatorAlreadySet)
    # Only these bytes are written; the rest of the (zeroed) account is the zeroed state.
    data[:DISCRIMINATOR_LEN] = COORDINATOR_ACCOUNT_DISCRIMINATOR
    data[_OFFSETS["version"] : _OFFSETS["version"] + 8] = CoordinatorAccount.VERSION.to_bytes(
        8, "little"
    )
    data[_OFFSETS["nonce"] : _OFFSETS["nonce"] + 8] = bytes(8)
    data[_OFFSETS["client_version"] : _OFFSETS["client_version"] + 96] = fixed_str_bytes(
        params.client_version, 96
    )
    data[_OFFSETS["run_id"] : _OFFSETS["run_id"] + 32] = fixed_str_bytes(params.run_id, 32)
    write_data(ctx, account_meta.pubkey, bytes(data))
    write_data(
        ctx,
        instance_meta.pubkey,
        encode_anchor_account(instance, CoordinatorInstance, CoordinatorInstance.SPACE),
    )


def _free_coordinator(
    ctx: InvokeContext, accounts: Accounts, args: coordinator_ix.FreeCoordinatorArgs
) -> None:
    authority = accounts.signer("authority")
    spill = accounts.mutable("spill")
    require_system_account(ctx, spill, "spill")
    instance_meta = accounts.mutable("coordinator_instance")
    instance = _load_instance(ctx, instance_meta)
    account_meta = accounts.mutable("coordinator_account")
    _, data = load_account_data(
        ctx, account_meta, ctx.program_id, "CoordinatorAccount", "coordinator_account"
    )
    require(bytes(authority.pubkey) == instance.main_authority, "coordinator_instance")
    require(bytes(account_meta.pubkey) == instance.coordinator_account, "coordinator_account")
    run_state = data[_OFFSETS["run_state"]]
    if run_state not in (
        RunState.Uninitialized.value,
        RunState.Finished.value,
        RunState.Paused.value,
    ):
        raise _error("CloseCoordinatorNotHalted")
    close_account(ctx, instance_meta.pubkey, spill.pubkey)
    close_account(ctx, account_meta.pubkey, spill.pubkey)


def _update(ctx: InvokeContext, accounts: Accounts, args: coordinator_ix.UpdateArgs) -> None:
    account = _owner_account(ctx, accounts)
    state = account.state
    coordinator = state.coordinator
    changes_run = args.config is not None or args.model is not None or args.progress is not None
    if coordinator.run_state is RunState.Finished:
        raise _error("UpdateConfigFinished")
    if not coordinator.halted() and changes_run:
        raise _error("UpdateConfigNotHalted")
    if args.metadata is not None:
        state.metadata = args.metadata
    if args.config is not None:
        if args.config.check_error() is not None:
            raise _error("ConfigSanityCheckFailed")
        coordinator.config = args.config
    if args.model is not None:
        if not args.model.check():
            raise _error("ModelSanityCheckFailed")
        coordinator.model = args.model
    if (args.config is not None or args.model is not None) and not (
        coordinator.check_cold_start_warmup_steps()
    ):
        raise _error("ConfigSanityCheckFailed")
    if args.progress is not None:
        if not args.progress.check():
            raise _error("ModelSanityCheckFailed")  # (sic) upstream's error
        coordinator.progress = args.progress
    _store(ctx, accounts.key("coordinator_account"), account)


def _update_client_version(
    ctx: InvokeContext,
    accounts: Accounts,
    args: coordinator_ix.UpdateClientVersionArgs,
) -> None:
    _, data = _owner_accounts(ctx, accounts)
    account = _load_mut(data)
    if not account.state.coordinator.halted():
        raise _error("UpdateConfigNotHalted")
    if len(args.new_version.encode("utf-8")) > 96:
        raise ProgramPanic("called `Result::unwrap()` on an `Err` value (client version too long)")
    account.state.client_version = args.new_version
    ctx.log(f"new version: {args.new_version}")
    _store(ctx, accounts.key("coordinator_account"), account)


def _set_future_epoch_rates(
    ctx: InvokeContext,
    accounts: Accounts,
    args: coordinator_ix.SetFutureEpochRatesArgs,
) -> None:
    account = _owner_account(ctx, accounts)
    rates = account.state.clients_state.future_epoch_rates
    if args.epoch_earning_rate_total_shared is not None:
        rates.earning_rate_total_shared = args.epoch_earning_rate_total_shared
    if args.epoch_slashing_rate_per_client is not None:
        rates.slashing_rate_per_client = args.epoch_slashing_rate_per_client
    _store(ctx, accounts.key("coordinator_account"), account)


def _join_run(ctx: InvokeContext, accounts: Accounts, args: coordinator_ix.JoinRunArgs) -> None:
    user = accounts.signer("user")
    authorization = load_borsh_account(
        ctx,
        accounts["authorization"],
        Authorization,
        ctx.ledger.program_ids.authorizer_key,
        "authorization",
    )
    instance = _load_instance(ctx, accounts["coordinator_instance"])
    data = _check_account(ctx, accounts["coordinator_account"], instance)
    require(
        authorization.is_valid_for(
            instance.join_authority, bytes(user.pubkey), JOIN_RUN_AUTHORIZATION_SCOPE
        ),
        "authorization",
    )
    client_id = args.params.client_id
    if client_id.signer != bytes(user.pubkey):
        raise _error("SignerMismatch")
    account = _load_mut(data)
    _increment_nonce(ctx, account)
    state = account.state
    verification = _Verification.of(ctx, accounts, state)
    if verification is not None:
        until = verification.value.banned_until(client_id.signer)
        if until is not None and state.coordinator.progress.epoch < until:
            ctx.log(f"{client_id} is banned from the run's epochs before {until}")
            raise _error("ClientBanned")
    clients_state = state.clients_state
    existing = next((c for c in clients_state.clients if c.id == client_id), None)
    if existing is not None:
        # Equality is on the signer only: refresh the p2p key too.
        existing.id = client_id
        existing.active = clients_state.next_active
        ctx.log(f"Existing client {client_id} re-joined")
    else:
        if state.coordinator.config.global_batch_size_end == len(clients_state.clients):
            raise _error("MoreClientsThanBatches")
        if len(clients_state.clients) >= 256:
            raise _error("ClientsFull")
        clients_state.clients.append(SolanaClient(client_id, active=clients_state.next_active))
        ctx.log(f"New client {client_id} joined, {len(clients_state.clients)} total clients")
    if not state.coordinator.halted():
        _tick(ctx, state)
    _store(ctx, accounts.key("coordinator_account"), account)


def _set_paused(ctx: InvokeContext, accounts: Accounts, args: coordinator_ix.SetPausedArgs) -> None:
    account = _owner_account(ctx, accounts)
    state = account.state
    coordinator = state.coordinator
    now = ctx.unix_timestamp()
    ctx.log(
        f"set_paused called: paused={'true' if args.paused else 'false'}, "
        f"state={coordinator.run_state}"
    )
    try:
        if args.paused:
            coordinator.pause(now)
        else:
            if coordinator.config.check_error() is not None:
                raise _error("ConfigSanityCheckFailed")
            if not coordinator.model.check():
                raise _error("ModelSanityCheckFailed")
            if not coordinator.check_cold_start_warmup_steps():
                raise _error("ConfigSanityCheckFailed")
            if coordinator.run_state is RunState.Uninitialized:
                # The only way out of Uninitialized: the checks above have passed.
                coordinator.run_state = RunState.Paused
                coordinator.progress.step = 1
            if not coordinator.progress.check():
                raise _error("ProgressSanityCheckFailed")
            coordinator.resume(now)
    except CoordinatorError as e:
        raise _from_coordinator_error(e) from None
    if not args.paused:
        # Everyone must join again.
        state.clients_state.next_active = _checked_add(state.clients_state.next_active, 1)
        _tick(ctx, state)
    _store(ctx, accounts.key("coordinator_account"), account)


def _tick_ix(ctx: InvokeContext, accounts: Accounts, args: coordinator_ix.TickArgs) -> None:
    data = _permissionless_accounts(ctx, accounts)
    account = _load_mut(data)
    _increment_nonce(ctx, account)
    verification = _Verification.of(ctx, accounts, account.state)
    if verification is not None:
        verification.record_duties(account.state.coordinator)
    _tick(ctx, account.state)
    if verification is not None:
        verification.record_duties(account.state.coordinator)
        verification.store(ctx)
    _store(ctx, accounts.key("coordinator_account"), account)


def _member_instruction(
    ctx: InvokeContext,
    accounts: Accounts,
    act: Callable[[CoordinatorInstanceState, Any, _Verification | None], None],
    *,
    tick_when_halted: bool = True,
) -> None:
    """The shell of the instructions a run member signs: nonce, signer lookup, the coordinator
    call (its errors become program errors), then a tick; in a verified run the round's duties
    are recorded before and after, and the verification account stored."""
    account = _load_mut(_permissionless_accounts(ctx, accounts))
    _increment_nonce(ctx, account)
    state = account.state
    identity = _find_signer(state, accounts.key("user"))
    verification = _Verification.of(ctx, accounts, state)
    if verification is not None:
        verification.record_duties(state.coordinator)
    try:
        act(state, identity, verification)
    except CoordinatorError as e:
        raise _from_coordinator_error(e) from None
    if tick_when_halted or not state.coordinator.halted():
        _tick(ctx, state)
    else:
        ctx.log(
            f"Checkpoint recorded while halted (state: {state.coordinator.run_state}), "
            "skipping tick"
        )
    if verification is not None:
        verification.record_duties(state.coordinator)
        verification.store(ctx)
    _store(ctx, accounts.key("coordinator_account"), account)


def _witness(ctx: InvokeContext, accounts: Accounts, args: coordinator_ix.WitnessArgs) -> None:
    def act(state: CoordinatorInstanceState, identity: Any, _: _Verification | None) -> None:
        state.coordinator.witness(identity, args.witness(), ctx.unix_timestamp())

    _member_instruction(ctx, accounts, act)


def _warmup_witness(
    ctx: InvokeContext, accounts: Accounts, args: coordinator_ix.WarmupWitnessArgs
) -> None:
    def act(state: CoordinatorInstanceState, identity: Any, _: _Verification | None) -> None:
        now = ctx.unix_timestamp()
        seed = random_seed(now, ctx.slot())
        state.coordinator.warmup_witness(identity, args.witness(), now, seed)

    _member_instruction(ctx, accounts, act)


def _health_check(
    ctx: InvokeContext, accounts: Accounts, args: coordinator_ix.HealthCheckArgs
) -> None:
    def act(state: CoordinatorInstanceState, identity: Any, _: _Verification | None) -> None:
        state.coordinator.health_check(identity, [(args.id, args.proof())])

    _member_instruction(ctx, accounts, act)


def _checkpoint(
    ctx: InvokeContext, accounts: Accounts, args: coordinator_ix.CheckpointArgs
) -> None:
    def act(state: CoordinatorInstanceState, identity: Any, _: _Verification | None) -> None:
        clients = state.coordinator.epoch_state.clients
        index = next((i for i, c in enumerate(clients) if c.id == identity), None)
        if index is None:
            raise _error("SignerNotAClient")
        state.coordinator.checkpoint(identity, index, args.repo)

    _member_instruction(ctx, accounts, act, tick_when_halted=False)


# ---------------------------------------------------------------------------------------------
# Verification (beyond upstream: `psyche.solana.verification`)


class _Verification:
    """The run's verification account as an instruction found it, and its address."""

    def __init__(self, ctx: InvokeContext, meta: AccountMeta, value: RunVerification) -> None:
        self.log = ctx.log
        self.meta = meta
        self.value = value

    @classmethod
    def load(
        cls, ctx: InvokeContext, meta: AccountMeta, coordinator_account: Pubkey
    ) -> _Verification:
        require_mut(meta, "verification")
        require_seeds(
            meta,
            [RunVerification.SEEDS_PREFIX, bytes(coordinator_account)],
            ctx.program_id,
            "verification",
        )
        value = load_borsh_account(ctx, meta, RunVerification, ctx.program_id, "verification")
        return cls(ctx, meta, value)

    @classmethod
    def of(
        cls, ctx: InvokeContext, accounts: Accounts, state: CoordinatorInstanceState
    ) -> _Verification | None:
        """The account in a run with `verification_percent > 0` (named `verification`, or
        after the instruction's own accounts); None in a run without."""
        if state.coordinator.config.verification_percent == 0:
            return None
        meta = accounts.metas.get("verification")
        if meta is None:
            if len(ctx.metas) <= len(accounts.metas):
                raise anchor_error(AnchorErrorCode.AccountNotEnoughKeys, "verification")
            meta = ctx.metas[len(accounts.metas)]
        found = cls.load(ctx, meta, accounts.key("coordinator_account"))
        # The run's `verifiers_train` and `exact_verification_threads` live here (the
        # coordinator account has no room for them): the duties, data assignment, followers and
        # health rule below read them from the config.
        found.value.apply_to(state.coordinator.config)
        return found

    def record_duties(self, coordinator: Coordinator) -> None:
        """Record who verifies and who follows what in the current round, once
        (`ServerCore._record_duties`)."""
        if coordinator.run_state not in (RunState.RoundTrain, RunState.RoundWitness):
            return
        step = coordinator.progress.step
        if self.value.round(step) is not None:
            return
        try:
            duties = verification_duties_for_state(coordinator)
        except (CoordinatorError, CoordinatorPanic) as e:
            self.log(f"cannot derive the verification duties of step {step}: {e}")
            return
        self.value.keep_round(RoundVerification(duties))
        following = round_following(coordinator, duties)
        if following is not None:
            self.value.keep_following(following)

    def store(self, ctx: InvokeContext) -> None:
        """Write the account back, the bytes past its encoding zeroed: `verifiers_train` was
        appended after the variable-length log, so an encoding that shrank must not leave old
        bytes where a later field is read (the account would not decode, or read a stale
        value)."""
        store_borsh_account(ctx, self.meta.pubkey, self.value, zero_tail=True)


def _init_verification(
    ctx: InvokeContext, accounts: Accounts, args: coordinator_ix.InitVerificationArgs
) -> None:
    payer = require_payer(accounts)
    instance = _load_instance(ctx, accounts["coordinator_instance"])
    account_meta = accounts["coordinator_account"]
    load_account_data(
        ctx, account_meta, ctx.program_id, "CoordinatorAccount", "coordinator_account"
    )
    require(bytes(account_meta.pubkey) == instance.coordinator_account, "coordinator_account")
    require_program(accounts["system_program"], SYSTEM_PROGRAM, "system_program")
    meta = accounts["verification"]
    bump = init_pda(
        ctx,
        payer.pubkey,
        meta,
        [RunVerification.SEEDS_PREFIX, bytes(account_meta.pubkey)],
        RUN_VERIFICATION_SPACE,
        "verification",
    )
    write_data(
        ctx,
        meta.pubkey,
        encode_anchor_account(
            RunVerification(bump, bytes(account_meta.pubkey)),
            RunVerification,
            RUN_VERIFICATION_SPACE,
        ),
    )


def _verification_report(
    ctx: InvokeContext, accounts: Accounts, args: coordinator_ix.VerificationReportArgs
) -> None:
    """A member's report (`ServerCore.on_verification`): refused unless it is a client of the
    epoch, about a recent round's own duties, its first for that round; the disputes it lets the
    tie-breakers decide are applied (`_punish`)."""
    too_many = finding_limit(args.findings)
    if too_many is not None:
        ctx.log(f"verification report refused: {too_many}")
        raise _error("VerificationReportRefused")
    report = args.report()
    verified = _precompile_verified(ctx, accounts["instructions"])

    def act(state: CoordinatorInstanceState, sender: Any, found: _Verification | None) -> None:
        if found is None:
            raise _error("VerificationOff")
        if all(c.id != sender for c in state.coordinator.epoch_state.clients):
            raise _error("SignerNotAClient")
        if is_follow_report(report):
            _following_report(ctx, state, found, sender, report)
            return
        verification = found.value
        stored = verification.round(report.step)
        record = None if stored is None else stored.record()
        problem = (
            f"step {report.step} is not a recent verified round"
            if record is None
            else record.add(sender, report, verified)
        )
        if problem is not None or record is None:
            ctx.log(f"verification report from {sender} refused: {problem}")
            raise _error("VerificationReportRefused")
        entries = findings_entries(record, sender, report)
        entries += [_punish(ctx, state, found, r, deciders(record, r)) for r in record.resolve()]
        verification.keep_round(record)
        verification.note(entries)

    _member_instruction(ctx, accounts, act)


def _following_report(
    ctx: InvokeContext,
    state: CoordinatorInstanceState,
    found: _Verification,
    sender: Any,
    report: VerificationReport,
) -> None:
    """A follower's exact findings (`ServerCore._on_following`): heard once per sender and
    round, only about the trainers it follows (`RoundFollowing.add`, the one copy of the rule);
    what all three followers' words decide is applied (`_punish`, the deciders credited)."""
    verification = found.value
    stored = verification.followed_round(report.step)
    record = None if stored is None else stored.record()
    problem = (
        f"step {report.step} is not a recent followed round"
        if record is None
        else record.add(sender, report)
    )
    if problem is not None or record is None:
        ctx.log(f"follower report from {sender} refused: {problem}")
        raise _error("VerificationReportRefused")
    entries = findings_entries(record, sender, report)
    entries += [_punish(ctx, state, found, r, follow_deciders(record, r)) for r in record.resolve()]
    verification.keep_following(record)
    verification.note(entries)


def _set_verifiers_train(
    ctx: InvokeContext, accounts: Accounts, args: coordinator_ix.SetVerifiersTrainArgs
) -> None:
    """The owner sets the run's `verifiers_train` (kept in the verification account): like
    `update`'s config, only while the run is halted, and only in a run that verifies."""
    _set_verification_setting(ctx, accounts, "verifiers_train", bool(args.verifiers_train))


def _set_exact_verification_threads(
    ctx: InvokeContext,
    accounts: Accounts,
    args: coordinator_ix.SetExactVerificationThreadsArgs,
) -> None:
    """The owner sets the run's `exact_verification_threads` (kept in the verification account),
    as `set_verifiers_train`: only while halted, only in a run that verifies, at most
    `MAX_EXACT_VERIFICATION_THREADS` (`ConfigSanityCheckFailed`, as `update`'s config checks)."""
    threads = int(args.exact_verification_threads)
    _set_verification_setting(
        ctx, accounts, "exact_verification_threads", threads, most=MAX_EXACT_VERIFICATION_THREADS
    )


def _set_verification_setting(
    ctx: InvokeContext, accounts: Accounts, name: str, value: Any, *, most: int | None = None
) -> None:
    """The owner's setters of the verification account's settings (`set_verifiers_train`,
    `set_exact_verification_threads`), one set of rules in one order: the owner's accounts, the
    run not finished (`UpdateConfigFinished`), halted (`UpdateConfigNotHalted`), verifying
    (`VerificationOff`), `value` at most `most` (`ConfigSanityCheckFailed`); then the account
    is loaded, the setting `name` written and logged."""
    _, data = _owner_accounts(ctx, accounts)
    coordinator = _load_mut(data).state.coordinator
    if coordinator.run_state is RunState.Finished:
        raise _error("UpdateConfigFinished")
    if not coordinator.halted():
        raise _error("UpdateConfigNotHalted")
    if coordinator.config.verification_percent == 0:
        raise _error("VerificationOff")
    if most is not None and value > most:
        raise _error("ConfigSanityCheckFailed")
    found = _Verification.load(ctx, accounts["verification"], accounts.key("coordinator_account"))
    setattr(found.value, name, value)
    ctx.log(f"{name}: {getattr(found.value, name)}")
    found.store(ctx)


def _precompile_verified(ctx: InvokeContext, meta: AccountMeta) -> SignatureCheck:
    """The program's draw-signature check: the transaction's `Ed25519SigVerify` instructions
    read back through the instructions sysvar (`#[account(address = sysvar::instructions::ID)]`;
    `load_instruction_at_checked`), as a program on a real cluster must (it has no ed25519
    call; the runtime failed the transaction already if a precompile's signature is bad). A
    signature counts when a precompile names exactly that key, message and signature in its own
    data (every offsets entry's instruction index `u16::MAX`: a precompile whose offsets point
    into another instruction is not read)."""
    if meta.pubkey != SYSVAR_INSTRUCTIONS:
        raise anchor_error(AnchorErrorCode.ConstraintAddress, "instructions")
    account = ctx.get(meta.pubkey)
    data = b"" if account is None else bytes(account.data)
    signed: set[tuple[bytes, bytes, bytes]] = set()
    try:
        for index in range(load_instruction_count(data)):
            instruction = load_instruction_at(data, index)
            if instruction.program_id != ED25519_PROGRAM:
                continue
            # read with no other instruction's data: an entry pointing elsewhere is an error
            found = signed_messages(bytes(instruction.data), [])
            if not isinstance(found, PrecompileError):
                signed.update((e.public_key, e.message, e.signature) for e in found)
    except SysvarDecodeError:
        raise ProgramPanic("instructions sysvar: cannot deserialize") from None

    def verified(public_key: bytes, message: bytes, signature: bytes) -> bool:
        return (bytes(public_key), bytes(message), bytes(signature)) in signed

    return verified


def _punish(
    ctx: InvokeContext,
    state: CoordinatorInstanceState,
    verification: _Verification,
    resolution: Resolution,
    credited: list[NodeIdentity],
) -> VerificationEntry:
    """The loser of a decided dispute is dropped (if still healthy), banned as the server bans,
    slashed the epoch's `slashing_rate_per_client`, and that credited to the deciders
    (`credited`). Once per loser and epoch, as the ban: a verifier that falsely accused two
    results of a round loses two disputes, and is slashed once."""
    loser = resolution.loser
    ban = verification.value.ban(loser.signer, state.coordinator.progress.epoch)
    rate = state.clients_state.current_epoch_rates.slashing_rate_per_client
    entry = punishment(resolution, credited, 0 if ban is None else rate)
    for client in state.coordinator.epoch_state.clients:
        if client.id == loser and client.state is ClientState.Healthy:
            client.state = ClientState.Dropped
    paid = set(entry.credited)
    for known in state.clients_state.clients:
        if known.id == loser:
            known.slashed = _checked_add(known.slashed, entry.slashed)
        if known.id in paid:
            known.earned = _checked_add(known.earned, entry.credit)
    if ban is not None:
        ctx.log(f"{loser} banned from the run's epochs before {ban.until_epoch}")
    ctx.log(entry_line(entry))
    return entry


_HANDLERS: dict[str, Handler] = {
    "init_coordinator": _init_coordinator,
    "free_coordinator": _free_coordinator,
    "update": _update,
    "update_client_version": _update_client_version,
    "set_future_epoch_rates": _set_future_epoch_rates,
    "join_run": _join_run,
    "set_paused": _set_paused,
    "tick": _tick_ix,
    "witness": _witness,
    "warmup_witness": _warmup_witness,
    "health_check": _health_check,
    "checkpoint": _checkpoint,
    "init_verification": _init_verification,
    "verification_report": _verification_report,
    "set_verifiers_train": _set_verifiers_train,
    "set_exact_verification_threads": _set_exact_verification_threads,
}


__all__ = ["process", "random_seed"]
