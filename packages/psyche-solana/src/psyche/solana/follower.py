"""Following a run through Solana (upstream `psyche_solana_rpc::backend`'s runner and the
Solana client's `app.rs`).

`follow_run(backend, run_id, account)` yields a `SolanaBackendRunner`, which implements the
training client's `psyche.coordinator.backend.Backend`: it subscribes to the run's coordinator
account on every endpoint's websocket, de-duplicates the notifications by nonce, and hands out
decoded `Coordinator` states; witness, health-check, checkpoint and tick transactions are sent
in the background through the `SolanaBackend` (failures are logged, as upstream).
`follow_membership` joins the run every time it waits for members and says when the client has
left it.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
from solders.instruction import Instruction
from solders.pubkey import Pubkey
from solders.signature import Signature

from psyche.coordinator import ClientState, Coordinator, RunState
from psyche.coordinator.backend import HealthCheck, OpportunisticData
from psyche.coordinator.data_selection import verification_duties_for_state
from psyche.coordinator.errors import CoordinatorError, CoordinatorPanic
from psyche.coordinator.following import is_follow_report
from psyche.coordinator.model import Checkpoint
from psyche.coordinator.server_core import VERIFIED_ROUNDS
from psyche.coordinator.verification import NO_DRAW, VerificationReport
from psyche.core.cli import UserError
from psyche.core.node_identity import NodeIdentity
from psyche.solana import pda
from psyche.solana.backend import SolanaBackend, SolanaBackendError
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.retry import RetryKind
from psyche.solana.state import CoordinatorAccount, coordinator_account_from_bytes
from psyche.solana.subscription import NonceFilter, subscribe_to_account
from psyche.solana.verification import RunVerification, draw_signer

log = logging.getLogger(__name__)

TICK_CHECK_INTERVAL = 0.5
SEND_RETRY_WINDOW = 60.0
SEND_RETRY_DELAY = 1.0
STATE_QUEUE_CAPACITY = 32


@asynccontextmanager
async def follow_run(
    backend: SolanaBackend, run_id: str, coordinator_account: Pubkey
) -> AsyncIterator[SolanaBackendRunner]:
    """Follow the run's coordinator account while the context is open (upstream
    `SolanaBackend::start`)."""
    coordinator_instance = pda.find_coordinator_instance(run_id, backend.ids)
    log.info("coordinator account address: %s", coordinator_account)
    log.info("coordinator instance address for run %r: %s", run_id, coordinator_instance)
    init = await backend.get_coordinator_account(coordinator_account)
    await backend.ensure_verification_account(coordinator_instance, coordinator_account)
    async with trio.open_nursery() as nursery:
        runner = SolanaBackendRunner(
            backend, nursery, run_id, coordinator_instance, coordinator_account, init
        )
        await runner.read_verification()  # the run's `verifiers_train`, before the first state
        runner._start()
        try:
            yield runner
        finally:
            nursery.cancel_scope.cancel()


class StateReceiver:
    """Coordinator states in arrival order; holds the newest `capacity`, dropping the oldest."""

    def __init__(self, capacity: int = STATE_QUEUE_CAPACITY) -> None:
        self._queue: deque[Coordinator] = deque()
        self._capacity = capacity
        self._lot = trio.lowlevel.ParkingLot()
        self.dropped = 0

    def push(self, state: Coordinator) -> None:
        if len(self._queue) >= self._capacity:
            self._queue.popleft()
            self.dropped += 1
            log.warning("coordinator state receiver lagging: dropped the oldest state")
        self._queue.append(state)
        self._lot.unpark_all()

    async def receive(self) -> Coordinator:
        """The next state (cancel safe: a cancelled wait loses nothing)."""
        while not self._queue:
            await self._lot.park()
        return self._queue.popleft()


def verifiers_train_may_have_changed(previous: Coordinator, state: Coordinator) -> bool:
    """Whether `state` must wait for a fresh read of the run's `verifiers_train` (and
    `exact_verification_threads`, set the same way) before it is handed out: when the run leaves a halt or its wait for members. The owner sets the option
    only while the run is halted (`set_verifiers_train`), so it may differ from the last read
    once the run leaves the halt; and again when an epoch starts (its rounds deal data by it),
    in case a halt came and went unseen (a subscription down meanwhile: the resync brings only
    the newest state). A few reads an epoch, not one per state (the account is 512 KiB)."""
    if previous.run_state is state.run_state:
        return False
    return previous.halted() or previous.run_state is RunState.WaitingForMembers


class SolanaBackendRunner:
    """A run followed through Solana: `psyche.coordinator.backend.Backend` for the client."""

    def __init__(
        self,
        backend: SolanaBackend,
        nursery: trio.Nursery,
        run_id: str,
        coordinator_instance: Pubkey,
        coordinator_account: Pubkey,
        init: CoordinatorAccount,
    ) -> None:
        self.backend = backend
        self.run_id = run_id
        self.instance = coordinator_instance
        self.account = coordinator_account
        self._nursery = nursery
        self._init: Coordinator | None = init.state.coordinator
        self._filter = NonceFilter(init.nonce)
        self._receivers: list[StateReceiver] = []
        self._primary = self.subscribe()
        self.latest: CoordinatorAccount = init
        self.failed_sends = 0
        self.completed_sends = 0
        self.resent_after_outage = 0
        self._tick_in_flight = False
        self._accepting = trio.Lock()
        self._rounds: dict[int, Coordinator] = {}
        """The first state of each recent round (`_note_round`)."""
        self.verifiers_train = False
        """The run's `CoordinatorConfig.verifiers_train`, which the coordinator account cannot
        hold: read from its verification account (`read_verification`) when the run is
        followed and before handing out a state on which it may have changed
        (`verifiers_train_may_have_changed`: the run leaving a halt, an epoch starting), and
        set on every state. The owner changes it only while the run is halted, so the first
        state after the halt already carries the new value, however short the warmup."""
        self.exact_verification_threads = 0
        """The run's `CoordinatorConfig.exact_verification_threads` (0: off), read and set as
        `verifiers_train` is (the owner changes it only while the run is halted, too)."""

    def _start(self) -> None:
        send, receive = trio.open_memory_channel[bytes](STATE_QUEUE_CAPACITY)
        urls = [self.backend.cluster.ws_rpc, *(c.ws_rpc for c in self.backend.backup_clusters)]
        for number, url in enumerate(urls, start=1):
            self._nursery.start_soon(self._subscription, url, send.clone(), number)
        send.close()
        self._nursery.start_soon(self._merge, receive)

    async def _subscription(
        self, url: str, send: trio.MemorySendChannel[bytes], number: int
    ) -> None:
        async def on_status(url: str, up: bool) -> None:
            if up:
                # Catch up with changes made while the subscription was down.
                self._nursery.start_soon(self._resync)

        async with send:
            await subscribe_to_account(
                url,
                self.account,
                send,
                commitment=self.backend.commitment,
                reconnect_delay=self.backend.reconnect_delay,
                on_status=on_status,
                subscription_number=number,
            )

    async def _resync(self) -> None:
        try:
            data = await self.backend.get_data(self.account)
        except Exception as e:
            log.warning("could not re-read the coordinator account: %s", e)
            return
        await self._accept(data)

    async def _merge(self, receive: trio.MemoryReceiveChannel[bytes]) -> None:
        async with receive:
            async for data in receive:
                await self._accept(data)
        log.error("no subscriptions available")

    async def _accept(self, data: bytes) -> None:
        # One state at a time: a state that waits for the verification account below is handed
        # out before a newer one (a resync and the subscription may both bring one).
        async with self._accepting:
            if not self._filter.accept(data):
                return
            try:
                account = coordinator_account_from_bytes(data)
            except ValueError as e:
                log.error("error deserializing coordinator account: %s", e)
                return
            coordinator = account.state.coordinator
            self._apply_settings(coordinator)
            previous, self.latest = self.latest.state.coordinator, account
            if verifiers_train_may_have_changed(previous, coordinator):
                await self.read_verification()  # after `latest`: which account it reads
                self._apply_settings(coordinator)
            self._note_round(coordinator)
            for i, receiver in enumerate(self._receivers):
                receiver.push(coordinator if i == 0 else coordinator.copy())

    def subscribe(self) -> StateReceiver:
        """Another independent stream of the states that arrive from now on."""
        receiver = StateReceiver()
        self._receivers.append(receiver)
        return receiver

    # ---- Backend protocol ---------------------------------------------------------------------

    def run_identity(self) -> str:
        """The run's coordinator account (`RunIdentity`): created with the run, so a run
        created again under the same id is another instance."""
        return str(self.account)

    async def wait_for_new_state(self) -> Coordinator:
        if self._init is not None:
            init, self._init = self._init, None
            self._apply_settings(init)
            self._note_round(init)
            return init
        return await self._primary.receive()

    async def read_verification(self) -> RunVerification | None:
        """The run's verification account, read once (None: the run verifies nothing, the
        account is not there, or the read failed: logged at DEBUG). It keeps
        `verifiers_train` in step with the run's (set on every state from now on)."""
        if self._verification() is None:
            return None
        try:
            found = await self.backend.get_run_verification(self.account)
        except SolanaBackendError as e:
            log.debug("could not read the verification account: %s", e)
            return None
        if found is not None:
            self.verifiers_train = found.verifiers_train
            self.exact_verification_threads = found.exact_verification_threads
        return found

    def _apply_settings(self, coordinator: Coordinator) -> None:
        """Put the run's settings kept in its verification account on a state read from the
        coordinator account (`RunVerification.apply_to`)."""
        coordinator.config.verifiers_train = self.verifiers_train
        coordinator.config.exact_verification_threads = self.exact_verification_threads

    def _verification(self) -> Pubkey | None:
        """The verification account the run's member instructions need (None: it verifies
        nothing)."""
        return self.backend.verification_account(self.account, self.latest)

    async def send_witness(self, opportunistic_data: OpportunisticData) -> None:
        name, instruction = self.backend.witness_instruction(
            self.instance, self.account, opportunistic_data, self._verification()
        )
        self.spawn_scheduled_send(name, [instruction])

    async def send_health_check(self, health_checks: list[HealthCheck]) -> None:
        for identity, proof in health_checks:
            instruction = coordinator_ix.coordinator_health_check(
                self.instance,
                self.account,
                self.backend.get_payer(),
                identity,
                proof,
                self.backend.ids,
            )
            self.spawn_scheduled_send(
                "Health check",
                [coordinator_ix.with_verification(instruction, self._verification())],
            )

    async def send_checkpoint(self, checkpoint: Checkpoint) -> None:
        instruction = coordinator_ix.coordinator_checkpoint(
            self.instance, self.account, self.backend.get_payer(), checkpoint, self.backend.ids
        )
        self.spawn_scheduled_send(
            "Checkpoint", [coordinator_ix.with_verification(instruction, self._verification())]
        )

    async def send_verification(self, report: VerificationReport) -> None:
        """`VerificationReports`: a verifier's or tie-breaker's findings of a round, sent as
        the `verification_report` instruction (a refusal by the program is logged), after the
        `Ed25519SigVerify` instruction of its draw when it has one (the program checks the draw
        through it). Its key and message are those the client signed: the round's duties as
        this runner followed them (`_draw_signer`), with no read of the verification account
        (before, a failed read sent the report without it, refused and never retried); the
        account is read only for a round this runner did not see (a subscription down)."""
        signer = None
        if report.draw != NO_DRAW and not is_follow_report(report):
            # the program reads the draw's Ed25519 precompile back (a follower's report's draw
            # is no signature: `FOLLOW_DRAW`)
            payer = bytes(self.backend.get_payer())
            signer = self._draw_signer(report.step, payer)
            if signer is None:
                stored = await self.read_verification()
                signer = None if stored is None else stored.draw_signer(report.step, payer)
            if signer is None:
                log.warning(
                    "verification report of step %d: the round's duties are not known here; "
                    "sent without its draw's Ed25519 instruction (the program refuses it)",
                    report.step,
                )
        instructions = coordinator_ix.verification_report_instructions(
            self.instance, self.account, self.backend.get_payer(), report, signer, self.backend.ids
        )
        self.spawn_scheduled_send("Verification report", instructions)

    def _note_round(self, state: Coordinator) -> None:
        """Keep the first state of each round of a verifying run this runner hands out (the
        last `VERIFIED_ROUNDS`): what the client derived its duties and signed its draw from,
        and what the program records the round's duties from (the same first state of
        `RoundTrain` or `RoundWitness`, `verifiers_train` set)."""
        if state.config.verification_percent == 0:
            return
        if state.run_state not in (RunState.RoundTrain, RunState.RoundWitness):
            return
        step = state.progress.step
        if step not in self._rounds:
            self._rounds[step] = state.copy()
            for old in sorted(self._rounds)[:-VERIFIED_ROUNDS]:
                del self._rounds[old]

    def _draw_signer(self, step: int, payer: bytes) -> tuple[bytes, bytes] | None:
        """The p2p key and draw message of this wallet's draw in round `step`, from the round's
        state as followed (None: not seen, or no draw of this wallet's)."""
        state = self._rounds.get(step)
        if state is None:
            return None
        try:
            duties = verification_duties_for_state(state)
        except (CoordinatorError, CoordinatorPanic) as e:
            log.debug("cannot derive the verification duties of step %d: %s", step, e)
            return None
        return draw_signer(duties, payer)

    async def round_reports(self, step: int) -> dict[NodeIdentity, VerificationReport]:
        """`VerificationReports.round_reports`: the reports the run's verification account
        holds for round `step` (one read; empty when it cannot be read or forgot the round)."""
        stored = await self.read_verification()
        found = None if stored is None else stored.round(step)
        return {} if found is None else dict(found.record().reports)

    # ---- extras the Solana client uses --------------------------------------------------------

    def send_tick(self) -> None:
        """Send a tick unless one is still on its way (the tick check would otherwise pile up
        sends every 500 ms while the RPC is unreachable). Not retried past the backend's
        retries: the next check sends a fresh one."""
        if self._tick_in_flight:
            return
        self._tick_in_flight = True

        def done() -> None:
            self._tick_in_flight = False

        self.spawn_scheduled_send(
            "Tick",
            [self.backend.tick_instruction(self.instance, self.account, self._verification())],
            retry_window=0.0,
            on_done=done,
        )

    async def join_run(self, client_id: NodeIdentity, authorizer: Any | None = None) -> Signature:
        return await self.backend.join_run(self.instance, self.account, client_id, authorizer)

    async def auto_tick(
        self,
        *,
        interval: float = TICK_CHECK_INTERVAL,
        now: Callable[[], int] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """Tick the run when its clock says so (upstream's 500 ms tick check), forever.

        Each check simulates a tick of the newest state at the current time (with the clients
        waiting to join while the run waits for members); when the run state would change, a
        tick is sent, by every client of a small run, else with probability 2/N so that about
        two of the N clients send one.
        """
        now = now or (lambda: int(time.time()))
        rng = rng or random.Random()
        while True:
            await trio.sleep(interval)
            account = self.latest
            simulated = account.state.coordinator.copy()
            pending = None
            if simulated.run_state is RunState.WaitingForMembers:
                pending = account.state.clients_state.get_active_clients_ids()
            before = simulated.run_state
            try:
                simulated.tick(pending, now(), rng.getrandbits(64))
            except (CoordinatorError, CoordinatorPanic):
                continue
            if simulated.run_state is before:
                continue
            clients = len(simulated.epoch_state.clients)
            if clients <= 2 or rng.random() <= 2.0 / clients:
                self.send_tick()

    def _progress(self) -> tuple[int, int]:
        progress = self.latest.state.coordinator.progress
        return progress.epoch, progress.step

    def spawn_scheduled_send(
        self,
        name: str,
        instructions: list[Instruction],
        *,
        retry_window: float = SEND_RETRY_WINDOW,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Send in the background; a failure after all retries is logged, not raised.

        When every endpoint failed with retryable errors (the RPC went away), the send is tried
        again every `SEND_RETRY_DELAY` seconds for up to `retry_window` seconds while the run is
        still at the epoch and step it was sent for (a witness can still count); upstream gives
        up after the backend's retries. A rejection by the program is never retried.
        """

        async def send() -> None:
            progress = self._progress()
            deadline = trio.current_time() + retry_window
            sent: list[Signature] = []
            try:
                while True:
                    try:
                        await self.backend.send_and_retry(name, instructions, sent=sent)
                        self.completed_sends += 1
                        return
                    except SolanaBackendError as e:
                        if (
                            e.kind is None
                            and trio.current_time() + SEND_RETRY_DELAY < deadline
                            and self._progress() == progress
                        ):
                            self.resent_after_outage += 1
                            log.warning(
                                "%s transaction: every RPC endpoint failed; trying again while "
                                "it can still count: %s",
                                name,
                                e,
                            )
                            await trio.sleep(SEND_RETRY_DELAY)
                            continue
                        raise
            except Exception as e:
                self.failed_sends += 1
                log.error("failed to send %s transaction after all retries: %s", name, e)
            finally:
                if on_done is not None:
                    on_done()

        self._nursery.start_soon(send)


class LeftRun(UserError):
    """The client is out of the run: it was not selected, is no longer healthy, or the run
    halted after it had joined (upstream's client exits in these cases).

    A `UserError`, so the command ends on one line that says why (the coordinator's verdict),
    not on a traceback that calls an expected way out of a run a bug."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"this client is out of the run: {reason}")
        self.reason = reason


@dataclass
class Membership:
    """Where a client stands with the run; `follow_membership` keeps it up to date."""

    joined_this_epoch: bool = False
    ever_joined: bool = False
    joins: int = 0
    failed_joins: int = 0
    abandoned_epoch_seen: bool = False


def epoch_abandoned(state: Coordinator) -> bool:
    """The coordinator withdrew every client and ended the epoch (a round without any witness:
    nobody can tell who left). Nobody is to blame, so a client stays for the next epoch (upstream's
    client exits on any state but Healthy; the centralized Python client stays too)."""
    clients = state.epoch_state.clients
    return (
        state.run_state is RunState.Cooldown
        and bool(clients)
        and all(c.state is ClientState.Withdrawn for c in clients)
    )


JOIN_RETRY_DELAY = 1.0


async def follow_membership(
    runner: SolanaBackendRunner,
    identity: NodeIdentity,
    authorizer: Any | None = None,
    membership: Membership | None = None,
    *,
    join_retry_delay: float = JOIN_RETRY_DELAY,
) -> None:
    """Join the run every time it waits for members, and raise `LeftRun` when the client drops
    out of it (upstream `app.rs`). Runs until cancelled; reads its own state stream.

    A join that fails for a passing reason (every RPC endpoint unreachable, the 5 s join timeout)
    is tried again every `join_retry_delay` seconds while the run still waits for members;
    upstream's client exits instead. A refused join (no authorization, a program error) raises.
    Being withdrawn with everyone else (`epoch_abandoned`) is not leaving: the client joins the
    next epoch.
    """
    membership = membership if membership is not None else Membership()
    states = runner.subscribe()
    state = runner.latest.state.coordinator
    while True:
        if state.run_state is RunState.WaitingForMembers:
            if not membership.joined_this_epoch:
                try:
                    signature = await runner.join_run(identity, authorizer)
                except SolanaBackendError as e:
                    if e.kind in (RetryKind.NonRetryable, RetryKind.Fatal):
                        raise
                    membership.failed_joins += 1
                    log.warning("could not join run %s, will retry: %s", runner.run_id, e)
                    with trio.move_on_after(join_retry_delay):
                        state = await states.receive()
                    continue
                log.info("joined run %s in %s", runner.run_id, signature)
                membership.joined_this_epoch = membership.ever_joined = True
                membership.joins += 1
        else:
            if state.run_state is not RunState.Cooldown:
                membership.abandoned_epoch_seen = False
            if membership.ever_joined:
                if state.halted():
                    raise LeftRun(f"the run is {state.run_state}")
                clients = state.epoch_state.clients
                me = next((c for c in clients if c.id == identity), None)
                if me is None:
                    raise LeftRun("Not a participant")
                if me.state is not ClientState.Healthy:
                    if not epoch_abandoned(state):
                        raise LeftRun(f"the coordinator says this client is {me.state}")
                    if not membership.abandoned_epoch_seen:
                        log.warning(
                            "the coordinator ended epoch %d without witnesses and withdrew "
                            "every client; joining the next epoch",
                            state.progress.epoch,
                        )
                    membership.abandoned_epoch_seen = True
            membership.joined_this_epoch = False
        state = await states.receive()


__all__ = [
    "LeftRun",
    "Membership",
    "SolanaBackendRunner",
    "StateReceiver",
    "epoch_abandoned",
    "follow_membership",
    "follow_run",
    "verifiers_train_may_have_changed",
]
