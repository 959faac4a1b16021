"""The Solana backend: reads and writes a run's on-chain state, and follows it (upstream
`psyche_solana_rpc::backend`).

`SolanaBackend` talks to a primary RPC endpoint and optional backups. Every call goes through
`rpc_with_fallback`: up to 3 retries with backoff on one endpoint for retryable errors, then the
next endpoint; a non-retryable or fatal error stops at once. Transactions are legacy transactions
paid and signed by the wallet, with a fresh blockhash per attempt, sent with preflight and
confirmed at the backend's commitment.

`SolanaBackend.start` yields a `SolanaBackendRunner`, which implements the training client's
`psyche.coordinator.backend.Backend`: it subscribes to the run's coordinator account on every
endpoint's websocket, de-duplicates the notifications by nonce, and hands out decoded
`Coordinator` states; witness, health-check, checkpoint and tick transactions are sent in the
background (failures are logged, as upstream).
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import trio
from solders.instruction import Instruction
from solders.keypair import Keypair
from solders.message import Message
from solders.pubkey import Pubkey
from solders.signature import Signature
from solders.token.state import Mint, TokenAccount
from solders.transaction import Transaction

from psyche.coordinator.backend import HealthCheck, OpportunisticData
from psyche.coordinator.coordinator import ClientState, Coordinator, RunState
from psyche.coordinator.errors import CoordinatorError, CoordinatorPanic
from psyche.coordinator.model import Checkpoint
from psyche.core.node_identity import NodeIdentity
from psyche.solana import instructions as ix
from psyche.solana import pda
from psyche.solana.program_ids import DEFAULT_PROGRAM_IDS, ProgramIds
from psyche.solana.retry import RetryFailed, RetryKind, RetryPolicy, retry_with_backoff
from psyche.solana.rpc import AccountInfo, AccountNotFound, SolanaRpcClient, TransactionError
from psyche.solana.state import (
    JOIN_RUN_AUTHORIZATION_SCOPE,
    Authorization,
    CoordinatorAccount,
    CoordinatorInstance,
    Participant,
    TreasurerRun,
    coordinator_account_from_bytes,
    decode_anchor_account,
)
from psyche.solana.subscription import NonceFilter, subscribe_to_account, upstream_reconnect_delay

log = logging.getLogger(__name__)

T = TypeVar("T")

JOIN_RUN_TIMEOUT = 5.0
TICK_CHECK_INTERVAL = 0.5
SEND_RETRY_WINDOW = 60.0
SEND_RETRY_DELAY = 1.0
UPSTREAM_RETRY_POLICY = RetryPolicy()
STATE_QUEUE_CAPACITY = 32
LOCALNET_RPC = "http://127.0.0.1:8899"
LOCALNET_WS_RPC = "ws://127.0.0.1:8900"
DEVNET_RPC = "https://api.devnet.solana.com"
DEVNET_WS_RPC = "wss://api.devnet.solana.com"


@dataclass(frozen=True)
class Cluster:
    """An RPC endpoint and its websocket twin."""

    rpc: str = LOCALNET_RPC
    ws_rpc: str = LOCALNET_WS_RPC

    def __post_init__(self) -> None:
        # Upstream trims surrounding quotes (values often come from .env files).
        object.__setattr__(self, "rpc", self.rpc.strip().strip('"'))
        object.__setattr__(self, "ws_rpc", self.ws_rpc.strip().strip('"'))


class SolanaBackendError(Exception):
    """A backend call that failed for good; `kind` is why (None: every endpoint exhausted)."""

    def __init__(self, message: str, kind: RetryKind | None, cause: BaseException | None) -> None:
        super().__init__(message)
        self.kind = kind
        self.cause = cause


class SolanaBackend:
    def __init__(
        self,
        cluster: Cluster,
        payer: Keypair,
        backup_clusters: Sequence[Cluster] = (),
        *,
        ids: ProgramIds = DEFAULT_PROGRAM_IDS,
        commitment: str = "confirmed",
        retry_policy: RetryPolicy = UPSTREAM_RETRY_POLICY,
        confirm_timeout: float = 30.0,
        rpc_timeout: float = 30.0,
        reconnect_delay: Callable[[int], float] = upstream_reconnect_delay,
    ) -> None:
        self.cluster = cluster
        self.backup_clusters = [b for b in backup_clusters if b.rpc != cluster.rpc]
        self.payer = payer
        self.ids = ids
        self.commitment = commitment
        self.retry_policy = retry_policy
        self.confirm_timeout = confirm_timeout
        self.reconnect_delay = reconnect_delay
        self.clients = [
            SolanaRpcClient(c.rpc, commitment=commitment, timeout=rpc_timeout)
            for c in [cluster, *self.backup_clusters]
        ]

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()

    async def __aenter__(self) -> SolanaBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def get_payer(self) -> Pubkey:
        return self.payer.pubkey()

    # ---- fallback ---------------------------------------------------------------------------

    async def rpc_with_fallback(
        self, name: str, operation: Callable[[SolanaRpcClient], Awaitable[T]]
    ) -> T:
        last_error: RetryFailed | None = None
        for index, client in enumerate(self.clients):
            try:
                return await retry_with_backoff(
                    name, lambda c=client: operation(c), self.retry_policy
                )
            except RetryFailed as failed:
                if failed.kind is RetryKind.NonRetryable:
                    raise SolanaBackendError(
                        f"non-retryable RPC error: {failed}", failed.kind, failed.cause
                    ) from failed.cause
                if failed.kind is RetryKind.Fatal:
                    raise SolanaBackendError(
                        f"fatal RPC error: {failed}", failed.kind, failed.cause
                    ) from failed.cause
                log.warning(
                    "RPC %d (%s) exhausted retries for %s, trying next: %s",
                    index,
                    client.url,
                    name,
                    failed,
                )
                last_error = failed
        raise SolanaBackendError(
            f"all RPCs exhausted: {last_error}",
            None,
            None if last_error is None else last_error.cause,
        )

    # ---- reads ------------------------------------------------------------------------------

    async def get_account_info(self, address: Pubkey) -> AccountInfo | None:
        return await self.rpc_with_fallback(
            "get_account_info", lambda c: c.get_account_info(address)
        )

    async def get_data(self, address: Pubkey) -> bytes:
        return await self.rpc_with_fallback("get_data", lambda c: c.get_account_data(address))

    async def get_balance(self, address: Pubkey) -> int:
        return await self.rpc_with_fallback("get_balance", lambda c: c.get_balance(address))

    async def get_minimum_balance_for_rent_exemption(self, space: int) -> int:
        return await self.rpc_with_fallback(
            "get_minimum_balance_for_rent_exemption",
            lambda c: c.get_minimum_balance_for_rent_exemption(space),
        )

    async def get_logs(self, signature: Signature) -> list[str]:
        return await self.rpc_with_fallback("get_logs", lambda c: c.get_transaction_logs(signature))

    async def get_coordinator_instance(self, address: Pubkey) -> CoordinatorInstance:
        return decode_anchor_account(await self.get_data(address), CoordinatorInstance)

    async def get_coordinator_account(self, address: Pubkey) -> CoordinatorAccount:
        return coordinator_account_from_bytes(await self.get_data(address))

    async def get_authorization(self, address: Pubkey) -> Authorization:
        return decode_anchor_account(await self.get_data(address), Authorization)

    async def get_treasurer_run(self, address: Pubkey) -> TreasurerRun:
        return decode_anchor_account(await self.get_data(address), TreasurerRun)

    async def get_treasurer_participant(self, address: Pubkey) -> Participant:
        return decode_anchor_account(await self.get_data(address), Participant)

    async def get_token_account(self, address: Pubkey) -> TokenAccount:
        return TokenAccount.from_bytes(await self.get_data(address))

    async def get_token_mint(self, address: Pubkey) -> Mint:
        return Mint.from_bytes(await self.get_data(address))

    async def resolve_treasurer_index(
        self, run_id: str, treasurer_index: int | None = None
    ) -> int | None:
        """The run's treasurer index if its treasurer `Run` account exists, else None."""
        index = pda.compute_deterministic_treasurer_index(run_id, treasurer_index)
        balance = await self.get_balance(pda.find_run(index, self.ids))
        return index if balance > 0 else None

    def find_join_authorization(self, join_authority: Any, authorizer: Any | None) -> Pubkey:
        return pda.find_join_authorization(join_authority, authorizer, self.ids)

    # ---- writes -----------------------------------------------------------------------------

    async def send_and_retry(
        self,
        name: str,
        instructions: Sequence[Instruction],
        signers: Sequence[Keypair] = (),
        *,
        sent: list[Signature] | None = None,
    ) -> Signature:
        """Send and confirm. `sent` collects the signature of every attempt; passing the same
        list to a later call makes it check those attempts first (one may have landed)."""
        log.info("sending transaction: %s", name)
        all_signers = [self.payer, *(s for s in signers if s.pubkey() != self.payer.pubkey())]
        message = Message(list(instructions), self.payer.pubkey())
        required = message.account_keys[: message.header.num_required_signatures]
        missing = set(required) - {s.pubkey() for s in all_signers}
        if missing:
            raise SolanaBackendError(
                f"{name}: cannot sign, missing the keypair of {sorted(map(str, missing))}",
                RetryKind.NonRetryable,
                None,
            )

        sent = [] if sent is None else sent

        async def attempt(client: SolanaRpcClient) -> Signature:
            # An earlier attempt may have landed although its answer was lost (the endpoint
            # went away mid-request): sending again would run the instructions twice.
            for earlier in sent:
                status = await client.get_signature_status(earlier)
                if status is not None:
                    if status.get("err") is not None:
                        raise TransactionError(earlier, status["err"])
                    return earlier
            blockhash, _ = await client.get_latest_blockhash()
            tx = Transaction(all_signers, message, blockhash)
            signature = tx.signatures[0]
            sent.append(signature)
            await client.send_transaction(bytes(tx))
            await client.confirm_transaction(signature, timeout=self.confirm_timeout)
            return signature

        signature = await self.rpc_with_fallback(name, attempt)
        log.info("transaction success: %s, %s", name, signature)
        return signature

    async def join_run(
        self,
        coordinator_instance: Pubkey,
        coordinator_account: Pubkey,
        client_id: NodeIdentity,
        authorizer: Any | None = None,
    ) -> Signature:
        """Join the run (5 s timeout, as upstream: better to give up and try again)."""
        instance = await self.get_coordinator_instance(coordinator_instance)
        authorization = self.find_join_authorization(instance.join_authority, authorizer)
        await self.check_join_authorization(instance, authorization, client_id, authorizer)
        instruction = ix.coordinator_join_run(
            coordinator_instance, coordinator_account, authorization, client_id, self.ids
        )
        with trio.move_on_after(JOIN_RUN_TIMEOUT) as scope:
            return await self.send_and_retry("Join run", [instruction])
        assert scope.cancelled_caught
        raise SolanaBackendError(f"join_run timeout after {JOIN_RUN_TIMEOUT:.0f}s", None, None)

    async def check_join_authorization(
        self,
        instance: CoordinatorInstance,
        authorization: Pubkey,
        client_id: NodeIdentity,
        authorizer: Any | None,
    ) -> None:
        """Fail early, and clearly, when the run's join authorization does not cover us (the
        program would reject the join with a bare constraint error)."""
        join_authority = Pubkey.from_bytes(instance.join_authority)
        try:
            state = await self.get_authorization(authorization)
        except SolanaBackendError as e:
            if isinstance(e.cause, AccountNotFound):
                whom = "everyone" if authorizer is None else f"authorizer {authorizer}"
                raise SolanaBackendError(
                    f"cannot join: the run's join authority {join_authority} has not authorized "
                    f"{whom} (no authorization at {authorization}); a permissioned run needs "
                    "--authorizer",
                    RetryKind.NonRetryable,
                    e.cause,
                ) from None
            raise
        if not state.is_valid_for(join_authority, client_id.signer, JOIN_RUN_AUTHORIZATION_SCOPE):
            raise SolanaBackendError(
                f"cannot join: the authorization at {authorization} does not cover "
                f"{Pubkey.from_bytes(client_id.signer)} (inactive, or neither its grantee nor a "
                "delegate)",
                RetryKind.NonRetryable,
                None,
            )

    def tick_instruction(
        self, coordinator_instance: Pubkey, coordinator_account: Pubkey
    ) -> Instruction:
        return ix.coordinator_tick(
            coordinator_instance, coordinator_account, self.get_payer(), self.ids
        )

    def witness_instruction(
        self, coordinator_instance: Pubkey, coordinator_account: Pubkey, data: OpportunisticData
    ) -> tuple[str, Instruction]:
        match data:
            case OpportunisticData.WitnessStep((witness, metadata)):
                return "Witness", ix.coordinator_witness(
                    coordinator_instance,
                    coordinator_account,
                    self.get_payer(),
                    witness,
                    metadata,
                    self.ids,
                )
            case OpportunisticData.WarmupStep(witness):
                return "Warmup witness", ix.coordinator_warmup_witness(
                    coordinator_instance, coordinator_account, self.get_payer(), witness, self.ids
                )
        raise TypeError(f"not opportunistic data: {data!r}")

    # ---- following a run --------------------------------------------------------------------

    @asynccontextmanager
    async def start(
        self, run_id: str, coordinator_account: Pubkey
    ) -> AsyncIterator[SolanaBackendRunner]:
        """Follow the run's coordinator account while the context is open."""
        coordinator_instance = pda.find_coordinator_instance(run_id, self.ids)
        log.info("coordinator account address: %s", coordinator_account)
        log.info("coordinator instance address for run %r: %s", run_id, coordinator_instance)
        init = await self.get_coordinator_account(coordinator_account)
        async with trio.open_nursery() as nursery:
            runner = SolanaBackendRunner(
                self, nursery, run_id, coordinator_instance, coordinator_account, init
            )
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
        self._accept(data)

    async def _merge(self, receive: trio.MemoryReceiveChannel[bytes]) -> None:
        async with receive:
            async for data in receive:
                self._accept(data)
        log.error("no subscriptions available")

    def _accept(self, data: bytes) -> None:
        if not self._filter.accept(data):
            return
        try:
            account = coordinator_account_from_bytes(data)
        except ValueError as e:
            log.error("error deserializing coordinator account: %s", e)
            return
        self.latest = account
        for i, receiver in enumerate(self._receivers):
            coordinator = account.state.coordinator
            receiver.push(coordinator if i == 0 else coordinator.copy())

    def subscribe(self) -> StateReceiver:
        """Another independent stream of the states that arrive from now on."""
        receiver = StateReceiver()
        self._receivers.append(receiver)
        return receiver

    # ---- Backend protocol ---------------------------------------------------------------------

    async def wait_for_new_state(self) -> Coordinator:
        if self._init is not None:
            init, self._init = self._init, None
            return init
        return await self._primary.receive()

    async def send_witness(self, opportunistic_data: OpportunisticData) -> None:
        name, instruction = self.backend.witness_instruction(
            self.instance, self.account, opportunistic_data
        )
        self.spawn_scheduled_send(name, [instruction])

    async def send_health_check(self, health_checks: list[HealthCheck]) -> None:
        for identity, proof in health_checks:
            instruction = ix.coordinator_health_check(
                self.instance,
                self.account,
                self.backend.get_payer(),
                identity,
                proof,
                self.backend.ids,
            )
            self.spawn_scheduled_send("Health check", [instruction])

    async def send_checkpoint(self, checkpoint: Checkpoint) -> None:
        instruction = ix.coordinator_checkpoint(
            self.instance, self.account, self.backend.get_payer(), checkpoint, self.backend.ids
        )
        self.spawn_scheduled_send("Checkpoint", [instruction])

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
            [self.backend.tick_instruction(self.instance, self.account)],
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


class LeftRun(Exception):
    """The client is out of the run: it was not selected, is no longer healthy, or the run
    halted after it had joined (upstream's client exits in these cases)."""


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
    "AccountNotFound",
    "Cluster",
    "LeftRun",
    "Membership",
    "SolanaBackend",
    "SolanaBackendError",
    "SolanaBackendRunner",
    "StateReceiver",
    "epoch_abandoned",
    "follow_membership",
]
