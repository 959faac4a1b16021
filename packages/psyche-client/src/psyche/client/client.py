"""The client's main loop (upstream `client.rs`): one backend, one network connection, one run.

Every input (coordinator states, network events, timers, work queued by the state machine)
arrives in one inbox and is handled to completion before the next, as in upstream's `select!`
loop; long work (init, training, payload checks, checkpoints) runs in background tasks that
post back to the inbox.

The run ends when the coordinator reaches `Finished`: the client completes the last epoch's
cooldown (its final checkpoint), logs a summary (`run_finished`) and `run()` returns. Upstream's
client desyncs there; this is a port addition (docs/client.md).

    async with open_network(NetworkConfig(run_id, secret_key)) as network:
        await Client(backend, network, RunInitConfig(identity, secret_key, run_id)).run()
"""

from __future__ import annotations

import logging
import math
import random
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from psyche.client.checkpoints.cooldown import CheckpointFiles
from psyche.client.checkpoints.store import RunInstance
from psyche.client.observe.eval_worker import EvalWorker
from psyche.client.observe.evals import EvalSettings
from psyche.client.observe.logs import log_event
from psyche.client.observe.progress import log_progress, model_download_progress
from psyche.client.observe.stats import run_summary
from psyche.client.observe.telemetry import NetworkNumbers, Observers, RoundReport
from psyche.client.round.broadcast import (
    REBROADCAST_SHAREABLE_SECS,
    RESEND_ON_CONNECT_SECS,
    Broadcast,
    BroadcastType,
    Rebroadcaster,
    TrainingResult,
    rebroadcast_periodically,
)
from psyche.client.round.fetch import DataFetcher
from psyche.client.round.payloads import (
    ApplyMessageOutcome,
    DownloadRequest,
    client_for_p2p_key,
    verify_broadcast_signature,
)
from psyche.client.round.steps import MachineSettings, StepStateMachine
from psyche.client.round.train import OwnResult
from psyche.client.round.witness import SendFinished, finished_broadcast
from psyche.client.setup.init import InitializedRun, InitUnavailable, RunInitConfig, init_run
from psyche.coordinator import SOLANA_MAX_NUM_CLIENTS, Coordinator, RunState
from psyche.coordinator.backend import (
    Backend,
    EndpointDiscovery,
    HealthCheck,
    OpportunisticData,
    Rejoin,
    RunIdentity,
    VerificationReports,
)
from psyche.coordinator.commitment import Commitment
from psyche.coordinator.model import Checkpoint
from psyche.coordinator.verification import VerificationReport
from psyche.core.cli import UserError
from psyche.core.log_markers import IntegrationTestLogMarker
from psyche.core.node_identity import NodeIdentity
from psyche.modeling.serialized_distro import TransmittableDistroResult
from psyche.network import (
    BlobTicket,
    Download,
    DownloadComplete,
    DownloadedModel,
    DownloadFailed,
    DownloadOutcome,
    EndpointAddr,
    MessageReceived,
    NetworkConnection,
    NetworkEvent,
    PeerConnected,
    PeersUnreachable,
    choose_gossip_peers,
    fetchers_expected,
    record_signer,
)

if TYPE_CHECKING:
    import torch


logger = logging.getLogger(__name__)

OPPORTUNISTIC_WITNESS_SECS = 0.5
CHECK_CONNECTION_SECS = 10.0
GOSSIP_CONNECT_MIN_INTERVAL_SECS = 6.0
_ROUND_STATES = (RunState.RoundTrain, RunState.RoundWitness)


