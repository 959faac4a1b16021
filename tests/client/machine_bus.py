"""Step state machines without sockets, as the client tests drive them: tokens per data index
that every client fetches alike (`FakeData`), and an in-memory bus (`Bus`, each machine's `BusIO`)
that delivers gossip, payloads, witnesses and health checks between machines in order, with a
simulated coordinator behind it; `settle` waits for the moment the simulated clock may move."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import trio
import trio.lowlevel

from psyche.client.background import InFlight
from psyche.client.round.broadcast import Broadcast, BroadcastType, TrainingResult
from psyche.client.round.payloads import DownloadRequest
from psyche.client.round.steps import StepStateMachine
from psyche.client.round.train import OwnResult
from psyche.client.round.witness import SendFinished, finished_broadcast
from psyche.coordinator.backend import HealthCheck, OpportunisticData
from psyche.coordinator.commitment import Commitment
from psyche.coordinator.testing import Simulation
from psyche.core.batch_id import BatchId
from psyche.core.identity import SecretKey
from psyche.core.node_identity import NodeIdentity
from psyche.data_provider.types import TokenizedData
from psyche.modeling.serialized_distro import TransmittableDistroResult
from psyche.network.ticket import BlobFormat, BlobTicket, EndpointAddr

SEQ = 16


class FakeData:
    """Deterministic tokens per data index (what a shared dataset gives every client)."""

    def __init__(self) -> None:
        self.fetched: list[BatchId] = []

    async def get_samples(self, batch: BatchId) -> list[TokenizedData]:
        self.fetched.append(batch)
        rows = np.stack(
            [np.random.default_rng(i).integers(0, 256, SEQ, dtype=np.int32) for i in batch]
        )
        return TokenizedData.from_rows(rows)


@dataclass
class Node:
    key: SecretKey
    identity: NodeIdentity
    machine: StepStateMachine | None = None
    sent_results: list[OwnResult] = field(default_factory=list)
    corrupt_payloads: bool = False
    lose_downloads: bool = False
    """Once it has sent two results, the payloads it asks for never arrive."""


class Bus:
    """Delivers gossip, blobs, witnesses and health checks between machines, in order."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.nodes: dict[NodeIdentity, Node] = {}
        self.blobs: dict[bytes, TransmittableDistroResult] = {}
        self._send, self._receive = trio.open_memory_channel[Callable[[], None]](1 << 16)
        self.rejected_witnesses: list[str] = []
        self.in_flight = InFlight()
        self.hold: Callable[[Node, Node, Broadcast], bool] = lambda _s, _r, _b: False
        """Whether a gossip message from the first node to the second is held back until the
        receiver has started the round two after the message's (`deliver_held`)."""
        self.held: list[tuple[Node, Node, Broadcast]] = []

    def post(self, fn: Callable[[], None]) -> None:
        self.in_flight.begin()
        self._send.send_nowait(fn)

    async def pump(self) -> None:
        async for fn in self._receive:
            try:
                fn()
            finally:
                self.in_flight.end()

    def gossip(self, sender: Node, broadcast: Broadcast, *, to_sender: bool = True) -> None:
        """To every machine; the sender's own too, as its client loop applies what it sends
        (except its training results, which go into its round state directly)."""
        for node in self.nodes.values():
            if node.machine is not None and (to_sender or node is not sender):
                if self.hold(sender, node, broadcast):
                    self.held.append((sender, node, broadcast))
                    continue
                self.post(lambda n=node: n.machine.apply_message(sender.identity, broadcast))

    def deliver_held(self) -> None:
        """The held messages whose receiver has started the round two after theirs."""
        due = [h for h in self.held if h[1].machine.current.step >= h[2].step + 2]
        for sender, node, broadcast in due:
            self.held.remove((sender, node, broadcast))
            self.post(lambda n=node, s=sender, b=broadcast: n.machine.apply_message(s.identity, b))

    def witness(self, sender: Node, data: OpportunisticData) -> None:
        coordinator = self.sim.coordinator
        try:
            match data:
                case OpportunisticData.WitnessStep((witness, _)):
                    coordinator.witness(sender.identity, witness, self.sim.now)
                case OpportunisticData.WarmupStep(witness):
                    coordinator.warmup_witness(sender.identity, witness, self.sim.now, 1)
        except Exception as e:  # the server logs and carries on
            self.rejected_witnesses.append(str(e))


class BusIO:
    def __init__(self, bus: Bus, node: Node) -> None:
        self.bus, self.node = bus, node

    def send_witness(self, data: OpportunisticData) -> None:
        self.bus.post(lambda: self.bus.witness(self.node, data))

    def send_health_check(self, checks: list[HealthCheck]) -> None:
        self.bus.post(lambda: self.bus.sim.coordinator.health_check(self.node.identity, checks))

    def send_checkpoint(self, checkpoint) -> None:  # type: ignore[no-untyped-def]
        pass

    def broadcast_finished(self, action: SendFinished) -> None:
        signature = self.node.key.sign(action.commitment_data_hash)
        self.bus.gossip(self.node, finished_broadcast(action, signature, 0))

    def publish_result(self, result: OwnResult) -> None:
        payload = result.payload
        self.node.sent_results.append(result)
        sent = payload
        if self.node.corrupt_payloads:  # flip the first value byte after committing
            first = payload.distro_results[0]
            data = bytearray(first.sparse_val.data.value)
            data[0] ^= 0xFF
            val = type(first.sparse_val)(
                first.sparse_val.dims, first.sparse_val.kind, False,
                type(first.sparse_val.data).OneBit(bytes(data)),
            )  # fmt: skip
            results = [type(first)(first.sparse_idx, val, first.xshape, first.totalk)]
            sent = TransmittableDistroResult(
                payload.step, payload.trainer_nonce, payload.batch_id,
                results + list(payload.distro_results[1:]),
            )  # fmt: skip
        blob = hashlib.sha256(sent.to_bytes()).digest()
        self.bus.blobs[blob] = sent
        ticket = BlobTicket(
            EndpointAddr(self.node.identity.p2p_identity, []), BlobFormat.Raw, blob, 1
        )
        broadcast = Broadcast(
            step=result.step,
            proof=result.proof,
            commitment=Commitment(
                result.commitment_data_hash, self.node.key.sign(result.commitment_data_hash)
            ),
            nonce=0,
            data=BroadcastType.TrainingResult(TrainingResult(result.batch_id, ticket)),
        )
        self.bus.gossip(self.node, broadcast, to_sender=False)
        machine = self.node.machine
        self.bus.post(lambda: machine.apply_own_result(broadcast, result))

    def request_download(self, request: DownloadRequest) -> None:
        if self.node.lose_downloads and len(self.node.sent_results) >= 2:
            return
        blob = request.ticket.hash
        machine = self.node.machine
        self.bus.post(lambda: machine.apply_distro_result(blob, self.bus.blobs[blob]))

    def share_model(self, parameters, version) -> None:  # type: ignore[no-untyped-def]
        pass


async def settle(bus: Bus, nodes: list[Node]) -> None:
    """Wait until no message is on the bus and no client is computing (training, checking or
    deserializing a payload): the moment the simulated clock may move."""
    while True:
        await bus.in_flight.wait_idle()
        for node in nodes:
            await node.machine.wait_idle()
        await trio.lowlevel.checkpoint()
        if bus.in_flight.count == 0 and all(node.machine.tasks.running == 0 for node in nodes):
            return
