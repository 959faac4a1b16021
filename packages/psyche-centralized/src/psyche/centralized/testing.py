"""Helpers for driving a server over TCP in tests (upstream's `centralized/testing` crate); the
coordinators they serve and the witnesses they send come from `psyche.coordinator.testing`.

* `fast_options`: server options whose clock runs `speed` times faster than the wall clock (all
  coordinator timings are whole "seconds" of that clock), on loopback, ticking accordingly;
* `ProtocolClient`: a client that speaks the raw protocol (no training): join, send any
  message (or any frame payload, for hostile tests), read what the server sends;
  `health_check_payload` is such a payload: a well-formed HealthCheck of any size;
* `DummyTrainer`: a protocol client that behaves like upstream's dummy-training client (no
  model): a warmup witness `warmup_delay` seconds into every warmup (upstream's clients first
  load the model and wait for each other), and, when elected witness, a round witness naming
  every current client, sent `training_delay` seconds into the round (or, `late`, only once
  the round is over: a witness delayed past its round). It reports the step as real clients
  do (the coordinator's `progress.step`), and stops quietly when the server closes its
  connection (`closed_by_server`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import trio

from psyche.centralized.protocol import (
    CLIENT_TO_SERVER_CODEC,
    SERVER_TO_CLIENT_CODEC,
    ClientToServerMessage,
    JoinRun,
    ServerToClientMessage,
)
from psyche.centralized.server import ServerOptions
from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.coordinator import Coordinator
from psyche.coordinator.run_state import RunState, WitnessMetadata
from psyche.coordinator.testing import round_witness_for, warmup_witness_for
from psyche.core.identity import SecretKey
from psyche.core.node_identity import NodeIdentity
from psyche.core.serde import encode_varint
from psyche.transport import ConnectionClosed, TcpClient


def fast_options(speed: float = 10.0, **options: Any) -> ServerOptions:
    """Loopback server options with a clock `speed` times the wall clock."""
    start = time.monotonic()
    base = int(time.time())
    defaults: dict[str, Any] = {
        "host": "127.0.0.1",
        "tick_interval": 0.5 / speed,
        "clock": lambda: base + int((time.monotonic() - start) * speed),
        "download_checkpoint": False,
    }
    defaults.update(options)
    return ServerOptions(**defaults)


def health_check_payload(size: int) -> bytes:
    """A well-formed HealthCheck message of about `size` bytes (at most): its variant, its
    length and entries of an identity and a committee proof (67 bytes each). At 8 MiB it is
    issue 24's attack: 125,202 entries that the server used to decode before it looked at who
    sent them."""
    entry = bytes(range(64)) + b"\x00\x01\x01"
    count = (size - 2 - 10) // len(entry)
    header = bytearray([ClientToServerMessage.HealthCheck.index])
    encode_varint(count, header)
    return bytes(header) + entry * count


class ProtocolClient:
    """A raw protocol client: `async with ProtocolClient.connect(addr) as c: await c.join(id)`."""

    def __init__(self, conn: TcpClient[ClientToServerMessage, ServerToClientMessage], key: Any):
        self.conn = conn
        self.key = key
        self.identity = NodeIdentity.from_single_key(key.public_key)
        self.received: list[ServerToClientMessage] = []

    @classmethod
    async def connect(cls, address: str, key: Any = None) -> ProtocolClient:
        key = key or SecretKey.generate()
        conn = await TcpClient.connect(
            address, key, to_server=CLIENT_TO_SERVER_CODEC, to_client=SERVER_TO_CLIENT_CODEC
        )
        return cls(conn, key)

    async def __aenter__(self) -> ProtocolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.conn.aclose()

    async def send(self, message: ClientToServerMessage) -> None:
        await self.conn.send(message)

    async def send_payload(self, payload: bytes) -> None:
        """Any bytes as a message (its `Else` envelope added): what a hostile client sends."""
        await self.conn.send_encoded(payload)

    async def join(self, run_id: str) -> None:
        await self.send(ClientToServerMessage.Join(JoinRun(run_id)))

    async def receive(self) -> ServerToClientMessage:
        message = await self.conn.receive()
        self.received.append(message)
        return message

    async def next_coordinator(self) -> Coordinator:
        while True:
            match await self.receive():
                case ServerToClientMessage.Coordinator(state):
                    coordinator: Coordinator = state
                    return coordinator

    async def wait_for(self, predicate: Any, timeout: float = 10.0) -> Coordinator:
        """The first coordinator state satisfying `predicate`."""
        with trio.fail_after(timeout):
            while True:
                state = await self.next_coordinator()
                if predicate(state):
                    return state


_ROUND_STATES = (RunState.RoundTrain, RunState.RoundWitness)


class DummyTrainer:
    """Runs a `ProtocolClient` as an honest client without a model; use inside a nursery:
    `trainer = await DummyTrainer.start(nursery, address, run_id)`; `stop()` drops it."""

    def __init__(
        self,
        client: ProtocolClient,
        run_id: str,
        training_delay: float,
        warmup_delay: float,
        late: bool = False,
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.training_delay = training_delay
        self.warmup_delay = warmup_delay
        self.late = late
        self.latest: Coordinator | None = None
        self.sent: list[tuple[str, int, int]] = []  # (kind, epoch, height)
        self.closed_by_server = False
        self._held: tuple[tuple[int, int], OpportunisticData] | None = None  # a late witness
        self._scope = trio.CancelScope()

    @property
    def identity(self) -> NodeIdentity:
        return self.client.identity

    @classmethod
    async def start(
        cls,
        nursery: trio.Nursery,
        address: str,
        run_id: str,
        *,
        key: Any = None,
        training_delay: float = 0.0,
        warmup_delay: float = 0.0,
        late: bool = False,
    ) -> DummyTrainer:
        client = await ProtocolClient.connect(address, key)
        trainer = cls(client, run_id, training_delay, warmup_delay, late)
        await client.join(run_id)
        nursery.start_soon(trainer._run)
        return trainer

    def stop(self) -> None:
        """Abort the client (its connection drops, as upstream's tests abort a client task)."""
        self._scope.cancel()

    async def _run(self) -> None:
        with self._scope:
            try:
                async with trio.open_nursery() as nursery:
                    while True:
                        try:
                            state = await self.client.next_coordinator()
                        except (ConnectionClosed, trio.BrokenResourceError):
                            self.closed_by_server = True
                            return
                        self.latest = state
                        self._react(state, nursery)
            finally:
                with trio.CancelScope(shield=True):
                    await self.client.conn.aclose()

    def _my_index(self, state: Coordinator) -> int | None:
        for index, client in enumerate(state.epoch_state.clients):
            if client.id == self.identity:
                return index
        return None

    def _react(self, state: Coordinator, nursery: trio.Nursery) -> None:
        epoch = state.progress.epoch
        current = state.current_round()
        height = current.height if current is not None else 0
        if self._held is not None and (
            self._held[0] != (epoch, height) or state.run_state not in _ROUND_STATES
        ):  # its round is over: the late witness goes now
            nursery.start_soon(self._send, self._held[1], 0.0)
            self._held = None
        index = self._my_index(state)
        if index is None:
            return
        if state.run_state is RunState.Warmup:
            key = ("warmup", epoch, 0)
            if key not in self.sent:
                self.sent.append(key)
                data = OpportunisticData.WarmupStep(warmup_witness_for(index))
                nursery.start_soon(self._send, data, self.warmup_delay)
        elif state.run_state in _ROUND_STATES:
            key = ("witness", epoch, height)
            if key in self.sent:
                return
            self.sent.append(key)
            participants = [c.id for c in state.epoch_state.clients]
            witness = round_witness_for(
                state, index, participants=participants, bloom_keys=range(8)
            )
            if witness is not None:
                metadata = WitnessMetadata(step=state.progress.step)
                data = OpportunisticData.WitnessStep((witness, metadata))
                if self.late:
                    self._held = ((epoch, height), data)
                else:
                    nursery.start_soon(self._send, data, self.training_delay)

    async def _send(self, data: OpportunisticData, delay: float) -> None:
        await trio.sleep(delay)
        with contextlib.suppress(Exception):
            await self.client.send(ClientToServerMessage.Witness(data))


__all__ = ["DummyTrainer", "ProtocolClient", "fast_options", "health_check_payload"]
