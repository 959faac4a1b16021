"""Signed broadcasts over py-libp2p GossipSub, configured so nothing is silently dropped or delayed.

py-libp2p 0.8.1 defaults that break Psyche (measured, see the spec §4.4) and what is set instead:
* heartbeat every 120 s (the mesh forms on heartbeats): 1 s;
* a 10 messages/s per-peer rate limit that drops the excess: off (the allowlist and the signed
  envelope already bound who may publish);
* adaptive gossip, which can stretch the heartbeat to 30-60 s: off; IP-diversity ("eclipse")
  protection, meaningless when every peer shares one IP in tests: off;
* own messages sent to the mesh only: to every subscribed peer (`_PsycheGossipSub`), and a
  peer's subscriptions forgotten when only our stream to it failed: kept (`_PsychePubsub`);
* a 32-message subscription queue that drops on overflow: bypassed, every validated message is
  handed to an unbounded channel, so there is no `Lagged` case;
* message ids from sender+seqno: replaced by the BLAKE3 of the content, as iroh-gossip does, so
  the same bytes relayed by different peers are delivered once;
* one write per queued RPC and one task per received copy: what is queued for a peer goes out
  as one RPC (`coalesce`), and a copy already seen is dropped where it is read (cost per peer,
  measured in docs/benchmarks.md's swarm section).

**Mirrored copies** (`GOSSIP_MIRROR_PROTOCOL`, a port addition): when its gossip stream to a peer
runs on a hole-punched connection (py-libp2p re-opens it on the direct connection whenever it
fails), a node also sends its *own* messages, as they are, on the relayed connection it keeps
beside it (`NetworkConnection._mirror_targets`). A punched path can die without a word; TCP
then swallows what gossip writes until the death is noticed (seconds: pings, a stalled fetch),
and the message is lost with the connection. iroh's connections carry their relay path inside the same QUIC
connection and retransmit over it; libp2p's TCP connections are bound to one path, so the copy
on the relay is this port's equivalent. A copy passes the same checks as a gossiped message, its
sender must be its signer, and each content is delivered once whichever copy comes first.

Validation order for every message, before anything else touches it: size (≤ 4096 bytes),
forwarder in the allowlist, signature (upstream `SignedMessage`), then the signer must be in the
allowlist and be the message's libp2p origin, and the payload must decode.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import random
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import blake3
import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer import peerstore
from libp2p.peer.id import ID
from libp2p.pubsub import gossipsub as gossipsub_module
from libp2p.pubsub import pubsub as pubsub_module
from libp2p.pubsub import utils as pubsub_utils
from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.mcache import CacheEntry, MessageCache
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub, ValidationCache, ValidationResult
from libp2p.pubsub.rpc_queue import OutBoundQueueSize, RpcQueue
from libp2p.pubsub.utils import safe_bytes_from_hex

from psyche.core.drop_log import DropLog
from psyche.core.identity import SecretKey
from psyche.core.signed_message import SignedMessage, SignedMessageError
from psyche.network.identity import fmt_short, peer_id_from_public_key
from psyche.network.p2p_host import is_relayed, peer_key

logger = logging.getLogger(__name__)

GOSSIP_TOPIC_PREFIX = b"psyche gossip"
MAX_MESSAGE_SIZE = 4096
GOSSIP_MIRROR_PROTOCOL = "/psyche/gossip-mirror/0"
"""One stream per copy: the sender writes one signed message and half-closes."""
REOPEN_WAIT_SECS = 10.0
"""How long a message whose write failed waits for gossip's stream to the peer to re-open."""
DELIVERED_IDS_KEPT = 4096
"""Content ids remembered to deliver a message once when both its gossiped and its mirrored copy
arrive (they come seconds apart; a later duplicate is harmless, as a rebroadcast is)."""


MAX_NUM_BOOTSTRAP_PEERS = 3
CHECK_CONNECTION_INTERVAL_SECS = 10.0
MIN_CONNECTION_ATTEMPT_GAP_SECS = 6.0


SENDER_RECORD_REUSE_SECS = 10.0
"""How long a host's own signed peer record is reused for the RPCs it sends, and how long a
peer's record, once checked, is taken as checked when the same bytes come again."""