@dataclass
class AddressRecords:
    """The epoch members' address records this client has read (from the backend's
    `PeerEndpoints`), so that a record it read before costs a dict lookup, not a signature
    check, on the next state tick (one each 0.5 s).

    The backend lists the records of every client it knows (the centralized server's: every
    joined client, pending joiners too, unbounded in a permissionless run): only records whose
    claimed signer (`record_signer`, read without verifying) is a member of the epoch are
    verified and kept, so no number of non-members listed first keeps a member's record out.
    Keyed by member and replaced with each list read: a member's re-announcement replaces its
    old record, and a member the backend no longer lists (or the epoch no longer has) is
    forgotten, so what is kept is at most one record per member, never more than
    `SOLANA_MAX_NUM_CLIENTS` (the most members a run can have). Members' records that do not
    verify are remembered (as read in the latest list, at most `SOLANA_MAX_NUM_CLIENTS` of
    them) so as not to be checked again."""

    by_member: dict[bytes, bytes] = field(default_factory=dict)
    refused: set[bytes] = field(default_factory=set)

    def learn(
        self,
        records: Iterable[bytes],
        add_record: Callable[[bytes], EndpointAddr | None],
        members: Collection[bytes],
    ) -> None:
        """Hand `add_record` (the address book's: verifies, returns the `EndpointAddr` or
        None) every record of one of `members` (endpoint ids) not read before; keep the latest
        list's."""
        known = {record: member for member, record in self.by_member.items()}
        by_member: dict[bytes, bytes] = {}
        refused: set[bytes] = set()
        for record in records:
            signer = record_signer(record)
            if signer is None or signer not in members:
                continue
            member = known.get(record)
            if member is None:
                if record in self.refused:
                    refused.add(record)
                    continue
                addr = add_record(record)
                if addr is None:
                    if len(refused) < SOLANA_MAX_NUM_CLIENTS:
                        refused.add(record)
                    continue
                member = bytes(addr.id)
            by_member[member] = record
        self.by_member = by_member
        self.refused = refused


@dataclass(frozen=True)
class _State:
    state: Coordinator


@dataclass(frozen=True)
class _Net:
    event: NetworkEvent


@dataclass(frozen=True)
class _Downloaded:
    outcome: DownloadOutcome


@dataclass(frozen=True)
class _Tick:
    kind: str


@dataclass(frozen=True)
class _Work:
    """Work the state machine queued for the loop (upstream: its mpsc channels)."""

    name: str
    run: Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class _InitDone:
    result: InitializedRun | BaseException
    state: Coordinator
    """The warmup state the init started from."""
    scope: trio.CancelScope
    """Which init (`Client._init_scope`): one given up since is released, not used."""


_Item = _State | _Net | _Downloaded | _Tick | _Work | _InitDone


class _LoopIO:
    """`ClientIO` for the state machine: each call queues work on the client's inbox."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def _queue(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        self._client._post(_Work(name, run))

    def send_witness(self, data: OpportunisticData) -> None:
        self._queue("witness", lambda: self._client._send_witness(data))

    def send_health_check(self, checks: list[HealthCheck]) -> None:
        self._queue("health_check", lambda: self._client.backend.send_health_check(checks))

    def send_checkpoint(self, checkpoint: Checkpoint) -> None:
        self._queue("checkpoint", lambda: self._client.backend.send_checkpoint(checkpoint))

    def send_verification(self, report: VerificationReport) -> None:
        self._queue("verification", lambda: self._client._send_verification(report))

    async def round_reports(self, step: int) -> dict[NodeIdentity, VerificationReport]:
        backend = self._client.backend
        if isinstance(backend, VerificationReports):
            return await backend.round_reports(step)
        return {}

    def broadcast_finished(self, action: SendFinished) -> None:
        self._queue("finished", lambda: self._client._broadcast_finished(action))

    def publish_result(self, result: OwnResult) -> None:
        self._queue("result", lambda: self._client._publish_result(result))

    def request_download(self, request: DownloadRequest) -> None:
        async def download() -> None:
            self._client._start_download(request.ticket, request.tag)

        self._queue("download", download)

    def share_model(self, parameters: dict[str, torch.Tensor], version: int) -> None:
        # `version`: the step this model starts (the cooldown's own, not the live state's,
        # which may be a later round's when the extraction ends late), the version every
        # provider of it gives (`SharableModel.update_parameters`).
        async def share() -> None:
            self._client._share_model(parameters, version)

        self._queue("share_model", share)


class WrongRun(UserError):
    """The coordinator sent the state of another run than the one this client joined: a
    misconfigured or hostile coordinator (or someone on the plaintext link). Nothing of that
    state is used: its run id would name this client's files and its model what it loads."""


_RUN_IDENTITY = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def run_instance(backend: Backend, run_id: str) -> RunInstance:
    """This client's run instance: `run_id` and the backend's identity of the instance
    (`RunIdentity`: up to 64 letters, digits, `_` or `-`); without one, a token of this process
    (its checkpoints are then this process's only: never resumed or deleted by a later one)."""
    identity = backend.run_identity() if isinstance(backend, RunIdentity) else None
    if identity is not None and not _RUN_IDENTITY.match(identity):
        logger.warning("the coordinator's run identity is not one: ignored")
        identity = None
    return RunInstance(run_id, identity or f"process-{secrets.token_hex(8)}")


