"""What a Solana training client does around the training itself (upstream solana-client
`app.rs`): find the run, check the client version (`preflight`), follow it as the client's backend
(`connect_run`), then, while the training client runs, join every epoch, tick the run when its
clock says so, and stop when the coordinator is done with us (`train_on_run`). Its settings are
`SolanaTrainSettings`.

The training client is passed in as an async callable, so this module needs neither torch nor
the network stack: `psyche-solana-client train` supplies `psyche.client.Client(...).run`, tests
can supply anything.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
from solders.keypair import Keypair
from solders.pubkey import Pubkey

from psyche.coordinator import RunState
from psyche.core.node_identity import NodeIdentity
from psyche.solana import follower, pda
from psyche.solana.backend import SolanaBackend, SolanaBackendError
from psyche.solana.cluster import Cluster
from psyche.solana.follower import (
    JOIN_RETRY_DELAY,
    TICK_CHECK_INTERVAL,
    Membership,
    SolanaBackendRunner,
    follow_membership,
)
from psyche.solana.program_ids import ProgramIds
from psyche.solana.rpc import AccountNotFound

log = logging.getLogger(__name__)

VERSION_MISMATCH_EXIT_CODE = 10
"""Upstream's exit code when the client's version does not match the run's."""
ANY_CLIENT_VERSION = "test"
"""A run whose client version is this accepts every client version (upstream)."""


class ClientVersionMismatch(Exception):
    """The run wants another client version; the process exits with code 10, as upstream."""

    exit_code = VERSION_MISMATCH_EXIT_CODE


class RunNotFound(Exception):
    """No coordinator instance for the run id on this cluster and program."""


def check_client_version(client_version: str | None, run_version: str) -> bool:
    """Upstream's start-up check of `CLIENT_VERSION` against the run's client version.

    Returns False when there is nothing to check (no `CLIENT_VERSION`), True when it matches or
    the run accepts any version; raises `ClientVersionMismatch` otherwise.
    """
    if client_version is None:
        return False
    if client_version != run_version and run_version != ANY_CLIENT_VERSION:
        raise ClientVersionMismatch(
            f"Version mismatch: this client is version {client_version!r}, the run wants "
            f"{run_version!r}"
        )
    return True


def check_version_unchanged(initial: str, current: str) -> None:
    """While a paused run waits for us, an upgrade of its client version means we must go."""
    if current != initial:
        raise ClientVersionMismatch(
            f"the run's client version changed from {initial!r} to {current!r} while it was "
            "paused; exiting"
        )


@dataclass(frozen=True)
class SolanaRun:
    """A run's addresses and the client version it asked for when we started."""

    run_id: str
    instance: Pubkey
    account: Pubkey
    client_version: str


async def find_run(backend: SolanaBackend, run_id: str) -> SolanaRun:
    try:
        instance_address = pda.find_coordinator_instance(run_id, backend.ids)
    except ValueError as e:
        raise RunNotFound(str(e)) from None
    try:
        instance = await backend.get_coordinator_instance(instance_address)
        account_address = Pubkey.from_bytes(bytes(instance.coordinator_account))
        account = await backend.get_coordinator_account(account_address)
    except SolanaBackendError as e:
        if isinstance(e.cause, AccountNotFound):
            raise RunNotFound(
                f"run {run_id!r} not found: no coordinator instance at {instance_address} (RPC "
                f"{backend.cluster.rpc}, coordinator program {backend.ids.coordinator})"
            ) from None
        raise
    return SolanaRun(run_id, instance_address, account_address, str(account.state.client_version))


@dataclass(frozen=True)
class SolanaTrainSettings:
    """What the Solana side of a training client needs (upstream solana-client's `AppParams`)."""

    run_id: str
    wallet: Keypair
    cluster: Cluster
    backup_clusters: tuple[Cluster, ...]
    ids: ProgramIds
    authorizer: Pubkey | None
    """The grantee of the join authorization to join with (None: everyone's)."""
    client_version: str | None
    """`CLIENT_VERSION`, checked against the run's (None: not checked)."""

    def backend(self) -> SolanaBackend:
        return SolanaBackend(self.cluster, self.wallet, self.backup_clusters, ids=self.ids)


def preflight(settings: SolanaTrainSettings) -> SolanaRun:
    """Find the run and check the client version, before anything heavy is imported (so a
    wrong run id or an unreachable RPC fails in a second): `RunNotFound`,
    `ClientVersionMismatch`."""

    async def main() -> SolanaRun:
        async with settings.backend() as backend:
            run = await find_run(backend, settings.run_id)
        check_client_version(settings.client_version, run.client_version)
        return run

    return trio.run(main)


