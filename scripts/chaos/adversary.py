"""A hostile run member: joins a centralized run like a client, then lies in every way it can.

    python scripts/chaos/adversary.py --server-addr 127.0.0.1:PORT --run-id tiny-cpu \
        --key-number 66 --peers 127.0.0.1:P1,... --modes invalid-payload,hash-mismatch

It never trains. In each round it is assigned a batch it publishes the next group of payload
attacks of `--modes` (groups separated by commas, attacks within a group by `+`, all for the
same batch):

* `invalid-payload`: a payload that hashes to its commitment but is no DisTrO result of the
  model (wrong shapes) — honest clients witness it (upstream checks only the hash) and skip it
  when applying;
* `hash-mismatch`: a payload whose hash is not the commitment;
* `wrong-step`: a payload for another step, hashed honestly;
* `garbage-blob`: random bytes instead of a payload;
* `oversized-blob`: a ticket announcing a blob larger than any client downloads;
* `junk-result`: `--junk-mib` MiB of random bytes (512 by default: issue 24, item 4), held and
  offered as the result (one junk blob, made once, offered every time);

and, every round, message attacks: a result for a batch assigned to someone else, its previous
round's broadcast replayed, a commitment signed with another key, gossip whose signature is
broken or that claims another sender, oversized and undecodable gossip. Once, after joining: raw
hostile frames to the coordinator, the data server and every peer's blob port (oversized,
truncated, garbage) and a Join for another run.

When elected witness it vouches for every result it heard of, its own lies included.

Each attack is printed as a JSON line (`{"message": "attack", "mode": ..., "step": ...}`), and
so is every request a peer makes for one of its junk blobs (`{"message": "blob_requested",
"mode": ..., "blob": ...}`: the re-downloads item 4 measured). When the coordinator drops it, it
reconnects to come back the next epoch with the next mode.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import struct
import sys
import time
from typing import Any

import trio


def emit(message: str, **fields: Any) -> None:
    print(json.dumps({"ts": time.time(), "message": message, **fields}), flush=True)


def _nonce() -> int:
    return int.from_bytes(os.urandom(4), "little")


PAYLOAD_MODES = (
    "invalid-payload",
    "hash-mismatch",
    "wrong-step",
    "garbage-blob",
    "oversized-blob",
    "junk-result",
)
BLOB_MODES = ("garbage-blob", "oversized-blob", "junk-result")
MIB = 1 << 20


def _bogus_payload(step: int, batch_id: Any) -> Any:
    import torch

    from psyche.modeling.serialized_distro import (
        SerializedDistroResult,
        TransmittableDistroResult,
        serializable_tensor_from_torch,
    )

    result = SerializedDistroResult(
        sparse_idx=serializable_tensor_from_torch(torch.arange(4, dtype=torch.int64)),
        sparse_val=serializable_tensor_from_torch(torch.ones(4)),
        xshape=[2, 2],
        totalk=4,
    )
    return TransmittableDistroResult(step, 0, batch_id, [result])


class Adversary:
    def __init__(self, args: argparse.Namespace) -> None:
        from psyche.core.identity import SecretKey
        from psyche.core.node_identity import NodeIdentity

        self.args = args
        self.key = SecretKey.from_bytes(args.key_number.to_bytes(32, "big"))
        self.identity = NodeIdentity.from_single_key(self.key.public_key)
        self.modes = [m for m in args.modes.split(",") if m]
        self.mode_index = 0
        self.last_step = -1
        self.previous_broadcast: Any = None
        self.warmup_sent = False
        self.network: Any = None
        self.seen: dict[int, list[tuple[bytes, bytes]]] = {}
        """Per step: (sender p2p key, commitment hash) of every training result gossiped."""
        self.nursery: Any = None
        self.raw_done = False
        self.junk: tuple[bytes, bytes, bytes] | None = None
        """The `junk-result` blob: (bytes, BLAKE3 digest, SHA-256 commitment), made once."""
        self.blob_modes: dict[bytes, str] = {}
        """Digest of every junk blob offered -> its mode (to report requests for it)."""

    # ---- the run ---------------------------------------------------------------------------

    async def run(self) -> None:
        from psyche.client.round.broadcast import open_network
        from psyche.network.connection import NetworkConfig

        config = NetworkConfig(run_id=self.args.run_id, secret_key=self.key, bind_host="127.0.0.1")
        async with (
            open_network(config) as network,
            trio.open_nursery() as nursery,
        ):
            self.network = network
            self.nursery = nursery
            # Our own node would refuse to send junk: drop its validator of the run's topic.
            network.gossip.pubsub.remove_topic_validator(network.gossip.topic)
            self.count_requests(network.blob_server)
            nursery.start_soon(self.listen)
            while True:
                await self.membership()
                emit("reconnecting")
                await trio.sleep(1)

    async def membership(self) -> None:
        """One connection to the coordinator: join, attack until dropped, return."""
        from psyche.centralized.client import CentralizedBackend
        from psyche.network.discovery import sign_address_record

        async with CentralizedBackend.connect(
            self.args.server_addr, self.key, self.args.run_id, connect_timeout=60.0
        ) as backend:
            await backend.publish_endpoint(
                sign_address_record(self.key, self.network.endpoint_addr())
            )
            emit("joined")
            if not self.raw_done:
                self.raw_done = True
                self.nursery.start_soon(self.raw_attacks)
            was_member = False
            while True:
                state = await backend.wait_for_new_state()
                clients = state.epoch_state.clients
                member = any(c.id == self.identity for c in clients)
                self.network.set_allowed_peers(c.id.p2p_identity for c in clients)
                for record in backend.peer_endpoints():
                    self.network.address_book.add_record(record)
                if member:
                    was_member = True
                    self.network.add_peers(c.id.p2p_identity for c in clients)
                    try:
                        await self.on_state(state, backend)
                    except Exception as e:  # keep attacking whatever one attack provokes
                        emit("attack_error", error=repr(e))
                elif was_member:
                    emit("dropped", step=state.progress.step, epoch=state.progress.epoch)
                    self.warmup_sent = False
                    return

    async def on_state(self, state: Any, backend: Any) -> None:
        from psyche.coordinator import RunState

        if state.run_state is RunState.Warmup and not self.warmup_sent:
            await self.warmup(state, backend)
        elif state.run_state is RunState.RoundTrain and state.progress.step != self.last_step:
            self.last_step = state.progress.step
            await self.round(state, backend)

    async def warmup(self, state: Any, backend: Any) -> None:
        """Behave during warmup, so the run starts with this member in it."""
        from psyche.client.round.witness import SendFinished, finished_broadcast, merkle_root
        from psyche.coordinator import Witness, WitnessProof
        from psyche.coordinator.backend import OpportunisticData
        from psyche.coordinator.committee_selection import CommitteeProof
        from psyche.core.bloom import WitnessBloom

        self.warmup_sent = True
        action = SendFinished(0, merkle_root([]), CommitteeProof(), warmup=True)
        signature = self.key.sign(action.commitment_data_hash)
        # a fresh nonce: the same bytes as last epoch's would be dropped as a gossip duplicate
        self.network.broadcast(finished_broadcast(action, signature, _nonce()))
        index = next(i for i, c in enumerate(state.epoch_state.clients) if c.id == self.identity)
        proof = WitnessProof(position=index, index=index, witness=False)
        merkle = merkle_root([])
        await backend.send_witness(
            OpportunisticData.WarmupStep(Witness(proof, WitnessBloom(), WitnessBloom(), merkle))
        )

    async def round(self, state: Any, backend: Any) -> None:
        from psyche.client.round.train import start_round
        from psyche.coordinator.committee_selection import Committee

        clients = state.epoch_state.clients
        index = next(i for i, c in enumerate(clients) if c.id == self.identity)
        plan = start_round(state, self.identity, index)
        info = plan.state.committee_info
        step = state.progress.step
        if info is None or info.committee_proof.committee is not Committee.Trainer:
            return
        proof = info.committee_proof
        self.replay_attack(step)  # before this round's payload takes its place
        if plan.assigned_batches and self.modes:
            group = self.modes[self.mode_index % len(self.modes)]
            self.mode_index += 1
            for mode in group.split("+"):
                await self.payload_attack(mode, step, proof, plan.assigned_batches[0])
        others = [b for b, who in plan.state.data_assignments.items() if who != self.identity]
        if others:
            await self.unassigned_attack(step, proof, others[0])
        self.forged_attacks(step, proof)
        self.finish(step, proof)
        if info.witness_proof.witness:
            self.nursery.start_soon(self.witness, backend, step, info.witness_proof)

    async def listen(self) -> None:
        """Remember the run's training results, to witness like an honest witness would."""
        from psyche.client.round.broadcast import BroadcastType
        from psyche.network.events import MessageReceived

        while True:
            event = await self.network.next_event()
            if isinstance(event, MessageReceived) and isinstance(
                event.message.data, BroadcastType.TrainingResult
            ):
                step = event.message.step
                self.seen.setdefault(step, []).append(
                    (event.from_, event.message.commitment.data_hash)
                )

    def finish(self, step: int, proof: Any) -> None:
        """Say we finished the round at once, so the round does not wait for us."""
        from psyche.client.round.witness import SendFinished, finished_broadcast, merkle_root

        hashes = [h for _, h in self.seen.get(step - 1, [])]
        action = SendFinished(step, merkle_root(hashes), proof, warmup=False)
        signature = self.key.sign(action.commitment_data_hash)
        self.network.broadcast(finished_broadcast(action, signature, _nonce()))

    async def witness(self, backend: Any, step: int, witness_proof: Any) -> None:
        """A hostile witness: it vouches for every result it heard of, its own lies included."""
        from psyche.client.round.witness import merkle_root
        from psyche.coordinator import BLOOM_FALSE_RATE, Witness, WitnessMetadata
        from psyche.coordinator.backend import OpportunisticData
        from psyche.core.bloom import WitnessBloom
        from psyche.core.sha256 import sha256

        await trio.sleep(1.0)
        heard = self.seen.get(step - 1, [])
        participants = WitnessBloom.random(8, BLOOM_FALSE_RATE)
        broadcasts = WitnessBloom.random(8, BLOOM_FALSE_RATE)
        for sender, digest in heard:
            participants.add(sha256(sender))
            broadcasts.add(digest)
        merkle = merkle_root([h for _, h in heard])
        witness = Witness(witness_proof, participants, broadcasts, merkle)
        await backend.send_witness(
            OpportunisticData.WitnessStep((witness, WitnessMetadata(step=step)))
        )
        emit("attack", mode="vouching-witness", step=step, vouched=len(heard))

    # ---- payload attacks -------------------------------------------------------------------

    def count_requests(self, server: Any) -> None:
        """Report every request a peer makes for one of the junk blobs (the blob provider looks
        each requested digest up once)."""
        lookup = server.lookup

        def counting(digest: bytes) -> Any:
            mode = self.blob_modes.get(digest)
            if mode is not None:
                emit("blob_requested", mode=mode, blob=digest.hex()[:16])
            return lookup(digest)

        server.lookup = counting

    def junk_blob(self) -> tuple[bytes, bytes, bytes]:
        from psyche.network.ticket import blob_hash

        if self.junk is None:
            data = os.urandom(self.args.junk_mib * MIB)
            self.junk = (data, blob_hash(data), hashlib.sha256(data).digest())
        return self.junk

    async def payload_attack(self, mode: str, step: int, proof: Any, batch_id: Any) -> None:
        from psyche.client.round.broadcast import BroadcastType, TrainingResult
        from psyche.network.ticket import BlobFormat, BlobTicket, blob_hash

        network = self.network
        # A tag of its own per blob: one tag naming a later blob would leave this one untagged,
        # and the store's GC (every 10 s) would drop it before every peer asked for it.
        tag = f"distro-result_{step}_{mode}"
        if mode in BLOB_MODES:
            if mode == "junk-result":
                data, digest, commitment_hash = self.junk_blob()
            else:
                data = os.urandom(4096)
                digest, commitment_hash = blob_hash(data), hashlib.sha256(data).digest()
            network.store.put(digest, data, tag)
            self.blob_modes[digest] = mode
            size = (1 << 40) if mode == "oversized-blob" else len(data)
            ticket = BlobTicket(network.endpoint_addr(), BlobFormat.Raw, digest, size)
        else:
            payload = _bogus_payload(step - 1 if mode == "wrong-step" else step, batch_id)
            ticket, _ = await network.add_downloadable(payload, tag)
            commitment_hash = payload.compute_hash()
            if mode == "hash-mismatch":
                commitment_hash = hashlib.sha256(b"not the payload" + commitment_hash).digest()
        broadcast = self._broadcast(
            step,
            proof,
            commitment_hash,
            BroadcastType.TrainingResult(TrainingResult(batch_id, ticket)),
        )
        network.broadcast(broadcast)
        self.seen.setdefault(step, []).append((self.key.public_key, commitment_hash))
        self.previous_broadcast = broadcast
        emit("attack", mode=mode, step=step, batch=str(batch_id), size=ticket.size)

    def _broadcast(
        self, step: int, proof: Any, data_hash: bytes, data: Any, key: Any = None
    ) -> Any:
        from psyche.client.round.broadcast import Broadcast, Commitment

        signer = key or self.key
        return Broadcast(
            step=step,
            proof=proof,
            commitment=Commitment(data_hash, signer.sign(data_hash)),
            nonce=_nonce(),
            data=data,
        )

    async def unassigned_attack(self, step: int, proof: Any, batch_id: Any) -> None:
        from psyche.client.round.broadcast import BroadcastType, TrainingResult

        payload = _bogus_payload(step, batch_id)
        ticket, _ = await self.network.add_downloadable(payload, f"distro-result_{step}_unassigned")
        self.network.broadcast(
            self._broadcast(
                step, proof, payload.compute_hash(),
                BroadcastType.TrainingResult(TrainingResult(batch_id, ticket)),
            )
        )  # fmt: skip
        emit("attack", mode="unassigned", step=step, batch=str(batch_id))

    def replay_attack(self, step: int) -> None:
        from dataclasses import replace

        old = self.previous_broadcast
        if old is None or old.step == step:
            return
        self.network.broadcast(replace(old, nonce=(old.nonce + 1) & 0xFFFFFFFF))
        emit("attack", mode="replay", step=step, replayed_step=old.step)

    def forged_attacks(self, step: int, proof: Any) -> None:
        from psyche.client.round.witness import SendFinished, finished_broadcast, merkle_root
        from psyche.core.identity import SecretKey
        from psyche.core.signed_message import SignedMessage

        gossip = self.network.gossip
        action = SendFinished(step, merkle_root([]), proof, warmup=False)
        # a commitment signed with another key
        stranger = SecretKey.generate()
        forged = finished_broadcast(action, stranger.sign(action.commitment_data_hash), 7)
        self.network.broadcast(forged)
        # gossip whose envelope signature is broken, or that claims another sender
        honest = finished_broadcast(action, self.key.sign(action.commitment_data_hash), 8)
        data = bytearray(gossip.encode(honest))
        data[-1] ^= 0xFF
        other = SignedMessage.sign_and_encode(stranger, honest, gossip._message_type)
        claimed = bytearray(other)
        claimed[:32] = self.key.public_key  # claims to be us, signed by someone else
        for raw in (bytes(data), bytes(claimed), os.urandom(200), b"\x00" * 20_000):
            self.network._spawn(self.network._publish, raw)
        emit("attack", mode="forged", step=step)

    # ---- raw hostile connections ------------------------------------------------------------

    async def raw_attacks(self) -> None:
        targets = [("coordinator", self.args.server_addr)]
        if self.args.data_addr:
            targets.append(("data", self.args.data_addr))
        targets += [("blob", addr) for addr in self.args.peers.split(",") if addr]
        frames = [
            b"\xff\xff\xff\xff",  # a frame of 4 GiB announced
            struct.pack(">I", 1 << 20) + b"\x01" * 100,  # truncated
            struct.pack(">I", 64) + os.urandom(64),  # garbage of a legal size
            os.urandom(1000),
            b"",
        ]
        for kind, addr in targets:
            host, _, port = addr.rpartition(":")
            for frame in frames:
                with contextlib.suppress(OSError, trio.TooSlowError, trio.BrokenResourceError):
                    with trio.fail_after(3):
                        stream = await trio.open_tcp_stream(host, int(port))
                        try:
                            await stream.send_all(frame)
                            with trio.move_on_after(0.3):
                                await stream.receive_some(4096)
                        finally:
                            await stream.aclose()
            emit("attack", mode="raw-frames", target=kind, addr=addr)
        await self.wrong_run_join()

    async def wrong_run_join(self) -> None:
        from psyche.centralized.client import CentralizedBackend
        from psyche.core.identity import SecretKey

        stranger = SecretKey.generate()  # a member of another run
        with contextlib.suppress(Exception), trio.move_on_after(5):
            async with CentralizedBackend.connect(
                self.args.server_addr, stranger, "another-run", connect_timeout=5.0
            ):
                await trio.sleep(0.5)
        emit("attack", mode="other-run-join")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-addr", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--key-number", type=int, default=66)
    parser.add_argument("--modes", default=",".join(PAYLOAD_MODES))
    parser.add_argument("--data-addr", default="")
    parser.add_argument("--peers", default="", help="blob host:port of peers to send raw junk to")
    parser.add_argument(
        "--junk-mib", type=int, default=512, help="size of the junk-result blob, in MiB"
    )
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        trio.run(Adversary(args).run)
    except (KeyboardInterrupt, BaseExceptionGroup) as e:  # stopped with Ctrl+C / SIGINT
        if isinstance(e, BaseExceptionGroup) and not e.subgroup(KeyboardInterrupt):
            raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