class _SenderRecords:
    """py-libp2p 0.8.1 puts the host's signed peer record (an `Envelope`) in every pubsub RPC it
    sends and checks the one in every RPC it receives (a control RPC twice): building it reads
    the host's addresses anew (multiaddr parsing and printing), checking it is an Ed25519
    verification and a peerstore update. Measured (CPU-time profile of 8 nodes in a 16-node
    swarm round), the two were about 9 % of the process, for a record that changes only when
    the host's addresses do. Here the own record is built at most once per
    `SENDER_RECORD_REUSE_SECS`, and a peer's record whose bytes equal the last one checked and
    accepted from that peer in that time is accepted without checking it again. The RPCs on the
    wire are as before (the same field, the same bytes), and a new or changed record is
    checked as before.

    Installed once per process over the names py-libp2p's pubsub modules call
    (`install`); per host through weak references, so a closed host leaves nothing behind."""

    def __init__(self) -> None:
        self._own: weakref.WeakKeyDictionary[Any, tuple[float, tuple[bytes, bool]]] = (
            weakref.WeakKeyDictionary()
        )
        self._checked: weakref.WeakKeyDictionary[Any, dict[ID, tuple[float, bytes]]] = (
            weakref.WeakKeyDictionary()
        )
        self.installed = False

    def own(self, host: IHost) -> tuple[bytes, bool]:
        now = time.monotonic()
        cached = self._own.get(host)
        if cached is not None and now < cached[0]:
            return cached[1]
        record = peerstore.env_to_send_in_RPC(host)
        self._own[host] = (now + SENDER_RECORD_REUSE_SECS, record)
        return record

    def consume(self, msg: rpc_pb2.RPC, host: IHost, peer_id: ID) -> bool:
        if not msg.HasField("senderRecord"):
            return True
        now = time.monotonic()
        checked = self._checked.setdefault(host, {})
        last = checked.get(peer_id)
        if last is not None and now < last[0] and last[1] == msg.senderRecord:
            return True
        accepted = pubsub_utils.maybe_consume_signed_record(msg, host, peer_id)
        if accepted:
            if len(checked) >= DELIVERED_IDS_KEPT:
                checked.clear()
            checked[peer_id] = (now + SENDER_RECORD_REUSE_SECS, msg.senderRecord)
        return accepted

    def install(self) -> None:
        if self.installed:
            return
        gossipsub_module.env_to_send_in_RPC = self.own
        gossipsub_module.maybe_consume_signed_record = self.consume
        pubsub_module.env_to_send_in_RPC = self.own
        pubsub_module.maybe_consume_signed_record = self.consume
        self.installed = True


_sender_records = _SenderRecords()


def choose_gossip_peers(
    participants: list[bytes], neighbors: list[bytes], me: bytes, rng: random.Random
) -> list[bytes]:
    """Upstream `ensure_gossip_connected`'s choice: only while we take part, top our gossip
    neighbours up to 3 with random participants we are not yet connected to (joining more
    peers can push others out of the mesh)."""
    if me not in participants:
        return []
    wanted = MAX_NUM_BOOTSTRAP_PEERS - len(neighbors)
    if wanted <= 0:
        return []
    candidates = [p for p in participants if p != me and p not in neighbors]
    rng.shuffle(candidates)
    return candidates[:wanted]


def gossip_topic(run_id: str) -> bytes:
    """Upstream `gossip_topic`: SHA-256 of "psyche gossip" followed by the run id (UTF-8)."""
    return hashlib.sha256(GOSSIP_TOPIC_PREFIX + run_id.encode("utf-8")).digest()


@dataclass(frozen=True)
class GossipConfig:
    """Explicit GossipSub settings; upstream's iroh-gossip values in comments."""

    max_message_size: int = MAX_MESSAGE_SIZE
    degree: int = 6
    degree_low: int = 4
    degree_high: int = 8  # iroh active view capacity 8
    heartbeat_interval: float = 1.0
    seen_ttl_secs: int = 120  # message_id_retention 2 min
    history_length: int = 5
    history_gossip: int = 3
    repair_window: int = 30
    """Heartbeats during which a node advertises (IHAVE) the messages it holds to *every*
    gossip peer, its mesh included, so a peer that the mesh push missed asks for them (IWANT)
    and gets them (`_PsycheGossipSub`); 0: GossipSub's own gossip only (3 heartbeats, to
    peers outside the mesh). Otherwise it must outlast the last advert
    (`advert_offsets()[-1]`: 23): a message is advertised to a peer that lacks it at those
    heartbeats, and one advertised after it left the cache draws an IWANT nothing answers."""

    def __post_init__(self) -> None:
        last_advert = advert_offsets()[-1]
        if self.repair_window < 0 or 0 < self.repair_window <= last_advert:
            raise ValueError(
                f"repair_window {self.repair_window}: 0 (no repair) or more than the last "
                f"advert's heartbeat ({last_advert}), so every advert can still be answered"
            )


class GossipRejected(ValueError):
    pass


class _NoValidationCache(ValidationCache):
    """py-libp2p 0.8.1 caches each message's validation verdict for 300 s and answers every
    later copy from the cache. The gossip's verdict depends on the allowlist, which changes
    with the run's state: a message refused while its signer was not yet admitted here (a
    client's allowlist lags the run's by a moment) stayed refused for 5 minutes, from every
    peer, by the repair's IWANT too. A valid message is never validated twice anyway (the seen
    cache drops its copies before validation), so the cache only ever answered refusals: it
    keeps nothing here, and each copy is checked as it comes."""

    def __init__(self) -> None:
        super().__init__(ttl=0, max_size=0)

    def get(self, msg_id: bytes) -> ValidationResult | None:
        return None

    def put(self, msg_id: bytes, result: ValidationResult) -> None:
        return None


_reading_from: contextvars.ContextVar[ID | None] = contextvars.ContextVar(
    "psyche_gossip_reading_from", default=None
)
"""The peer whose gossip stream the current task reads (`_PsychePubsub.continuously_read_stream`)."""