@asynccontextmanager
async def connect_run(
    settings: SolanaTrainSettings, run: SolanaRun, *, before_join: Callable[[], Awaitable[None]]
) -> AsyncIterator[SolanaBackendRunner]:
    """The run followed as the training client's backend (`psyche.client.run.ConnectBackend`):
    subscribed to the run while `before_join` (the heavy modules loading) is awaited."""
    async with (
        settings.backend() as backend,
        follower.follow_run(backend, run.run_id, run.account) as runner,
    ):
        await before_join()
        yield runner


async def watch_client_version(
    runner: SolanaBackendRunner,
    initial: str,
    membership: Membership,
    *,
    interval: float = TICK_CHECK_INTERVAL,
) -> None:
    """Upstream's check on every tick interval: while the run is halted and we never joined it,
    a new client version on chain ends this client (`ClientVersionMismatch`)."""
    while True:
        await trio.sleep(interval)
        state = runner.latest.state
        if state.coordinator.halted() and not membership.ever_joined:
            check_version_unchanged(initial, str(state.client_version))


VERIFICATION_WATCH_INTERVAL = 5.0
"""Seconds between two reads of the run's verification account (`watch_verification`)."""


async def watch_verification(
    runner: SolanaBackendRunner, *, interval: float = VERIFICATION_WATCH_INTERVAL
) -> None:
    """In a run with verification, log what the coordinator's verification did since the last
    read (`psyche.solana.verification`: findings at INFO, punishments at WARNING, one line
    each): a person watching a client sees who was verified, what was found and who was
    punished, slashed and credited. A read that fails is tried again at the next interval."""
    from psyche.solana.verification import entry_line

    seen: list[Any] = []
    while True:
        await trio.sleep(interval)
        found = await runner.read_verification()  # also the run's `verifiers_train`
        if found is None:
            continue
        entries = found.log
        for entry in entries:
            if entry in seen:
                continue
            if entry.kind != "punished":
                log.info("verification: %s", entry_line(entry))
                continue
            # The client's `log_event` shape (psyche.client.observe.logs, which this package
            # cannot import): its trackers count the punishment (observe.verification).
            fields = {
                "step": entry.step,
                "loser": str(entry.subject),
                "role": entry.role,
                "slashed": entry.slashed,
            }
            text = f"verification: {entry_line(entry)}"
            log.warning(
                "verification_punished", extra={"psyche_fields": fields, "psyche_text": text}
            )
        seen = list(entries)


async def follow_run(
    runner: SolanaBackendRunner,
    identity: NodeIdentity,
    run: SolanaRun,
    *,
    authorizer: Any | None = None,
    membership: Membership | None = None,
    tick_interval: float = TICK_CHECK_INTERVAL,
    join_retry_delay: float = JOIN_RETRY_DELAY,
) -> None:
    """Join, tick and watch the run until one of them raises (`LeftRun`,
    `ClientVersionMismatch`, a refused join)."""
    membership = membership if membership is not None else Membership()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: runner.auto_tick(interval=tick_interval))
        nursery.start_soon(watch_verification, runner)
        nursery.start_soon(
            lambda: watch_client_version(
                runner, run.client_version, membership, interval=tick_interval
            )
        )
        await follow_membership(
            runner, identity, authorizer, membership, join_retry_delay=join_retry_delay
        )


async def train_on_run(
    runner: SolanaBackendRunner,
    identity: NodeIdentity,
    run: SolanaRun,
    client: Callable[[], Awaitable[None]],
    *,
    authorizer: Any | None = None,
    membership: Membership | None = None,
    tick_interval: float = TICK_CHECK_INTERVAL,
) -> None:
    """Run the training client beside `follow_run`; whichever ends first ends both (the
    client's own failure, or the run being done with us, propagates)."""
    if runner.latest.state.coordinator.run_state is not RunState.WaitingForMembers:
        log.info("Waiting for the current epoch to end before joining")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: follow_run(
                runner,
                identity,
                run,
                authorizer=authorizer,
                membership=membership,
                tick_interval=tick_interval,
            )
        )
        await client()
        nursery.cancel_scope.cancel()


__all__ = [
    "ANY_CLIENT_VERSION",
    "VERSION_MISMATCH_EXIT_CODE",
    "ClientVersionMismatch",
    "RunNotFound",
    "SolanaRun",
    "SolanaTrainSettings",
    "check_client_version",
    "check_version_unchanged",
    "connect_run",
    "find_run",
    "follow_run",
    "preflight",
    "train_on_run",
    "watch_client_version",
    "watch_verification",
]