def check_run_id(state: Coordinator, run_id: str) -> None:
    """Raise `WrongRun` unless `state` is the state of `run_id` (`--run-id`)."""
    if state.run_id != run_id:
        raise WrongRun(
            f"the coordinator sent the state of run {state.run_id[:64]!r}, but this client "
            f"joined run {run_id!r} (--run-id): refusing it (a misconfigured or hostile "
            "coordinator)"
        )


class Client:
    def __init__(
        self,
        backend: Backend,
        network: NetworkConnection,
        config: RunInitConfig,
        *,
        rng: random.Random | None = None,
        observers: Observers | None = None,
        evals: EvalSettings | None = None,
    ) -> None:
        self.backend = backend
        self.network = network
        self.config = config
        self.identity = config.identity
        self.instance = run_instance(backend, config.run_id)
        """Whose checkpoints this client writes and may resume."""
        self.rng = rng or random.Random()
        self._send, self._inbox = trio.open_memory_channel[_Item](math.inf)
        self._nursery: trio.Nursery | None = None
        self.coordinator: Coordinator | None = None
        self._last_state_bytes: bytes | None = None
        self._last_epoch_members: frozenset[bytes] | None = None
        """The clients of the epoch before the current one, as this client saw them (None: it
        did not see it): they hold the model, so only others fetch it (`_share_model`)."""
        self.stage = "waiting"  # -> initializing -> running
        self._join_again = False
        """Set when this client must send `Join` again once it is off the epoch's list."""
        self._init_scope: trio.CancelScope | None = None
        """The init under way (stage "initializing"), cancelled if the run drops this client."""
        self._init_lock = trio.Lock()
        """Held by an init until it has ended: a given-up init's worker thread (a hub or GCS
        download, a model build) runs to its end, and the next init waits for it (one model
        loaded at a time), for at most the warmup (`_initialize`)."""
        self.machine: StepStateMachine | None = None
        self.rebroadcaster = Rebroadcaster()
        self._resend_pending = False
        self._verification_unsent = False  # warned once that the backend drops reports
        self._last_gossip_attempt = -math.inf
        self._known_records = AddressRecords()
        self.io = _LoopIO(self)
        self.finished = False
        self.final_checkpoint: Path | None = None
        self._started = time.monotonic()
        # Who hears about the run (trackers, the dashboard, the events file), and evaluations.
        self.observers = observers or Observers()
        self.eval_settings = evals
        self.bytes_received = 0

    # ---- running -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until the coordinator reaches `Finished` (returns once the final checkpoint is
        written and the summary logged), until cancelled, or until something fails (the
        backend goes away, the model cannot be loaded, the client desyncs); failures
        propagate."""
        self._started = time.monotonic()
        try:
            await self._loop()
        finally:
            with trio.CancelScope(shield=True):  # closing is local work: it cannot hang
                await self._close_untaken_inits()

    async def _loop(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if isinstance(self.backend, EndpointDiscovery):
                await self.backend.publish_endpoint(self.network.own_record)
                nursery.start_soon(self._republish_endpoint, self.backend)
            nursery.start_soon(self._pump_states)
            nursery.start_soon(self._pump_network)
            nursery.start_soon(self._ticker, OPPORTUNISTIC_WITNESS_SECS, "opportunistic")
            nursery.start_soon(
                rebroadcast_periodically,
                self.rebroadcaster,
                self.network.broadcast,
                REBROADCAST_SHAREABLE_SECS,
            )
            nursery.start_soon(self._ticker, CHECK_CONNECTION_SECS, "connection")
            try:
                async for item in self._inbox:
                    await self._handle(item)
                    if self.finished:
                        break
            finally:
                nursery.cancel_scope.cancel()
                # the machine stays readable (its trained model); its data provider is closed
                if self.machine is not None and self.machine.fetcher is not None:
                    with trio.CancelScope(shield=True):
                        await self.machine.fetcher.aclose()

    async def _close_untaken_inits(self) -> None:
        """Close what inits built that the loop never took: one that finished as `run` ended
        (its result still queued, or posted by a worker thread that returned after the cancel).
        Called once the loop's nursery has ended, so nothing posts after."""
        while True:
            try:
                item = self._inbox.receive_nowait()
            except trio.WouldBlock:
                return
            if isinstance(item, _InitDone) and isinstance(item.result, InitializedRun):
                await item.result.aclose()

    def _post(self, item: _Item) -> None:
        self._send.send_nowait(item)

    async def _republish_endpoint(self, backend: EndpointDiscovery) -> None:
        """Announce this client's address record again whenever it changes (a relay slot
        reserved or lost after start-up): the peers that learn it from the coordinator would
        otherwise keep dialing addresses that do not reach it."""
        while True:
            await self.network.record_changed.wait()
            await backend.publish_endpoint(self.network.own_record)

    async def _pump_states(self) -> None:
        while True:
            self._post(_State(await self.backend.wait_for_new_state()))

    async def _pump_network(self) -> None:
        while True:
            self._post(_Net(await self.network.next_event()))

    async def _ticker(self, interval: float, kind: str) -> None:
        """Upstream's intervals (`OPPROTUNISTIC_WITNESS_INTERVAL`, `CHECK_CONNECTION_INTERVAL`):
        timers whose ticks the loop handles like any input (`DOWNLOAD_RETRY_CHECK_INTERVAL` is
        the network's: its DisTrO result downloads retry by themselves)."""
        while True:
            await trio.sleep(interval)
            self._post(_Tick(kind))

    async def _handle(self, item: _Item) -> None:
        match item:
            case _State(state):
                await self._on_state(state)
            case _Net(event):
                self._on_network_event(event)
            case _Downloaded(outcome):
                self._on_download(outcome)
            case _Tick(kind):
                self._on_tick(kind)
            case _Work(_, run):
                await run()
            case _InitDone() as done:
                await self._on_init_done(done)

    # ---- coordinator states ----------------------------------------------------------------

    async def _on_state(self, state: Coordinator) -> None:
        # Peers' address records come beside the states, not in them: learn them with every
        # state received (the server sends one each tick), not only when the state changes (a
        # warmup's state stays the same for its whole length).
        self._learn_peer_addresses(state)
        encoded = state.to_bytes()
        if encoded == self._last_state_bytes:
            return
        check_run_id(state, self.config.run_id)
        self._last_state_bytes = encoded
        old = self.coordinator
        if old is None or old.run_state is not state.run_state:
            before = old.run_state.name if old is not None else "-"
            log_event(
                logger,
                "state_change",
                text=f"run state {before} -> {state.run_state.name} "
                f"(epoch {state.progress.epoch}, step {state.progress.step})",
                quiet=old is not None
                and old.run_state in _ROUND_STATES
                and state.run_state in _ROUND_STATES,
                marker=IntegrationTestLogMarker.StateChange,
                client_id=str(self.identity),
                old=before,
                new=state.run_state.name,
                epoch=state.progress.epoch,
                step=state.progress.step,
            )
        self.observers.on_state(state)
        clients = state.epoch_state.clients
        self.network.set_allowed_peers(c.id.p2p_identity for c in clients)
        self._ensure_gossip_connected(state)
        if state.run_state is RunState.RoundTrain and (
            old is None or old.run_state is not RunState.RoundTrain
        ):
            last_needed_step = max(0, state.progress.step - 2)
            self.network.remove_staled_tags(last_needed_step)
            self.rebroadcaster.retain_from_step(last_needed_step)
            self.network.shared_model.clear_cache()
            self.network.clear_bandwidth_tracking()
        self.coordinator = state
        if state.run_state is RunState.Warmup and (
            old is None or old.run_state is not RunState.Warmup
        ):
            self._last_epoch_members = (
                None
                if old is None
                else frozenset(c.id.p2p_identity for c in old.epoch_state.clients)
            )
            self._serialize_model_ahead_if_fetched()
        if state.run_state is RunState.Finished:
            await self._finish_run(state)
            return
        if self.stage == "waiting":
            await self._join_again_once_out(state)
            if state.run_state is RunState.Warmup and any(c.id == self.identity for c in clients):
                self.stage = "initializing"
                self._join_again = False
                # made here, not in the task: a drop handled before the task starts cancels it
                self._init_scope = trio.CancelScope()
                self._spawn(self._initialize, state, self._init_scope)
        elif self.stage == "initializing":
            if not any(c.id == self.identity for c in clients):
                await self._give_up_init(state)
        elif self.stage == "running":
            assert self.machine is not None
            await self.machine.apply_state(state)
            if self.machine.left_run:
                await self._rejoin(state)
        if self.machine is not None:
            self.machine.stats.bandwidth_total = sum(
                info.bandwidth for info in self.network.remote_infos()
            )

    async def _rejoin(self, state: Coordinator) -> None:
        """This client's model is behind the run's: the run trained a round without it (a
        health check dropped it, or an epoch started without it), or it could not apply what
        the run agreed on. Drop the machine and wait as a new client would: join again (when
        the backend can) and load the model from the run's peers or checkpoint at the next
        epoch this client is in."""
        log_event(
            logger,
            "left_run",
            text=f"this client's model is behind the run's (epoch {state.progress.epoch}, step "
            f"{state.progress.step}): it joins again and loads the model anew at the next epoch "
            "it is in",
            epoch=state.progress.epoch,
            step=state.progress.step,
        )
        await self._wait_to_join_again(state)

    async def _wait_to_join_again(self, state: Coordinator) -> None:
        """Drop the machine, if any, and wait as a new client would (`_rejoin`)."""
        await self._drop_machine()
        self.stage = "waiting"
        self.network.shared_model.stop_sharing()
        self._join_again = True
        await self._join_again_once_out(state)

    async def _drop_machine(self) -> None:
        """Forget the machine and release its data provider (a connection to the run's data
        server, open files): the next epoch's init opens its own."""
        machine, self.machine = self.machine, None
        if machine is not None and machine.fetcher is not None:
            await machine.fetcher.aclose()

    async def _give_up_init(self, state: Coordinator) -> None:
        """The run dropped this client while it loaded the model (a health check, or the epoch
        ended while it waited for peers to serve): the model it waits for would be of an epoch
        no longer its own. Stop loading and join again, as a client the run went on without."""
        if self._init_scope is not None:
            self._init_scope.cancel()
        self._init_scope = None
        await self._rejoin(state)

    async def _join_again_once_out(self, state: Coordinator) -> None:
        """Send `Join` again once this client is off the epoch's client list. While it is
        still listed (it stopped training; the witnesses will drop it) a `Join` changes nothing,
        and the server kicks a dropped client whose last `Join` came before it left."""
        if not self._join_again or any(c.id == self.identity for c in state.epoch_state.clients):
            return
        self._join_again = False
        if isinstance(self.backend, Rejoin):
            await self.backend.rejoin()

    def _learn_peer_addresses(self, state: Coordinator) -> None:
        if not isinstance(self.backend, EndpointDiscovery):
            return
        members = {c.id.p2p_identity for c in state.epoch_state.clients}
        self._known_records.learn(
            self.backend.peer_endpoints(), self.network.address_book.add_record, members
        )

    def _ensure_gossip_connected(self, state: Coordinator) -> None:
        if state.halted():
            return
        now = time.monotonic()
        if now - self._last_gossip_attempt < GOSSIP_CONNECT_MIN_INTERVAL_SECS:
            return
        me = self.network.endpoint_id
        participants = [c.id.p2p_identity for c in state.epoch_state.clients]
        if me not in participants:
            return
        self._last_gossip_attempt = now
        neighbors = self.network.neighbors()
        if not neighbors:
            logger.debug("Not connected to any gossip peers; connecting to some")
        chosen = choose_gossip_peers(participants, neighbors, me, self.rng)
        if chosen:
            self.network.add_peers(chosen)

    # ---- the end of the run --------------------------------------------------------------------

    async def _finish_run(self, state: Coordinator) -> None:
        """Finish the last epoch's work (the final checkpoint), log the summary, stop."""
        if self.stage == "running":
            assert self.machine is not None
            self.final_checkpoint = await self.machine.finish_run(state)
        self.finished = True
        fields = self._summary_fields(state)
        text = run_summary(
            state.run_id,
            fields,
            stage=self.stage,
            final_checkpoint=self.final_checkpoint,
            checkpointing=self.config.checkpoint is not None,
        )
        log_event(logger, "run_finished", text=text, **fields)
        self.observers.on_finished(fields)

    def _summary_fields(self, state: Coordinator) -> dict[str, Any]:
        machine = self.machine
        losses = machine.stats.losses if machine is not None else []
        tokens_per_sec = machine.progress.tokens_per_second() if machine is not None else None
        return {
            "client_id": str(self.identity),
            "step": state.progress.step,
            "total_steps": state.config.total_steps,
            "epochs": state.progress.epoch,
            "trained": self.stage == "running",
            "final_loss": losses[-1] if losses else None,
            "tokens_per_sec": None if tokens_per_sec is None else round(tokens_per_sec, 1),
            "wall_secs": round(time.monotonic() - self._started, 1),
            "checkpoint": None if self.final_checkpoint is None else str(self.final_checkpoint),
        }

    # ---- init ----------------------------------------------------------------------------------

    async def _initialize(self, state: Coordinator, scope: trio.CancelScope) -> None:
        """Init for the warmup `state`, posting its outcome, unless `scope` is cancelled (the
        run dropped this client) first; after a given-up init only once that one has ended, and
        if it has not within the warmup, the outcome is `InitUnavailable` (leave the epoch and
        join again: the epoch would start without this client anyway)."""
        backups = list(getattr(self.backend, "backup_data_locations", None) or [])
        if backups:
            # The run's backup data locations travel beside the coordinator state (a port
            # extension of the centralized protocol).
            state = state.copy()
            state.model.value.backup_data_locations = backups
        with scope:
            try:
                self._init_lock.acquire_nowait()
            except trio.WouldBlock:
                log_event(
                    logger,
                    "init_waits",
                    text="the init this client gave up is still loading the model in a worker "
                    "thread (a hub or GCS download, or a model build: nothing can stop them): "
                    f"this init starts once it has ended, or leaves epoch {state.progress.epoch} "
                    f"if it has not within the warmup ({state.config.warmup_time} s)",
                    epoch=state.progress.epoch,
                )
                with trio.move_on_after(state.config.warmup_time) as waiting:
                    await self._init_lock.acquire()
                if waiting.cancelled_caught:  # the epoch starts without this client anyway
                    busy = InitUnavailable(
                        "the init given up before still loads the model in a worker thread"
                    )
                    self._post(_InitDone(busy, state, scope))
                    return
            try:
                result: InitializedRun | BaseException = await init_run(
                    self.config, self.instance, state, self._fetch_model_from_peers
                )
            except Exception as e:
                result = e
            finally:
                self._init_lock.release()
            self._post(_InitDone(result, state, scope))

    async def _fetch_model_from_peers(
        self, state: Coordinator, give_up_at: float | None = None
    ) -> DownloadedModel:
        """The model from the epoch's other clients (`init.FetchFromPeers`): raises
        `PeersUnreachable` when every peer failed, or when none has served the model's
        configuration by `give_up_at` (a download under way is not cut short)."""
        me = self.network.endpoint_id
        peers = [c.id.p2p_identity for c in state.epoch_state.clients if c.id.p2p_identity != me]
        # The warmup's step is the version every honest provider gives its model (a cooldown's
        # `share_model`, or a joiner's `_on_init_done`): take no other, whatever a peer claims.
        download = self.network.model_download(
            peers,
            max_concurrent=self.config.max_concurrent_parameter_requests,
            expected_version=state.progress.step,
        )
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(log_progress, logger, partial(model_download_progress, download))
                model = await download.run(give_up_at)
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # the nursery's wrapping of the download's error
            unreachable, rest = group.split(PeersUnreachable)
            if unreachable is not None and rest is None:
                raise PeersUnreachable(str(unreachable.exceptions[0])) from None
            raise
        logger.info("Downloaded %d parameters from peers", len(model.parameters))
        return model

    async def _on_init_done(self, done: _InitDone) -> None:
        """Take what the init built, or act on why it failed: out of reach for now
        (`InitUnavailable`: leave the epoch and join again), else end the client."""
        result = done.result
        if done.scope is not self._init_scope:  # given up: the run dropped this client
            if isinstance(result, InitializedRun):
                await result.aclose()
            return
        self._init_scope = None
        assert self.coordinator is not None
        if isinstance(result, InitUnavailable):
            log_event(
                logger,
                "init_failed",
                logging.WARNING,
                text=f"could not join epoch {done.state.progress.epoch}: {result}; leaving it "
                "and joining again",
                epoch=done.state.progress.epoch,
                error=str(result),
            )
            await self._wait_to_join_again(self.coordinator)
            return
        if isinstance(result, BaseException):
            raise result
        assert self._nursery is not None
        loaded = result.loaded
        shared = self.network.shared_model
        shared.update_config(loaded.config_json, loaded.tokenizer_json)
        if result.shared is not None:  # the run's model: the epoch's other joiners may take it
            # the warmup's step is the step this model starts: its version (as a cooldown's)
            self._share_model(result.shared, done.state.progress.step)
        fetcher = DataFetcher(result.data_provider, self._nursery)
        evals = None
        if self.eval_settings is not None and self.eval_settings.enabled:
            evals = EvalWorker(
                self.eval_settings,
                loaded.tokenizer_json,
                loaded.model,
                self._nursery,
                self._on_eval_scores,
            )
        settings = MachineSettings(
            identity=self.identity,
            write_gradients_dir=self.config.write_gradients_dir,
            checkpoint=self.config.checkpoint,
            run=self.instance,
            files=CheckpointFiles(
                list(loaded.extra_files), loaded.config_json, loaded.tokenizer_json
            ),
            on_round=self._on_round,
            evals=evals,
            sign=self.config.secret_key.sign,
        )
        self.machine = StepStateMachine(
            settings, result.trainer, fetcher, self.coordinator, self.io, self._nursery
        )
        self.stage = "running"
        # Upstream applies the state init started with; the newest one is what matters now.
        await self.machine.apply_state(self.coordinator)

    # ---- telemetry -----------------------------------------------------------------------------

    def network_numbers(self) -> NetworkNumbers:
        infos = self.network.remote_infos()[1:]  # the first is this client
        return NetworkNumbers(
            peers=len(self.network.connected_peers()),
            bytes_sent=self.network.bytes_served,
            bytes_received=self.bytes_received,
            bandwidth=sum(info.bandwidth for info in infos),
            reachability=self.network.reachability.summary(),
        )

    def _on_round(self, report: RoundReport) -> None:
        self.observers.on_round(replace(report, network=self.network_numbers()))

    def _on_eval_scores(self, scores: Mapping[str, float], partial: frozenset[str]) -> None:
        step = self.coordinator.progress.step if self.coordinator is not None else 0
        self.observers.on_evals(step, scores, partial)

    # ---- network -------------------------------------------------------------------------------

    def _on_network_event(self, event: NetworkEvent) -> None:
        match event:
            case MessageReceived(from_, broadcast):
                self._on_broadcast(from_, broadcast)
            case PeerConnected():
                if not self._resend_pending:
                    self._resend_pending = True  # one re-send covers peers connecting meanwhile
                    self._spawn(self._resend_after_connect)

    def _on_download(self, outcome: DownloadOutcome) -> None:
        """A DisTrO result download this client started has ended (see `_start_download`): the
        network retried it as long as it was worth it, so a failure is final."""
        match outcome:
            case DownloadComplete(digest, _, data):
                if not isinstance(data, TransmittableDistroResult):
                    logger.debug("ignoring a downloaded %s", type(data).__name__)
                elif self.machine is not None:
                    self.machine.apply_distro_result(digest, data)
            case DownloadFailed(ticket, _, error, _, permanent=True):
                # over the run's largest payload, or undecodable: never again
                if self.machine is not None:
                    self.machine.refuse_distro_result(ticket.hash, error)
                logger.warning("Distro result download refused (not retrying): %s", error)

    def _on_broadcast(self, from_: bytes, broadcast: Broadcast) -> None:
        if self.coordinator is None:
            return
        sender = client_for_p2p_key(self.coordinator.epoch_state.clients, from_)
        if sender is None:
            logger.debug("broadcast from unknown client %s", from_[:5].hex())
            return
        if not verify_broadcast_signature(from_, broadcast):
            logger.warning("Invalid signature on commitment from %s", from_[:5].hex())
            return
        if self.machine is None:
            return  # not warmed up yet: ignored, as upstream
        outcome = self.machine.apply_message(sender, broadcast)
        if outcome is ApplyMessageOutcome.Invalid:
            logger.debug("invalid broadcast from %s for step %d", sender, broadcast.step)

    def _share_model(self, parameters: dict[str, torch.Tensor], version: int | None) -> None:
        """Serve `parameters` (the model of `version`: the run's step it starts) to joiners
        from now until the next round starts; serialized ahead once the warmup shows a member
        that may fetch it (`_serialize_model_ahead_if_fetched`), else on request."""
        self.network.shared_model.update_parameters(parameters, version)
        self._serialize_model_ahead_if_fetched()

    def _serialize_model_ahead_if_fetched(self) -> None:
        """In a warmup with a member that was not a client of the epoch before (a joiner:
        `fetchers_expected`), serialize the shared model in the background so that its first
        ticket requests find it ready; otherwise not at all, since the serialized copy is as
        large as the model and nobody would ask for it (a no-op when nothing is shared or it
        was started already for this model)."""
        state = self.coordinator
        if state is None or state.run_state is not RunState.Warmup:
            return
        shared = self.network.shared_model
        if shared.parameters is None or shared.serialized_parameters is None:
            return  # nothing served
        members = (c.id.p2p_identity for c in state.epoch_state.clients)
        if not fetchers_expected(members, self._last_epoch_members, self.network.endpoint_id):
            return
        log_event(
            logger,
            "model_serialized_ahead",
            quiet=True,
            text=f"epoch {state.progress.epoch} has a joiner: serializing the shared model ahead",
            epoch=state.progress.epoch,
            version=shared.version,
        )
        self._spawn(shared.serialize_ahead, self.network.add_downloadable, self.network.model_codec)

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(fn, *args)

    def _start_download(self, ticket: BlobTicket, tag: str) -> None:
        # no result of this run is larger than its model and compression can make it
        max_size = self.machine.trainer.max_payload_size() if self.machine is not None else None
        download = self.network.download_result(
            ticket,
            tag,
            providers=self._other_members,
            max_size=max_size,
            wanted=self._awaits_payload,
        )
        self._spawn(self._deliver, download)

    def _other_members(self) -> list[bytes]:
        """The epoch's other clients, shuffled: who else may hold a result (upstream)."""
        if self.coordinator is None:
            return []
        me = self.network.endpoint_id
        others = [
            c.id.p2p_identity
            for c in self.coordinator.epoch_state.clients
            if c.id.p2p_identity != me
        ]
        self.rng.shuffle(others)
        return others

    def _awaits_payload(self, digest: bytes) -> bool:
        """Whether a download retry is worth it: a round still waits for this payload."""
        return self.machine is not None and self.machine.awaits_payload(digest)

    async def _deliver(self, download: Download) -> None:
        outcome = await download.finished()
        if isinstance(outcome, DownloadComplete):
            self.bytes_received += download.ticket.size
        self._post(_Downloaded(outcome))

    # ---- timers --------------------------------------------------------------------------------

    def _on_tick(self, kind: str) -> None:
        if kind == "opportunistic":
            if self.machine is not None:
                self.machine.try_send_opportunistic_witness()
        elif kind == "connection" and self.coordinator is not None:
            self._ensure_gossip_connected(self.coordinator)

    # ---- work queued by the state machine ------------------------------------------------

    async def _send_witness(self, data: OpportunisticData) -> None:
        await self.backend.send_witness(data)
        log_event(logger, "witness_sent", quiet=True, kind=data.kind)

    async def _send_verification(self, report: VerificationReport) -> None:
        if isinstance(self.backend, VerificationReports):
            await self.backend.send_verification(report)
        elif not self._verification_unsent:
            self._verification_unsent = True
            logger.warning(
                "this coordinator backend carries no verification reports: this client's "
                "findings as a verifier stay in its log"
            )

    def _sign(self, data_hash: bytes) -> Commitment:
        return Commitment(data_hash, self.config.secret_key.sign(data_hash))

    async def _resend_after_connect(self) -> None:
        await trio.sleep(RESEND_ON_CONNECT_SECS)
        self._resend_pending = False
        for broadcast in self.rebroadcaster.all_to_send():
            self.network.broadcast(broadcast)

    def _gossip(self, broadcast: Broadcast) -> None:
        """Gossip our own broadcast and keep it for rebroadcasting."""
        self.network.broadcast(broadcast)
        self.rebroadcaster.add(broadcast)

    async def _broadcast_finished(self, action: SendFinished) -> None:
        signature = self.config.secret_key.sign(action.commitment_data_hash)
        broadcast = finished_broadcast(action, signature, self.rng.getrandbits(32))
        self._gossip(broadcast)
        if self.machine is not None:
            self.machine.apply_message(self.identity, broadcast)

    async def _publish_result(self, result: OwnResult) -> None:
        """Serve our result's payload, sign and gossip its announcement, and hand the signed
        announcement to the state machine, which records the result in its round directly."""
        tag = f"distro-result_{result.step}"
        ticket, size = await self.network.add_downloadable(result.payload, tag)
        logger.debug(
            "Broadcasting payload batch id %s hash 0x%s (%.3f MB)",
            result.batch_id,
            ticket.hash.hex(),
            size / 1e6,
        )
        broadcast = self._announce_result(result, ticket)
        if self.machine is not None:
            self.machine.apply_own_result(broadcast, result)

    def _announce_result(self, result: OwnResult, ticket: BlobTicket) -> Broadcast:
        """Sign and gossip the announcement of our result, its payload named by `ticket`."""
        broadcast = Broadcast(
            step=result.step,
            proof=result.proof,
            commitment=self._sign(result.commitment_data_hash),
            nonce=self.rng.getrandbits(32),
            data=BroadcastType.TrainingResult(TrainingResult(result.batch_id, ticket)),
        )
        self._gossip(broadcast)
        return broadcast