class _PsychePubsub(Pubsub):
    """`Pubsub` that hands validated messages to a callback instead of a 32-slot queue, and
    keeps a still-connected peer's subscriptions when only our stream to it failed.

    py-libp2p 0.8.1 forgets a peer's subscriptions whenever the stream *we* write to it fails
    (a reset, a muxer error, its connection closed while another stays open), then re-opens that
    stream. But subscriptions arrive on the peer's stream to us, which is still alive, and the
    peer does not announce them again: we would never again send it a message (measured: one
    reset stream, no message through in 15 s). Subscriptions are forgotten only once the peer
    has no connection left."""

    def __init__(
        self,
        *args: Any,
        deliver: Callable[[rpc_pb2.Message], None],
        holders: _Holders,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self._deliver = deliver
        self._holders = holders
        self._reopening = False
        self.validation_cache = _NoValidationCache()

    async def push_msg(self, msg_forwarder: ID, msg: rpc_pb2.Message) -> None:
        """Every copy a peer sends us, duplicates included (py-libp2p drops those before any
        check: the signature is verified once per message), tells us that peer holds it."""
        await super().push_msg(msg_forwarder, msg)
        self._holders.note_copy(_content_id(msg), msg_forwarder)

    async def continuously_read_stream(self, stream: INetStream) -> None:
        """py-libp2p's reading loop for one peer's gossip stream, with the peer noted for
        `_is_subscribed_to_msg` (the loop runs in its own task, so the context variable is
        this stream's alone)."""
        _reading_from.set(stream.muxed_conn.peer_id)
        await super().continuously_read_stream(stream)

    def _is_subscribed_to_msg(self, msg: rpc_pb2.Message) -> bool:
        """py-libp2p's reading loop asks this of every message in an RPC and, when true,
        spawns a task for it (`push_msg`), whose first real step drops a copy already seen.
        With a mesh of D peers most copies are such duplicates (83 % of them in a 16-node
        swarm round), and spawning the task was the larger part of their cost (py-libp2p's
        task manager looks up the parent task each time). A copy already seen is handled
        here instead: its forwarder is noted as holding it, as `push_msg` does, and no task is
        spawned. What is dropped is what `push_msg` dropped: the seen check is the same one,
        and a copy of a message still being validated is not yet seen, so it goes on."""
        if not super()._is_subscribed_to_msg(msg):
            return False
        forwarder = _reading_from.get()
        if forwarder is None:
            return True
        mid = _content_id(msg)  # the pubsub's message id (`_is_msg_seen`), hashed once here
        if self.seen_messages.has(mid):
            self._holders.note_copy(mid, forwarder)
            return False
        return True

    def _handle_dead_peer(self, peer_id: ID) -> None:
        self._reopening = self._peer_is_connected(peer_id)
        try:
            super()._handle_dead_peer(peer_id)
        finally:
            self._reopening = False

    def _forget_all_subscriptions(self, peer_id: ID) -> None:
        if not self._reopening:
            super()._forget_all_subscriptions(peer_id)

    async def handle_sending_messages(
        self, peer_id: ID, stream: INetStream, queue: RpcQueue
    ) -> None:
        """py-libp2p's per-peer sending loop, writing what is queued for the peer by then as
        one RPC (`coalesce`) instead of one write per RPC. Each write is a Yamux frame, a Noise
        message and a socket send here, and on the peer a frame to decrypt and dispatch and
        three to four stream reads (py-libp2p reads the varint length a byte at a time) before
        the RPC is parsed; a round's broadcasts reach a node within milliseconds of each other
        and are forwarded to each mesh peer in such bursts. Nothing waits for more: an RPC
        alone in the queue is written as soon as the loop runs, as before.

        A write that raises (a `StreamError` for a muxer or connection error, or a write after
        the stream failed: `write_msg` catches only a close or reset) ends the loop as
        py-libp2p's does: the peer's stream is taken as dead (`_handle_dead_peer`: its queue
        closed, the stream re-opened while the peer stays connected), else nothing would
        drain its queue and the peer would never get a message from us again, and the
        messages of the failed write are written again on the re-opened stream, as
        `write_msg` does for a closed one. Only the loop of the peer's current stream does
        so: one of a stream already replaced leaves its successor alone."""
        out: rpc_pb2.RPC | None = None
        try:
            while True:
                rpc = await queue.pop()
                if rpc is None:
                    return  # the queue was closed
                batch = [rpc]
                # pop() returns at once, without a checkpoint, while the queue holds an RPC
                while len(queue) and len(batch) < OutBoundQueueSize:
                    more = await queue.pop()
                    if more is None:
                        break
                    batch.append(more)
                for out in coalesce(batch):
                    if not await self.write_msg(stream, out):
                        return
                out = None
        except Exception:
            logger.debug("gossip sending loop for %s ended with an error", peer_id)
            if self.peers.get(peer_id) is stream:
                self._handle_dead_peer(peer_id)
                if out is not None and out.publish:
                    self.manager.run_task(self._write_after_reopen, peer_id, out)

    async def write_msg(self, stream: INetStream, rpc_msg: rpc_pb2.RPC) -> bool:
        """py-libp2p drops the messages whose write found the stream failed (then re-opens it);
        they are written again on the re-opened stream (control messages come again with the
        next heartbeats)."""
        written = await super().write_msg(stream, rpc_msg)
        if not written and rpc_msg.publish:
            self.manager.run_task(self._write_after_reopen, stream.muxed_conn.peer_id, rpc_msg)
        return written

    async def _write_after_reopen(self, peer_id: ID, rpc_msg: rpc_pb2.RPC) -> None:
        try:
            await self.wait_for_peer(peer_id, REOPEN_WAIT_SECS)
        except trio.TooSlowError:
            return  # the peer is gone; gossip's other paths and rebroadcasts remain
        queue = self.peer_queues.get(peer_id)
        if queue is not None:
            queue.push(rpc_msg)

    def notify_subscriptions(self, publish_message: rpc_pb2.Message) -> None:
        if ID(publish_message.from_id) == self.my_id:
            return  # iroh-gossip does not echo our own broadcasts; the client self-applies them
        if any(topic in self.topic_ids for topic in publish_message.topicIDs):
            self._deliver(publish_message)


COALESCED_RPC_BYTES = 64 << 10
"""At most this many bytes in one coalesced RPC (py-libp2p's inbound limit is 1 MiB; a gossip
message is at most `MAX_MESSAGE_SIZE`)."""


def _order_free(rpc: rpc_pb2.RPC) -> bool:
    """Whether `rpc` carries only what a peer handles the same in any order and grouping:
    messages (each validated and delivered on its own) and IHAVE / IWANT / IDONTWANT lists.
    Subscriptions, GRAFT and PRUNE change state in the order they come (a PRUNE then a GRAFT
    merged into one RPC would be handled GRAFT first: the peer handles each kind in a fixed
    order), as do extension and observation controls, so an RPC with any of those is sent as
    it is."""
    if rpc.subscriptions or rpc.HasField("testExtension"):
        return False
    if not rpc.HasField("control"):
        return True
    c = rpc.control
    return not (c.graft or c.prune or c.HasField("extensions") or c.observe or c.unobserve)


def coalesce(rpcs: list[rpc_pb2.RPC]) -> list[rpc_pb2.RPC]:
    """`rpcs`, in order, with each run of order-free RPCs (`_order_free`) merged into one
    (repeated fields concatenated, the sender record the last one's) of at most
    `COALESCED_RPC_BYTES`, and in a merge the IHAVEs of one topic made one IHAVE and the IWANTs
    one IWANT (`_merge_control`). The RPCs given are not modified (py-libp2p queues one RPC
    object for several peers): a merge builds a new one."""
    out: list[rpc_pb2.RPC] = []
    run = False  # whether out[-1] is order-free, so that the next order-free RPC may join it
    merged = False  # whether out[-1] is a merge built here (else one of the RPCs given)
    size = 0
    for rpc in rpcs:
        if not _order_free(rpc):
            out.append(rpc)
            run = False
            continue
        rpc_size = rpc.ByteSize()
        if run and size + rpc_size <= COALESCED_RPC_BYTES:
            if not merged:
                copy = rpc_pb2.RPC()
                copy.CopyFrom(out[-1])
                out[-1], merged = copy, True
            out[-1].MergeFrom(rpc)
            size += rpc_size
            continue
        out.append(rpc)
        run, merged, size = True, False, rpc_size
    given = {id(rpc) for rpc in rpcs}
    for rpc in out:
        if id(rpc) not in given:  # a merge built here
            _merge_control(rpc)
    return out


def _merge_control(rpc: rpc_pb2.RPC) -> None:
    """The IHAVEs of each topic in `rpc` as one IHAVE, and its IWANTs as one IWANT, each id
    once, in first-seen order. A peer handles each IHAVE and IWANT entry on its own, counts
    each against py-libp2p's limit of 10 per second per peer (the excess is ignored, logged as
    a warning), and answers each IHAVE with its own IWANT: a sending loop that caught up after
    a stall (several heartbeats' IHAVEs queued) had its IHAVEs past the tenth ignored and made
    the peer do per-entry work for ids repeated from one heartbeat to the next. Only shrinks
    the RPC."""
    if not rpc.HasField("control"):
        return
    control = rpc.control
    if len(control.ihave) > 1:
        by_topic: dict[str, dict[bytes, None]] = {}
        for ihave in control.ihave:
            by_topic.setdefault(ihave.topicID, {}).update(dict.fromkeys(ihave.messageIDs))
        del control.ihave[:]
        for topic, ids in by_topic.items():
            control.ihave.add(topicID=topic, messageIDs=list(ids))
    if len(control.iwant) > 1:
        wanted: dict[bytes, None] = {}
        for iwant in control.iwant:
            wanted.update(dict.fromkeys(iwant.messageIDs))
        del control.iwant[:]
        control.iwant.add(messageIDs=list(wanted))


REPAIR_ADVERTS_PER_PEER = 6
"""How many times a node advertises one message to one peer that is not known to hold it (the
repair's IHAVE); one lost IHAVE or IWANT is then not the end of it."""
REPAIR_ADVERT_MAX_GAP = 8
"""Heartbeats between two adverts of a message to a peer double from 1 up to this many: the
six adverts go out 0, 1, 3, 7, 15 and 23 heartbeats after the first (`advert_offsets`).
Measured before (swarm bench, 32 nodes in 8 processes on two cores at load 11-23), the three
adverts went out in the three heartbeats after a message came, and a node that could take
none of them then (its process stalled on the loaded cores, its gossip stream being re-opened
after a 10 s protocol timeout) never got the message: 841-991 of 992 (node, sender) pairs per
round, the misses clustered in one process's nodes. Spread out, twice the old number of IHAVEs
per message and peer spans 23 heartbeats instead of 2."""

IWANT_IDS_ANSWERED = 256
"""Distinct ids answered of one IWANT (the rest are ignored: a peer that lacks more asks on
a later heartbeat). py-libp2p answered every id named, repeats included: one IWANT naming one
cached id 2000 times (68 KB) drew 2000 copies (8 MB)."""
IWANT_ANSWERS_PER_PEER = 512
"""Messages sent to one peer in answer to its IWANTs per heartbeat, all its IWANTs together."""
IWANT_RESENDS_PER_MESSAGE = REPAIR_ADVERTS_PER_PEER
"""Times one cached message is sent to one peer in answer to IWANTs (go-libp2p caps it at 3,
`GossipSubGossipRetransmission`): one per advert the repair makes to that peer, which a peer
that refused the message (not admitting its signer yet) may each answer with an IWANT; a peer
that asks again is not served."""


def _gap_after(adverts: int) -> int:
    """Heartbeats between advert number `adverts` (1-based) and the next one."""
    return int(min(2 ** (adverts - 1), REPAIR_ADVERT_MAX_GAP))


def advert_offsets() -> list[int]:
    """Heartbeats after the first advert at which a message is advertised to a peer that is not
    known to hold it (`REPAIR_ADVERTS_PER_PEER` of them, `_gap_after` apart)."""
    offsets = [0]
    while len(offsets) < REPAIR_ADVERTS_PER_PEER:
        offsets.append(offsets[-1] + _gap_after(len(offsets)))
    return offsets


class _Holders:
    """Which gossip peers are known to hold which cached message, and when each message is next
    advertised to each peer, so that the repair advertises a message only to peers that may
    lack it, a few times each, spread over the repair window (`REPAIR_ADVERT_MAX_GAP`).

    A peer holds a message when it says so: it sent it to us (the push or a forward,
    duplicates included), advertised it to us (IHAVE), or originated it (as the validated copy
    names its origin, `note_copy`). Our own write of it to the peer is no proof: the peer may
    have refused it (a signer its allowlist did not have yet, as a client's lags the run's
    state by a moment) or lost it with its connection, and taking the write as proof left
    such a message unrepaired for good (a witness that lacked an honest member's result this
    way dropped that member). So a node advertises its own messages to each peer
    `REPAIR_ADVERTS_PER_PEER` times (peers do not forward a message back to its origin), and
    a forwarded one to the peers that did not send it back. Measured in the swarm bench before any of this (16 nodes), a node
    advertised every message of its last 10 heartbeats to every gossip peer on every
    heartbeat: the IHAVEs were a third of its data frames, and nearly every id in them was
    one the peer had sent us.
    Only messages in the cache (`cached`: validated ones) get entries, and they live as long as
    the cache holds the message (`prune`), so what peers send bounds nothing here."""

    def __init__(self, cached: Callable[[bytes], rpc_pb2.Message | None]) -> None:
        self._cached = cached
        """The validated message cached under an id (None: not cached)."""
        self._held: dict[bytes, set[ID]] = {}
        self._adverts: dict[bytes, dict[ID, tuple[int, int]]] = {}
        """Message id -> peer -> (adverts so far, the heartbeat of the next one)."""
        self.heartbeat = 0
        """Heartbeats so far (`tick`)."""

    def tick(self) -> None:
        """A heartbeat: adverts due by now may go out."""
        self.heartbeat += 1

    def note(self, mid: bytes, peer: ID) -> None:
        if self._cached(mid) is not None:
            self._held.setdefault(mid, set()).add(peer)

    def note_copy(self, mid: bytes, forwarder: ID) -> None:
        """A copy of message `mid` came from `forwarder`: it holds the message, and so does
        the message's origin, as the validated copy in the cache names it. The copy's own
        origin field is not checked on a duplicate (py-libp2p drops a seen copy before any
        check), so a member could name any peer there: taking it would mark that peer as
        holding a message it lacks, and the repair would never advertise it to it."""
        cached = self._cached(mid)
        if cached is not None:
            self.note(mid, forwarder)
            self.note(mid, ID(cached.from_id))

    def note_advertised(self, mid: bytes, peer: ID) -> None:
        per_peer = self._adverts.setdefault(mid, {})
        count = per_peer.get(peer, (0, 0))[0] + 1
        per_peer[peer] = (count, self.heartbeat + _gap_after(count))

    def worth_advertising(self, mid: bytes, peer: ID) -> bool:
        if peer in self._held.get(mid, ()):
            return False
        count, due = self._adverts.get(mid, {}).get(peer, (0, 0))
        return count < REPAIR_ADVERTS_PER_PEER and self.heartbeat >= due

    def prune(self) -> None:
        """Forget the messages the cache no longer holds."""
        for table in (self._held, self._adverts):
            for mid in [m for m in table if self._cached(m) is None]:
                del table[mid]


class _ContentMessageCache(MessageCache):
    """GossipSub's message cache keyed by the content id (`_content_id`, the pubsub's message
    id) instead of py-libp2p's hard-wired sender+seqno: the ids an IHAVE carries are then the
    ids a peer's seen cache holds, so it asks (IWANT) only for what it lacks. Keyed by
    sender+seqno, every advertised id looked unseen and every IHAVE drew an IWANT and the whole
    message back."""

    def put(self, msg: rpc_pb2.Message) -> None:
        mid = _content_id(msg)
        if mid in self.msgs:
            return
        self.msgs[mid] = msg
        self.history[0].append(CacheEntry(mid, msg.topicIDs))

    def recent(self, topic: str, heartbeats: int) -> list[bytes]:
        """The ids of the messages on `topic` cached in the last `heartbeats` heartbeats."""
        return [
            entry.mid
            for entries in self.history[:heartbeats]
            for entry in entries
            if topic in entry.topics
        ]


class _PsycheGossipSub(GossipSub):
    """GossipSub that sends a node's *own* messages to every peer it knows subscribes to the
    topic, not only to its mesh (go-libp2p's `floodPublish`, on by default there; iroh-gossip
    pushes to its whole active view). py-libp2p 0.8.1 sends only to the mesh, which is rebuilt
    on heartbeats: a peer whose stream was just re-opened, or that just connected, is in no mesh
    yet and got nothing published meanwhile (measured: a message published right after a
    re-open was lost).

    **Repair** (`GossipConfig.repair_window`): on every heartbeat a node also advertises the
    ids of the messages it received or published in the last `repair_window` heartbeats to
    every gossip peer, mesh peers included (GossipSub's own gossip goes only to peers outside
    the mesh, for `history_gossip` heartbeats: measured, with the client's three neighbours
    nearly every peer is in the mesh, so a message the push missed was never repaired and
    32-node swarms lacked broadcasts for good). A peer asks (IWANT) for the ids its seen
    cache lacks and gets them from the cache, which keeps `repair_window` heartbeats; the
    repaired message is then validated and forwarded as any other, so a miss anywhere on the
    path is repaired hop by hop. Bounds: only validated messages are cached and advertised,
    only to run members (the host admits no one else), each IHAVE and IWANT is rate limited
    per peer by py-libp2p (10/s), an IWANT is answered only from the cache, each id once, at
    most `IWANT_IDS_ANSWERED` ids an IWANT, `IWANT_ANSWERS_PER_PEER` messages a peer a
    heartbeat and `IWANT_RESENDS_PER_MESSAGE` copies of a message to a peer (`handle_iwant`);
    the cost is one IHAVE of up to a window's ids per peer per heartbeat."""

    def __init__(
        self,
        *args: Any,
        repair_window: int,
        member: Callable[[ID], bool],
        drops: DropLog,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.repair_window = repair_window
        self._member = member
        self._drops = drops
        self.mcache = _ContentMessageCache(
            self.mcache.window_size, max(self.mcache.history_size, repair_window)
        )
        self.holders = _Holders(self._cached)
        self._resent: dict[bytes, dict[ID, int]] = {}
        """Cached message id -> peer -> times sent to it in answer to IWANTs."""
        self._answered: dict[ID, int] = {}
        """Peer -> messages sent to it in answer to IWANTs this heartbeat."""

    def gossip_heartbeat(self) -> Any:
        """GossipSub's gossip and the repair's, each id advertised only to peers not known
        to hold it, at most `REPAIR_ADVERTS_PER_PEER` times (`_Holders`)."""
        peers_to_gossip = super().gossip_heartbeat()
        cache = self.mcache
        assert isinstance(cache, _ContentMessageCache)
        self._answered.clear()
        for mid in [m for m in self._resent if m not in cache.msgs]:
            del self._resent[mid]
        if self.repair_window > 0 and self.pubsub is not None:
            for topic in self.mesh:
                recent = cache.recent(topic, self.repair_window)
                if not recent:
                    continue
                for peer in self.pubsub.peer_topics.get(topic, set()):
                    if peer in self.peer_protocol:
                        peers_to_gossip[peer][topic] = recent
        self.holders.prune()
        self.holders.tick()
        for peer, topics in list(peers_to_gossip.items()):
            for topic, mids in list(topics.items()):
                wanted = [m for m in mids if self.holders.worth_advertising(m, peer)]
                for mid in wanted:
                    self.holders.note_advertised(mid, peer)
                if wanted:
                    topics[topic] = wanted
                else:
                    del topics[topic]
            if not topics:
                del peers_to_gossip[peer]
        return peers_to_gossip

    def _cached(self, mid: bytes) -> rpc_pb2.Message | None:
        return self.mcache.msgs.get(mid)

    async def publish(self, msg_forwarder: ID, pubsub_msg: rpc_pb2.Message) -> None:
        """GossipSub's publish, without its queue for peers that are no run members.

        py-libp2p 0.8.1 queues every message it sends for each connected pubsub peer whose
        subscription to the topic it has not heard (up to 100 per peer for 30 s, flushed
        when the subscription comes), for the moment between a peer connecting and its
        subscriptions arriving. A run's relay takes every member's gossip stream and
        subscribes to nothing (`relay.GossipDrain`), so every member queued every message
        for it and, past 100 in 30 s, logged a warning on every publish for the rest of the
        run. Only run members (the gossip allowlist) subscribe, so only they are queued for;
        whatever a member's queue drops is noted in the gossip's drop log
        (`_prune_pending_messages`)."""
        await super().publish(msg_forwarder, pubsub_msg)
        for peer in [p for p in self._pending_messages if not self._member(p)]:
            del self._pending_messages[peer]

    def _handle_dropped_rpc(self, peer_id: ID, rpc: rpc_pb2.RPC, reason: str) -> None:
        """py-libp2p drops an RPC when the peer's outbound queue (32 RPCs) is full, logging it at
        debug level only: a dropped message is noted in the gossip's drop log (the peer is
        not taken to hold it, so the repair advertises it to the peer)."""
        if rpc.publish:
            self._drops.note(
                f"not sent ({reason})",
                f"gossip: {len(rpc.publish)} message(s) to {peer_id} not sent: {reason}",
            )
        super()._handle_dropped_rpc(peer_id, rpc, reason)

    def _prune_pending_messages(self, peer_id: ID) -> None:
        """py-libp2p's pruning of a peer's pending queue (messages past their time-to-live go,
        then the oldest beyond the cap), the overflow noted in the drop log instead of a
        warning on every publish (a member that never subscribes made one per message)."""
        queue = self._pending_messages.get(peer_id)
        if queue is None:
            return
        now = time.time()
        queue[:] = [(ts, msg) for ts, msg in queue if now - ts <= self._pending_messages_ttl]
        excess = len(queue) - self._max_pending_messages_per_peer
        if excess > 0:
            self._drops.note(
                "queued for a peer that has not subscribed",
                f"gossip: {peer_id} has not announced its subscriptions; dropping the oldest "
                f"of the {len(queue)} messages queued for it",
            )
            del queue[:excess]
        if not queue:
            del self._pending_messages[peer_id]

    async def handle_iwant(self, iwant_msg: rpc_pb2.ControlIWant, sender_peer_id: ID) -> None:
        """GossipSub's answer (one RPC of the cached messages named, after py-libp2p's 10
        IWANTs per second per peer), bounded: each id once per IWANT, at most
        `IWANT_IDS_ANSWERED` of them, at most `IWANT_ANSWERS_PER_PEER` messages per peer per
        heartbeat and each message at most `IWANT_RESENDS_PER_MESSAGE` times to one peer.
        py-libp2p answered every id named, repeats included, so any run member could make a
        node send 118 bytes for each byte it asked with (one cached id named 2000 times)."""
        budget = IWANT_ANSWERS_PER_PEER - self._answered.get(sender_peer_id, 0)
        wanted: list[Any] = []
        named: set[bytes] = set()
        for raw in iwant_msg.messageIDs:
            if len(wanted) >= min(budget, IWANT_IDS_ANSWERED):
                break
            mid = safe_bytes_from_hex(raw)
            if mid is None or mid in named or mid not in self.mcache.msgs:
                continue
            named.add(mid)
            sent = self._resent.setdefault(mid, {})
            if sent.get(sender_peer_id, 0) >= IWANT_RESENDS_PER_MESSAGE:
                continue
            sent[sender_peer_id] = sent.get(sender_peer_id, 0) + 1
            wanted.append(raw)
        if not wanted:
            return
        self._answered[sender_peer_id] = self._answered.get(sender_peer_id, 0) + len(wanted)
        await super().handle_iwant(rpc_pb2.ControlIWant(messageIDs=wanted), sender_peer_id)

    async def handle_ihave(self, ihave_msg: rpc_pb2.ControlIHave, sender_peer_id: ID) -> None:
        for raw in ihave_msg.messageIDs:
            mid = safe_bytes_from_hex(raw)
            if mid is not None:
                self.holders.note(mid, sender_peer_id)
        await super().handle_ihave(ihave_msg, sender_peer_id)

    def _get_peers_to_send(
        self,
        topic_ids: Iterable[str],
        msg_forwarder: ID,
        origin: ID,
        msg_id: bytes | None = None,
    ) -> Iterable[ID]:
        topic_ids = list(topic_ids)
        peers = set(super()._get_peers_to_send(topic_ids, msg_forwarder, origin, msg_id))
        if self.pubsub is not None and origin == self.pubsub.my_id:
            for topic in topic_ids:
                subscribed = self.pubsub.peer_topics.get(topic, set())
                peers |= {p for p in subscribed if p in self.peer_protocol and p != origin}
        return peers


@dataclass(frozen=True)
class GossipMessage:
    sender: bytes
    message: Any


def _data_id(data: bytes) -> bytes:
    """A message's id: the BLAKE3 of its signed bytes (as iroh-gossip)."""
    return blake3.blake3(data).digest()


def _content_id(msg: rpc_pb2.Message) -> bytes:
    return _data_id(msg.data)


class Gossip:
    """One topic, one message type; `received` yields verified `GossipMessage`s."""

    def __init__(
        self,
        host: IHost,
        secret_key: SecretKey,
        topic: bytes,
        message_type: Any,
        allowed: Callable[[bytes], bool],
        config: GossipConfig,
    ) -> None:
        _sender_records.install()
        self.drops = DropLog(logger, "gossip: refused or dropped messages")
        """What peers' gossip made this node refuse or drop, by kind (run its `run`)."""
        self.topic = topic.hex()
        self._secret_key = secret_key
        self._message_type = message_type
        self._allowed = allowed
        self._config = config
        self.router = _PsycheGossipSub(
            protocols=[PROTOCOL_ID_V11, PROTOCOL_ID],
            degree=config.degree,
            degree_low=config.degree_low,
            degree_high=config.degree_high,
            # py-libp2p annotates whole seconds (int); it sleeps on the value, so a float works.
            heartbeat_interval=config.heartbeat_interval,
            gossip_window=config.history_gossip,
            gossip_history=config.history_length,
            spam_protection_enabled=False,
            eclipse_protection_enabled=False,
            adaptive_gossip_enabled=False,
            repair_window=config.repair_window,
            member=self._member,
            drops=self.drops,
        )
        self.pubsub = _PsychePubsub(
            host,
            self.router,
            deliver=self._on_delivered,
            holders=self.router.holders,
            strict_signing=True,
            seen_ttl=config.seen_ttl_secs,
            msg_id_constructor=_content_id,
        )
        self.pubsub.set_topic_validator(self.topic, self._validate, False)
        self._send, self.received = trio.open_memory_channel[GossipMessage](float("inf"))
        self._validated: OrderedDict[bytes, tuple[bytes, Any]] = OrderedDict()
        self._delivered: OrderedDict[bytes, None] = OrderedDict()
        self.rejected = 0
        self.mirrored_first = 0
        """Messages whose mirrored copy arrived before the gossiped one (or without it)."""

    # inbound ------------------------------------------------------------------------------------

    def _validate(self, forwarder: ID, msg: rpc_pb2.Message) -> bool:
        try:
            self._validated[_content_id(msg)] = self._check(forwarder, msg)
        except Exception as e:  # GossipRejected, or anything a hostile message provokes
            self.rejected += 1
            self.drops.note("rejected", f"dropping gossip message delivered from {forwarder}: {e}")
            return False
        while len(self._validated) > 1024:
            self._validated.popitem(last=False)
        return True

    def _member(self, peer: ID) -> bool:
        key = peer_key(peer)
        return key is not None and self._allowed(key)

    def _check(self, forwarder: ID, msg: rpc_pb2.Message) -> tuple[bytes, Any]:
        return self._check_signed(peer_key(forwarder), peer_key(ID(msg.from_id)), msg.data)

    def _check_signed(
        self, forwarder: bytes | None, origin: bytes | None, data: bytes
    ) -> tuple[bytes, Any]:
        if len(data) > self._config.max_message_size:
            raise GossipRejected(f"{len(data)} bytes exceed {self._config.max_message_size}")
        me = self._secret_key.public_key
        if forwarder is None or (forwarder != me and not self._allowed(forwarder)):
            raise GossipRejected("forwarder not in allowlist")
        try:
            sender, message = SignedMessage.verify_and_decode(data, self._message_type)
        except SignedMessageError as e:
            raise GossipRejected(str(e)) from e
        if sender != me and not self._allowed(sender):
            raise GossipRejected(f"signer {fmt_short(sender)} not in allowlist")
        if origin != sender:
            raise GossipRejected("signer is not the message's origin")
        return sender, message

    def _on_delivered(self, msg: rpc_pb2.Message) -> None:
        content_id = _content_id(msg)
        checked = self._validated.pop(content_id, None)
        if checked is None:  # validated long ago and evicted: check again
            try:
                checked = self._check(ID(msg.from_id), msg)
            except Exception:
                return
        self._deliver_once(content_id, *checked)

    def deliver_mirrored(self, sender: bytes, data: bytes) -> bool:
        """A mirrored copy of `sender`'s own message (module doc): checked as a gossiped one with
        `sender` as forwarder and origin; False when it was delivered already. Raises
        `GossipRejected` for a copy that fails a check."""
        try:
            checked = self._check_signed(sender, sender, data)
        except GossipRejected:
            self.rejected += 1
            raise
        delivered = self._deliver_once(_data_id(data), *checked)
        self.mirrored_first += delivered
        return delivered

    def _deliver_once(self, content_id: bytes, sender: bytes, message: Any) -> bool:
        if content_id in self._delivered:
            return False
        self._delivered[content_id] = None
        while len(self._delivered) > DELIVERED_IDS_KEPT:
            self._delivered.popitem(last=False)
        self._send.send_nowait(GossipMessage(sender, message))
        return True

    # outbound -----------------------------------------------------------------------------------

    def encode(self, message: Any) -> bytes:
        data = SignedMessage.sign_and_encode(self._secret_key, message, self._message_type)
        if len(data) > self._config.max_message_size:
            raise GossipRejected(
                f"signed message of {len(data)} bytes exceeds {self._config.max_message_size}"
            )
        return data

    async def publish_raw(self, data: bytes) -> None:
        await self.pubsub.publish(self.topic, data)

    def close(self) -> None:
        """Stop py-libp2p's seen-cache sweeper thread (the pubsub service leaves it running)."""
        self.pubsub.seen_messages.stop()

    def sends_through_relay(self, peer: bytes) -> bool:
        """Whether our gossip stream to `peer` runs on a relayed connection."""
        stream = self.pubsub.peers.get(peer_id_from_public_key(peer))
        return stream is not None and is_relayed(stream.muxed_conn)

    def neighbors(self) -> list[bytes]:
        """The peers we gossip with: our stream to them is open and they subscribe to the topic
        (upstream: iroh-gossip's active view), the mesh among them. Each gets our own messages
        (`_PsycheGossipSub` publishes to every subscribed peer) and the repair's IHAVEs, so it
        is a neighbour as soon as both hold, not a heartbeat or more later when GossipSub grafts
        it: counting the mesh only, a node whose meshes were still forming (every node, on a
        loaded machine) saw no neighbour and dialed 3 more peers every 6 s (`dialer`)."""
        subscribed = self.pubsub.peer_topics.get(self.topic, set())
        peers = {p for p in subscribed if p in self.pubsub.peers}
        return _keys(peers | self.router.mesh.get(self.topic, set()))

    def mesh(self) -> list[bytes]:
        """GossipSub's mesh on the topic (the peers others' messages are forwarded to)."""
        return _keys(self.router.mesh.get(self.topic, set()))


def _keys(peers: Iterable[ID]) -> list[bytes]:
    return [k for p in peers if (k := peer_key(p)) is not None]
