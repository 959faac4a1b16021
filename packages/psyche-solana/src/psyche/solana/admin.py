"""Run administration on Solana: what `psyche-solana-client`'s commands do, without the printing.

Each function mirrors one upstream command (pre-#480 `psyche-solana-client`, now
`run-manager`): it reads what it needs, checks what can be checked before paying for a
transaction (the run exists, the wallet is its authority, the config is valid), builds the same
instructions upstream builds and sends them through `SolanaBackend`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from solders import system_program
from solders.instruction import Instruction
from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.signature import Signature

from psyche.coordinator import CoordinatorProgress, RunState
from psyche.coordinator.config import CoordinatorConfig
from psyche.coordinator.data_selection import get_data_index_for_step
from psyche.coordinator.model import Checkpoint, HubRepo, Model
from psyche.core.definitions import OptimizerDefinition
from psyche.core.fixed import FixedStringError, fixed_str_try_from
from psyche.solana import pda
from psyche.solana.backend import SolanaBackend, SolanaBackendError
from psyche.solana.instructions import authorizer as authorizer_ix
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.instructions import treasurer as treasurer_ix
from psyche.solana.pubkey import pubkey_bytes
from psyche.solana.rpc import AccountNotFound
from psyche.solana.state import (
    COORDINATOR_ACCOUNT_SPACE,
    JOIN_RUN_AUTHORIZATION_SCOPE,
    Authorization,
    CoordinatorInstance,
    RunMetadata,
)

SOLANA_RUN_ID_MAX_LEN = 32
LAMPORTS_PER_SOL = 1_000_000_000


class AdminError(Exception):
    """A command that cannot proceed, with a message for the user."""


def lamports_to_sol(lamports: int) -> float:
    return lamports / LAMPORTS_PER_SOL


def ui_amount_to_native_amount(ui_amount: float, decimals: int) -> int:
    """`round(ui_amount * 10^decimals)` (half away from zero, as Rust's `f64::round`)."""
    from psyche.core.numeric import round_half_away_from_zero

    return int(round_half_away_from_zero(ui_amount * float(10**decimals)))


def native_amount_to_ui_amount(native_amount: int, decimals: int) -> float:
    return native_amount / float(10**decimals)


def check_run_id(run_id: str) -> None:
    length = len(run_id.encode("utf-8"))
    if length > SOLANA_RUN_ID_MAX_LEN:
        raise AdminError(f"run_id must be 32 bytes or less, got {length} bytes")


def _is_missing_account(error: BaseException) -> bool:
    return isinstance(error, SolanaBackendError) and isinstance(error.cause, AccountNotFound)


@dataclass(frozen=True)
class RunRef:
    run_id: str
    instance_address: Pubkey
    instance: CoordinatorInstance

    @property
    def account_address(self) -> Pubkey:
        return Pubkey.from_bytes(self.instance.coordinator_account)


async def load_run(backend: SolanaBackend, run_id: str) -> RunRef:
    """The run's `CoordinatorInstance`; AdminError when there is no such run."""
    check_run_id(run_id)
    address = pda.find_coordinator_instance(run_id, backend.ids)
    try:
        instance = await backend.get_coordinator_instance(address)
    except SolanaBackendError as e:
        if _is_missing_account(e):
            raise AdminError(
                f"run {run_id!r} not found: no coordinator instance account at {address} "
                f"(RPC {backend.cluster.rpc}, coordinator program {backend.ids.coordinator})"
            ) from None
        raise
    return RunRef(run_id, address, instance)


def _require_main_authority(backend: SolanaBackend, expected: bytes, what: str) -> None:
    if pubkey_bytes(backend.get_payer()) != expected:
        raise AdminError(
            f"wallet {backend.get_payer()} is not the main authority of {what} "
            f"(the main authority is {Pubkey.from_bytes(expected)})"
        )


async def _authority_check(
    backend: SolanaBackend, run: RunRef, treasurer_index: int | None
) -> None:
    if treasurer_index is None:
        _require_main_authority(backend, run.instance.main_authority, f"run {run.run_id!r}")
        return
    treasurer_run = await backend.get_treasurer_run(pda.find_run(treasurer_index, backend.ids))
    _require_main_authority(
        backend, treasurer_run.main_authority, f"run {run.run_id!r} (treasurer run)"
    )


# ---------------------------------------------------------------------------------------------
# Commands


@dataclass(frozen=True)
class CreatedRun:
    signature: Signature
    instance_address: Pubkey
    account_address: Pubkey
    locked_lamports: int


async def create_run(
    backend: SolanaBackend,
    run_id: str,
    client_version: str,
    *,
    treasurer_index: int | None = None,
    treasurer_collateral_mint: Pubkey | None = None,
    join_authority: Pubkey | None = None,
) -> CreatedRun:
    """Create the coordinator account and initialize the run in one transaction."""
    check_run_id(run_id)
    if treasurer_index is not None and treasurer_collateral_mint is None:
        raise AdminError(
            "The treasurer_index is set, but treasurer_collateral_mint is not. Please provide a "
            "collateral mint address if you want to create a run with a treasurer."
        )
    payer = backend.get_payer()
    join_authority = join_authority or payer
    instance_address = pda.find_coordinator_instance(run_id, backend.ids)
    existing = await backend.get_account_info(instance_address)
    if existing is not None:
        raise AdminError(f"run {run_id!r} already exists (coordinator instance {instance_address})")
    account_signer = Keypair()
    rent = await backend.get_minimum_balance_for_rent_exemption(COORDINATOR_ACCOUNT_SPACE)
    create = system_program.create_account(
        system_program.CreateAccountParams(
            from_pubkey=payer,
            to_pubkey=account_signer.pubkey(),
            lamports=rent,
            space=COORDINATOR_ACCOUNT_SPACE,
            owner=backend.ids.coordinator_key,
        )
    )
    if treasurer_collateral_mint is not None:
        index = pda.compute_deterministic_treasurer_index(run_id, treasurer_index)
        init = treasurer_ix.treasurer_run_create(
            payer,
            run_id,
            client_version,
            index,
            treasurer_collateral_mint,
            account_signer.pubkey(),
            payer,
            join_authority,
            backend.ids,
        )
    else:
        init = coordinator_ix.coordinator_init_coordinator(
            payer,
            run_id,
            client_version,
            account_signer.pubkey(),
            payer,
            join_authority,
            backend.ids,
        )
    signature = await backend.send_and_retry(
        "Create and init run", [create, init], [account_signer]
    )
    locked = await backend.get_balance(account_signer.pubkey())
    return CreatedRun(signature, instance_address, account_signer.pubkey(), locked)


async def close_run(backend: SolanaBackend, run_id: str) -> tuple[Signature, int]:
    """Free the run's accounts; the rent goes back to the wallet. Returns the recovered lamports."""
    run = await load_run(backend, run_id)
    _require_main_authority(backend, run.instance.main_authority, f"run {run_id!r}")
    payer = backend.get_payer()
    before = await backend.get_balance(payer)
    signature = await backend.send_and_retry(
        "Close run",
        [
            coordinator_ix.coordinator_close_run(
                run.instance_address, run.account_address, payer, backend.ids
            )
        ],
    )
    after = await backend.get_balance(payer)
    return signature, after - before


@dataclass(frozen=True)
class ConfigUpdate:
    signature: Signature
    metadata: RunMetadata | None
    config: CoordinatorConfig | None
    model: Model | None
    progress: CoordinatorProgress | None
    client_version: str | None


def load_config_file(path: Path) -> tuple[CoordinatorConfig, Model]:
    """A run config TOML (`[config]` and `[model]`), fully validated, including the checks the
    program makes before it accepts a config."""
    from psyche.coordinator.run_config import ConfigFileError, load_run_config
    from psyche.coordinator.verification import verification_problem

    try:
        loaded = load_run_config(path)
    except ConfigFileError as e:
        raise AdminError(f"invalid config: {e}") from None
    problems = []
    error = loaded.config.check_error()
    if error is not None:
        problems.append(f"[config] {error.field}: {error.value}")
    problems += [f"[model] {p}" for p in loaded.model.check_problems()]
    unrunnable = verification_problem(loaded.config)
    if unrunnable is not None:  # a run with too few clients for a verifier (issue 27)
        problems.append(f"[{unrunnable[0]}]: {unrunnable[1]}")
    if problems:
        raise AdminError(f"invalid config {path}: " + "; ".join(problems))
    if loaded.llm.backup_data_locations:
        raise AdminError(
            f"invalid config {path}: a Solana run has exactly one data location; "
            f"{len(loaded.llm.data_locations)} were given"
        )
    optimizer = loaded.llm.optimizer
    if isinstance(optimizer, OptimizerDefinition.DiLoCo) and optimizer.value.peer_clip_multiple:
        raise AdminError(
            f"invalid config {path}: model.LLM.optimizer.DiLoCo.peer_clip_multiple (the bounded "
            "aggregate) cannot be set for a Solana run: the coordinator account has no room for "
            "it; set it to 0 or run with the centralized server"
        )
    return loaded.config, loaded.model


async def update_config(
    backend: SolanaBackend,
    run_id: str,
    *,
    treasurer_index: int | None = None,
    config_path: Path | None = None,
    restart_from_step: int | None = None,
    switch_to_hub: bool = False,
    name: str | None = None,
    description: str | None = None,
    num_parameters: int | None = None,
    vocab_size: int | None = None,
    client_version: str | None = None,
) -> ConfigUpdate:
    run = await load_run(backend, run_id)
    account = await backend.get_coordinator_account(run.account_address)
    coordinator = account.state.coordinator
    config: CoordinatorConfig | None = None
    model: Model | None = None
    if config_path is not None:
        config, model = load_config_file(config_path)
    if switch_to_hub:
        llm = (model if model is not None else coordinator.model).value
        match llm.checkpoint:
            case Checkpoint.P2P(repo) | Checkpoint.Dummy(repo):
                llm = dataclasses.replace(llm, checkpoint=Checkpoint.Hub(repo))
        model = Model.LLM(llm)

    current = account.state.metadata
    metadata = current
    try:
        if name is not None:
            metadata = dataclasses.replace(metadata, name=fixed_str_try_from(name, 64))
        if description is not None:
            metadata = dataclasses.replace(
                metadata, description=fixed_str_try_from(description, 280)
            )
    except FixedStringError as e:
        raise AdminError(f"run metadata: {e}") from None
    if num_parameters is not None:
        metadata = dataclasses.replace(metadata, num_parameters=num_parameters)
    if vocab_size is not None:
        metadata = dataclasses.replace(metadata, vocab_size=vocab_size)
    new_metadata = metadata if metadata != current else None

    # Compute the restart data index against the new config and model.
    if config is not None:
        coordinator.config = config
    if model is not None:
        coordinator.model = model
    progress = None
    if restart_from_step is not None:
        progress = CoordinatorProgress(
            epoch=coordinator.progress.epoch,
            step=restart_from_step,
            epoch_start_data_index=get_data_index_for_step(coordinator, restart_from_step),
        )

    coordinator_update = any(x is not None for x in (new_metadata, config, model, progress))
    if not coordinator_update and client_version is None:
        raise AdminError("this invocation would not update anything, bailing.")

    update = treasurer_ix.RunUpdateParams(
        metadata=new_metadata,
        config=config,
        model=model,
        progress=progress,
        client_version=client_version,
    )
    index = await backend.resolve_treasurer_index(run.run_id, treasurer_index)
    await _authority_check(backend, run, index)
    instructions = _owner_update(backend, run, index, update)
    if config is not None:
        instructions += await _verifiers_train_instructions(backend, run, index, config)
    signature = await backend.send_and_retry("Update config", instructions)
    return ConfigUpdate(signature, new_metadata, config, model, progress, client_version)


async def _verifiers_train_instructions(
    backend: SolanaBackend, run: RunRef, treasurer_index: int | None, config: CoordinatorConfig
) -> list[Instruction]:
    """What sets the `verifiers_train` and `exact_verification_threads` that `config` asks of
    the run where they differ from the run's (kept in its verification account:
    `psyche.solana.verification`): the coordinator's `set_verifiers_train` and
    `set_exact_verification_threads`, through the treasurer's `run_set_verifiers_train` and
    `run_set_exact_verification_threads` in a treasurer run
    (the run, not the wallet, is the coordinator's authority there; upstream's `run_update` has
    no field for it), after creating the verification account if nobody has. Empty when nothing
    changes, and when `config` does not verify: the option has no effect then (data selection
    draws verifiers only from a non-zero `verification_percent`) and the program refuses it
    (`VerificationOff`).

    They go in the transaction of the config's `update`, after it (the program checks the new
    `verification_percent`): a refusal rolls the config back too, never leaving it half-changed."""
    if config.verification_percent == 0:
        return []
    current = await backend.get_run_verification(run.account_address)
    train = config.verifiers_train
    threads = config.exact_verification_threads
    set_train = train != (current is not None and current.verifiers_train)
    set_threads = threads != (0 if current is None else current.exact_verification_threads)
    if not set_train and not set_threads:
        return []
    payer, ids = backend.get_payer(), backend.ids
    out = []
    address = pda.find_run_verification(run.account_address, ids)
    if await backend.get_account_info(address) is None:
        out.append(
            coordinator_ix.coordinator_init_verification(
                payer, run.instance_address, run.account_address, ids
            )
        )
    account, run_id = run.account_address, run.run_id
    if set_train:
        out.append(
            coordinator_ix.coordinator_set_verifiers_train(run_id, account, payer, train, ids)
            if treasurer_index is None
            else treasurer_ix.treasurer_run_set_verifiers_train(
                run_id, treasurer_index, account, payer, train, ids
            )
        )
    if set_threads:
        out.append(
            coordinator_ix.coordinator_set_exact_verification_threads(
                run_id, account, payer, threads, ids
            )
            if treasurer_index is None
            else treasurer_ix.treasurer_run_set_exact_verification_threads(
                run_id, treasurer_index, account, payer, threads, ids
            )
        )
    return out


async def _send_owner_update(
    backend: SolanaBackend,
    run: RunRef,
    treasurer_index: int | None,
    label: str,
    update: treasurer_ix.RunUpdateParams,
) -> Signature:
    """Send `update` signed by the wallet, which must be the run's main authority: through the
    run's treasurer when it has one (`treasurer_index`, else the one found), else as the
    coordinator instructions it stands for."""
    index = await backend.resolve_treasurer_index(run.run_id, treasurer_index)
    await _authority_check(backend, run, index)
    return await backend.send_and_retry(label, _owner_update(backend, run, index, update))


def _owner_update(
    backend: SolanaBackend,
    run: RunRef,
    treasurer_index: int | None,
    update: treasurer_ix.RunUpdateParams,
) -> list[Instruction]:
    """What the wallet (the run's main authority) sends to make `update`: the treasurer's
    `run_update` for a treasurer run, else the coordinator instructions it stands for."""
    payer = backend.get_payer()
    if treasurer_index is not None:
        return [
            treasurer_ix.treasurer_run_update(
                run.run_id, treasurer_index, run.account_address, payer, update, backend.ids
            )
        ]
    return [
        coordinator_ix.coordinator_owner_call(
            name, run.run_id, run.account_address, payer, args, backend.ids
        )
        for name, args in treasurer_ix.coordinator_updates(update)
    ]


async def set_paused(
    backend: SolanaBackend, run_id: str, paused: bool, treasurer_index: int | None = None
) -> Signature:
    run = await load_run(backend, run_id)
    update = treasurer_ix.RunUpdateParams(paused=paused)
    return await _send_owner_update(backend, run, treasurer_index, "Set paused", update)


async def set_future_epoch_rates(
    backend: SolanaBackend,
    run_id: str,
    *,
    treasurer_index: int | None = None,
    earning_rate_total_shared: float | None = None,
    slashing_rate_per_client: float | None = None,
) -> Signature:
    """Reward rates from the next epoch on (treasurer runs only; UI amounts of the mint)."""
    if earning_rate_total_shared is None and slashing_rate_per_client is None:
        raise AdminError(
            "At least one of earning rate or slashing rate must be provided: "
            "--earning-rate-total-shared or --slashing-rate-per-client"
        )
    run = await load_run(backend, run_id)
    index = await backend.resolve_treasurer_index(run_id, treasurer_index)
    if index is None:
        raise AdminError("Setting future epoch rates requires a treasurer.")
    treasurer_run = await backend.get_treasurer_run(pda.find_run(index, backend.ids))
    _require_main_authority(backend, treasurer_run.main_authority, f"run {run_id!r}")
    decimals = (
        await backend.get_token_mint(Pubkey.from_bytes(treasurer_run.collateral_mint))
    ).decimals

    def native(amount: float | None) -> int | None:
        return None if amount is None else ui_amount_to_native_amount(amount, decimals)

    update = treasurer_ix.RunUpdateParams(
        epoch_earning_rate_total_shared=native(earning_rate_total_shared),
        epoch_slashing_rate_per_client=native(slashing_rate_per_client),
    )
    return await backend.send_and_retry(
        "Set future epoch rates", _owner_update(backend, run, index, update)
    )


async def tick(backend: SolanaBackend, run: RunRef) -> Signature:
    account = await backend.get_coordinator_account(run.account_address)
    verification = backend.verification_account(run.account_address, account)
    return await backend.send_and_retry(
        "Tick", [backend.tick_instruction(run.instance_address, run.account_address, verification)]
    )


async def checkpoint(
    backend: SolanaBackend, run_id: str, repo: str, revision: str | None = None
) -> tuple[Signature, Checkpoint]:
    from psyche.core.fixed import fixed_str_from_str_truncated

    run = await load_run(backend, run_id)
    hub = HubRepo(
        fixed_str_from_str_truncated(repo, 64),
        None if revision is None else fixed_str_from_str_truncated(revision, 64),
    )
    repo_checkpoint = Checkpoint.Hub(hub)
    instruction = coordinator_ix.coordinator_checkpoint(
        run.instance_address, run.account_address, backend.get_payer(), repo_checkpoint, backend.ids
    )
    return await backend.send_and_retry("Checkpoint", [instruction]), repo_checkpoint


@dataclass(frozen=True)
class AuthorizationResult:
    address: Pubkey
    grantor: Pubkey
    grantee: Pubkey
    created: Signature | None
    changed: Signature | None
    authorization: Authorization


async def _set_active(
    backend: SolanaBackend,
    grantor: Pubkey,
    authorizer: Pubkey,
    address: Pubkey,
    active: bool,
) -> tuple[Signature | None, Authorization]:
    """The grantor's join authorization for `authorizer` (at `address`) made `active` (no
    transaction when it already is): the signature of the change, if one was sent, and the
    authorization as it is now."""
    authorization = await backend.get_authorization(address)
    if authorization.active == active:
        return None, authorization
    signature = await backend.send_and_retry(
        "Authorization activate" if active else "Authorization deactivate",
        [
            authorizer_ix.authorizer_authorization_grantor_update(
                grantor, authorizer, JOIN_RUN_AUTHORIZATION_SCOPE, active, backend.ids
            )
        ],
    )
    return signature, await backend.get_authorization(address)


async def join_authorization_create(
    backend: SolanaBackend, authorizer: Pubkey
) -> AuthorizationResult:
    """Let `authorizer` (the system program id: everyone) join the wallet's runs; creates the
    authorization if needed, then activates it."""
    payer = grantor = backend.get_payer()
    address = pda.find_join_authorization(grantor, authorizer, backend.ids)
    created = await backend.create_if_missing(
        "Authorization create",
        address,
        authorizer_ix.authorizer_authorization_create(payer, grantor, authorizer, ids=backend.ids),
    )
    activated, authorization = await _set_active(backend, grantor, authorizer, address, True)
    return AuthorizationResult(address, grantor, authorizer, created, activated, authorization)


async def join_authorization_set_delegates(
    backend: SolanaBackend,
    join_authority: Pubkey,
    *,
    delegates_clear: bool = False,
    delegates_added: list[Pubkey] | None = None,
) -> AuthorizationResult:
    """As the grantee of `join_authority`'s authorization, set the delegate keys."""
    grantee = backend.get_payer()
    address = pda.find_join_authorization(join_authority, grantee, backend.ids)
    try:
        await backend.get_authorization(address)
    except SolanaBackendError as e:
        if _is_missing_account(e):
            raise AdminError(
                f"no join authorization from {join_authority} to {grantee} (expected at "
                f"{address}); the join authority must run join-authorization-create first"
            ) from None
        raise
    signature = await backend.send_and_retry(
        "Authorization set delegates",
        [
            authorizer_ix.authorizer_authorization_grantee_update(
                grantee,
                join_authority,
                grantee,
                JOIN_RUN_AUTHORIZATION_SCOPE,
                delegates_clear,
                list(delegates_added or []),
                backend.ids,
            )
        ],
    )
    authorization = await backend.get_authorization(address)
    return AuthorizationResult(address, join_authority, grantee, None, signature, authorization)


async def join_authorization_read(
    backend: SolanaBackend, join_authority: Pubkey, authorizer: Pubkey | None = None
) -> AuthorizationResult:
    grantee = authorizer or Pubkey.default()
    address = pda.find_join_authorization(join_authority, grantee, backend.ids)
    try:
        authorization = await backend.get_authorization(address)
    except SolanaBackendError as e:
        if _is_missing_account(e):
            raise AdminError(f"no join authorization at {address}") from None
        raise
    return AuthorizationResult(address, join_authority, grantee, None, None, authorization)


async def join_authorization_delete(
    backend: SolanaBackend, authorizer: Pubkey
) -> AuthorizationResult:
    """Deactivate the wallet's authorization for `authorizer` (it stays, inactive)."""
    grantor = backend.get_payer()
    address = pda.find_join_authorization(grantor, authorizer, backend.ids)
    changed, authorization = await _set_active(backend, grantor, authorizer, address, False)
    return AuthorizationResult(address, grantor, authorizer, None, changed, authorization)


@dataclass(frozen=True)
class JoinCheck:
    """A join authorization covers the address; what the run says about joining now."""

    authorization: Pubkey
    run_state: RunState
    in_current_epoch: bool  # the address is a client of the epoch under way

    @property
    def is_paused(self) -> bool:
        return self.run_state in (RunState.Paused, RunState.Uninitialized)

    @property
    def can_join(self) -> bool:
        """Upstream's rule: a key already in the current epoch cannot join again (unless the
        run is halted, when the epoch's clients are stale)."""
        return self.is_paused or not self.in_current_epoch


async def can_join(
    backend: SolanaBackend, run_id: str, address: Pubkey, authorizer: Pubkey | None = None
) -> JoinCheck:
    """Whether `address` may join the run with the join authorization granted to `authorizer`
    (everyone when None), as upstream's `can-join`: AdminError with upstream's message when no
    authorization exists or it does not cover the address."""
    run = await load_run(backend, run_id)
    authorization_address = pda.find_join_authorization(
        run.instance.join_authority, authorizer, backend.ids
    )
    join_authority = Pubkey.from_bytes(run.instance.join_authority)
    if await backend.get_balance(authorization_address) == 0:
        shown = "None" if authorizer is None else f"Some({authorizer})"
        raise AdminError(
            f"Authorization does not exist for authorizer: {shown} (authorization address: "
            f"{authorization_address}, join authority: {join_authority}). Authorizer must be "
            "set to grantee pubkey for permissioned runs"
        )
    authorization = await backend.get_authorization(authorization_address)
    if not authorization.is_valid_for(join_authority, address, JOIN_RUN_AUTHORIZATION_SCOPE):
        raise AdminError(f"Authorization invalid for run id {run_id} using pubkey {address}")
    coordinator = (await backend.get_coordinator_account(run.account_address)).state.coordinator
    signer = bytes(address)
    in_epoch = any(c.id.signer == signer for c in coordinator.epoch_state.clients)
    return JoinCheck(authorization_address, coordinator.run_state, in_epoch)


def pubkey_arg(text: Any) -> Pubkey:
    try:
        return Pubkey.from_string(str(text).strip().strip('"'))
    except ValueError:
        raise AdminError(f"{text!r} is not a base58 public key") from None
