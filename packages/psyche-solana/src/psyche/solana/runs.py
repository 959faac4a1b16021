"""Finding runs to join: every run of a coordinator program, and the ones a wallet may join
(upstream run-manager's `CoordinatorClient::get_all_runs`, `can_user_join_run` and
`find_joinable_runs`, behind `list-runs`), plus the `.env` files run managers keep their
settings in (`load_and_apply_env_file`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from solders.pubkey import Pubkey

from psyche.coordinator import RunState
from psyche.solana import pda
from psyche.solana.admin import AdminError
from psyche.solana.anchor import account_discriminator
from psyche.solana.backend import SolanaBackend, SolanaBackendError
from psyche.solana.state import (
    JOIN_RUN_AUTHORIZATION_SCOPE,
    AccountDecodeError,
    Authorization,
    CoordinatorAccountError,
    CoordinatorInstance,
    decode_anchor_account,
)

log = logging.getLogger(__name__)

# Runs nobody can join now (upstream filters these out before checking authorizations).
UNJOINABLE_STATES = frozenset({RunState.Uninitialized, RunState.Finished, RunState.Paused})


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    instance_address: Pubkey
    instance: CoordinatorInstance
    coordinator_account: Pubkey
    run_state: RunState
    num_clients: int
    min_clients: int
    epoch_time_secs: int
    epoch_start_timestamp: int


async def get_all_runs(backend: SolanaBackend) -> list[RunInfo]:
    """Every run of the backend's coordinator program, by run id. Upstream reads every account
    the program owns and keeps those that decode as a `CoordinatorInstance`; here the RPC node
    filters on the instance's discriminator, so the 119 kB coordinator accounts are not sent
    twice. A run whose coordinator account cannot be read or decoded is skipped, as upstream."""
    discriminator = account_discriminator(CoordinatorInstance.__name__)
    accounts = await backend.get_program_accounts(
        backend.ids.coordinator_key, memcmp=(0, discriminator)
    )
    runs = []
    for address, account in accounts:
        try:
            instance = decode_anchor_account(account.data, CoordinatorInstance)
        except AccountDecodeError:
            log.debug("Failed to deserialize CoordinatorInstance at %s", address)
            continue
        coordinator_address = Pubkey.from_bytes(instance.coordinator_account)
        try:
            coordinator = await backend.get_coordinator_account(coordinator_address)
        except (SolanaBackendError, CoordinatorAccountError) as e:
            log.debug(
                "Skipping run %s - could not read its coordinator account: %s", instance.run_id, e
            )
            continue
        state = coordinator.state.coordinator
        runs.append(
            RunInfo(
                run_id=instance.run_id,
                instance_address=address,
                instance=instance,
                coordinator_account=coordinator_address,
                run_state=state.run_state,
                num_clients=len(state.epoch_state.clients),
                min_clients=state.config.min_clients,
                epoch_time_secs=state.config.epoch_time,
                epoch_start_timestamp=state.epoch_state.start_timestamp,
            )
        )
    return sorted(runs, key=lambda r: r.run_id)


async def can_user_join_run(
    backend: SolanaBackend,
    instance: CoordinatorInstance,
    user: Pubkey,
    delegate_authorizer: Pubkey | None = None,
) -> Pubkey | None:
    """The grantee whose join authorization lets `user` join: everyone (the system program
    id), the user itself, or `delegate_authorizer` (a grantee the user is a delegate of), tried
    in that order; None when none does."""
    grantees = [Pubkey.default(), user]
    if delegate_authorizer is not None:
        grantees.append(delegate_authorizer)
    for grantee in grantees:
        if await _authorization_covers(backend, instance.join_authority, grantee, user):
            return grantee
    return None


async def _authorization_covers(
    backend: SolanaBackend, join_authority: bytes, grantee: Pubkey, user: Pubkey
) -> bool:
    address = pda.find_join_authorization(join_authority, grantee, backend.ids)
    account = await backend.get_account_info(address)
    if account is None:
        return False
    try:
        authorization = decode_anchor_account(account.data, Authorization)
    except AccountDecodeError:
        log.warning("Failed to deserialize authorization at %s: invalid data", address)
        return False
    return authorization.is_valid_for(join_authority, user, JOIN_RUN_AUTHORIZATION_SCOPE)


async def find_joinable_runs(
    backend: SolanaBackend,
    runs: Sequence[RunInfo],
    user: Pubkey,
    join_authority: Pubkey | None = None,
    delegate_authorizer: Pubkey | None = None,
) -> list[tuple[RunInfo, Pubkey]]:
    """The runs `user` may join now with the grantee that authorizes it: not paused, finished
    or uninitialized, of `join_authority` when given, runs waiting for members first."""
    joinable = []
    for run in runs:
        if run.run_state in UNJOINABLE_STATES:
            continue
        if join_authority is not None and run.instance.join_authority != bytes(join_authority):
            continue
        grantee = await can_user_join_run(backend, run.instance, user, delegate_authorizer)
        if grantee is not None:
            joinable.append((run, grantee))
    # Stable: the order of `runs` is kept within each group.
    joinable.sort(key=lambda found: 0 if found[0].run_state is RunState.WaitingForMembers else 1)
    return joinable


def load_env_file(path: Path) -> dict[str, str]:
    """`KEY=VALUE` lines (blank lines and `#` comments skipped, keys and values trimmed of
    spaces and surrounding double quotes), as upstream's `load_and_apply_env_file` reads them;
    the caller lays them over the environment."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise AdminError(f"Failed to read env file: {path} ({e.strerror or e})") from None
    values = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        values[key.strip().strip('"')] = value.strip().strip('"')
    return values


def env_with_file(path: Path | None, env: Mapping[str, str]) -> dict[str, str]:
    """`env` with an env file's values laid over it (upstream sets them in the process)."""
    merged = dict(env)
    if path is not None:
        merged.update(load_env_file(path))
    return merged
