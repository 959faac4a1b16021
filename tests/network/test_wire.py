"""Wire formats, identities and the small pure helpers of psyche.network."""

from __future__ import annotations

import hashlib

import pytest

from psyche.client.round.broadcast import (
    Broadcast,
    BroadcastType,
    Commitment,
    Committee,
    CommitteeProof,
    Finished,
    Rebroadcaster,
    TrainingResult,
    verify_commitment,
)
from psyche.core.batch_id import BatchId
from psyche.core.identity import SecretKey
from psyche.core.merkle_tree import MerkleRoot
from psyche.core.serde import PostcardError, from_bytes, to_bytes
from psyche.core.signed_message import SignedMessage, SignedMessageError, raw_p2p_verify
from psyche.network.gossip import gossip_topic
from psyche.network.identity import (
    IdentityError,
    libp2p_key_pair,
    peer_id_from_public_key,
    public_key_from_peer_id,
)
from psyche.network.stats import fmt_bytes
from psyche.network.ticket import BlobFormat, BlobTicket, EndpointAddr, TransportAddr, blob_hash
from psyche.network.transmittable import (
    DownloadType,
    ModelRequestType,
    SharableModelError,
    TicketResult,
    TransmittableModelConfig,
    download_codec,
)

# RFC 8032, section 7.1, test 1.
RFC_SECRET = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
RFC_PUBLIC = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
RFC_SIGNATURE_OF_EMPTY = bytes.fromhex(
    "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e06522490155"
    "5fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"
)


def ticket(seed: int = 1, size: int = 10) -> BlobTicket:
    key = SecretKey.from_bytes(bytes([seed]) * 32)
    addr = EndpointAddr(
        key.public_key,
        [TransportAddr.Libp2p("/ip4/127.0.0.1/tcp/4001"), TransportAddr.BlobTcp("127.0.0.1:4002")],
    )
    return BlobTicket(addr, BlobFormat.Raw, blob_hash(bytes([seed])), size)


def test_identity_matches_rfc8032_and_libp2p() -> None:
    key = SecretKey.from_bytes(RFC_SECRET)
    assert key.public_key == RFC_PUBLIC
    assert key.sign(b"") == RFC_SIGNATURE_OF_EMPTY
    pair = libp2p_key_pair(key)
    assert pair.public_key.to_bytes() == RFC_PUBLIC
    assert pair.private_key.sign(b"psyche") == key.sign(b"psyche")


def test_peer_id_round_trip_matches_libp2p() -> None:
    from libp2p.peer.id import ID

    key = SecretKey.from_bytes(RFC_SECRET)
    peer_id = peer_id_from_public_key(key.public_key)
    assert peer_id == ID.from_pubkey(libp2p_key_pair(key).public_key)
    assert peer_id.to_bytes() == bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20]) + RFC_PUBLIC
    assert public_key_from_peer_id(peer_id) == RFC_PUBLIC
    with pytest.raises(IdentityError):
        public_key_from_peer_id(b"\x12\x20" + bytes(32))  # a sha256 multihash, not a key


def test_key_file_is_32_raw_bytes(tmp_path) -> None:
    path = tmp_path / "secret.key"
    key = SecretKey.generate()
    key.write_file(path)
    assert path.read_bytes() == key.to_bytes()
    assert len(path.read_bytes()) == 32
    assert SecretKey.read_file(path).public_key == key.public_key
    path.write_bytes(b"\x01" * 31)
    with pytest.raises(ValueError, match="32"):
        SecretKey.read_file(path)


def test_signed_message_layout_and_verification() -> None:
    key = SecretKey.from_bytes(RFC_SECRET)
    raw = SignedMessage.sign_and_encode(key, ModelRequestType.Parameter("w"), ModelRequestType)
    data = bytes([1, 1]) + b"w"
    # from (32 raw bytes) | data (varint length + bytes) | signature (64 raw bytes)
    assert raw == RFC_PUBLIC + bytes([len(data)]) + data + key.sign(data)
    sender, message = SignedMessage.verify_and_decode(raw, ModelRequestType)
    assert sender == RFC_PUBLIC
    assert message == ModelRequestType.Parameter("w")

    forged = bytearray(raw)
    forged[33] ^= 1  # flip a bit of the signed payload
    with pytest.raises(SignedMessageError, match="signature"):
        SignedMessage.verify_and_decode(bytes(forged), ModelRequestType)
    impostor = SecretKey.generate()
    other = SignedMessage(RFC_PUBLIC, data, impostor.sign(data))
    with pytest.raises(SignedMessageError, match="signature"):
        SignedMessage.verify_and_decode(to_bytes(other), ModelRequestType)
    with pytest.raises(SignedMessageError, match="malformed"):
        SignedMessage.verify_and_decode(raw[:-1], ModelRequestType)
    garbage = SignedMessage.sign_and_encode(key, b"\xff\xff", bytes)
    with pytest.raises(SignedMessageError, match="decode"):
        SignedMessage.verify_and_decode(garbage, ModelRequestType)
    assert raw_p2p_verify(RFC_PUBLIC, b"", RFC_SIGNATURE_OF_EMPTY)
    assert not raw_p2p_verify(bytes(32), b"", RFC_SIGNATURE_OF_EMPTY)
    assert not raw_p2p_verify(RFC_PUBLIC, b"x", RFC_SIGNATURE_OF_EMPTY)


def test_gossip_topic_is_sha256_of_prefix_and_run_id() -> None:
    assert gossip_topic("run") == hashlib.sha256(b"psyche gossiprun").digest()
    assert gossip_topic("run") != gossip_topic("run2")


def test_broadcast_round_trip_and_commitment_encoding() -> None:
    key = SecretKey.generate()
    data_hash = bytes(range(32))
    commitment = Commitment(data_hash, key.sign(data_hash))
    encoded = to_bytes(commitment, Commitment)
    assert encoded == bytes([96]) + data_hash + commitment.signature
    assert verify_commitment(commitment, key.public_key)
    assert not verify_commitment(commitment, SecretKey.generate().public_key)
    with pytest.raises(PostcardError, match="Invalid length for Commitment"):
        from_bytes(bytes([95]) + bytes(95), Commitment)

    broadcast = Broadcast(
        step=7,
        proof=CommitteeProof(Committee.Trainer, 3, 4),
        commitment=commitment,
        nonce=0xFFFFFFFF,
        data=BroadcastType.TrainingResult(TrainingResult(BatchId(10, 19), ticket())),
    )
    raw = to_bytes(broadcast, Broadcast)
    assert from_bytes(raw, Broadcast) == broadcast
    assert raw[:4] == bytes([7, 2, 3, 4])  # step, committee index, position, index
    finished = Broadcast(
        1, CommitteeProof(), commitment, 0, BroadcastType.Finished(Finished(MerkleRoot(), True))
    )
    assert from_bytes(to_bytes(finished, Broadcast), Broadcast) == finished
    assert finished.data.kind() == "finished"
    assert broadcast.data.kind() == "training_result"
    assert len(SignedMessage.sign_and_encode(key, broadcast, Broadcast)) < 4096


def test_rebroadcaster_bumps_nonce_round_robin_and_wraps() -> None:
    commitment = Commitment(bytes(32), bytes(64))

    def finished(step: int, nonce: int) -> Broadcast:
        data = BroadcastType.Finished(Finished(MerkleRoot(), False))
        return Broadcast(step, CommitteeProof(), commitment, nonce, data)

    rebroadcaster = Rebroadcaster()
    assert rebroadcaster.next_to_send() is None
    rebroadcaster.add(finished(1, 5))
    rebroadcaster.add(finished(2, 0xFFFFFFFF))
    first = rebroadcaster.next_to_send()  # upstream advances the index before sending
    assert first is not None
    assert (first.step, first.nonce) == (2, 0)
    second = rebroadcaster.next_to_send()
    assert second is not None
    assert (second.step, second.nonce) == (1, 6)
    assert to_bytes(second, Broadcast) != to_bytes(finished(1, 5), Broadcast)
    rebroadcaster.retain_from_step(2)
    assert [b.step for b in rebroadcaster.broadcasts] == [2]


def test_model_sharing_wire_layouts() -> None:
    assert to_bytes(ModelRequestType.Config(), ModelRequestType) == b"\x00"
    assert to_bytes(ModelRequestType.Parameter("ab"), ModelRequestType) == b"\x01\x02ab"
    err = TicketResult.Err(SharableModelError.ParametersNotInitialized())
    assert to_bytes(err, TicketResult) == b"\x01\x05"
    unknown = TicketResult.Err(SharableModelError.ParameterUnknown("x"))
    assert to_bytes(unknown, TicketResult) == b"\x01\x02\x01x"
    ok = TicketResult.Ok(ticket())
    assert from_bytes(to_bytes(ok, TicketResult), TicketResult) == ok
    config = TransmittableModelConfig("{}", "{}", ["a", "b"])
    assert download_codec(bytes).encode(config)[0] == 2
    assert len(SharableModelError.variants) == 16
    assert DownloadType.DistroResult([]).kind() == "distro_result"
    assert DownloadType.ModelSharing(ModelRequestType.Config()).kind() == "model_sharing"


def test_model_sharing_batch_wire_layouts_and_bounds() -> None:
    from psyche.network import model_sharing

    assert model_sharing.encode_batch_request(["ab", "c"]) == b"\x02\x02ab\x01c"
    assert model_sharing.decode_batch_request(b"\x02\x02ab\x01c") == ["ab", "c"]
    too_many = ["x"] * (model_sharing.MAX_BATCH_NAMES + 1)
    with pytest.raises(ValueError, match="names in one batch; at most"):
        model_sharing.encode_batch_request(too_many)
    with pytest.raises(PostcardError):
        model_sharing.decode_batch_request(to_bytes(too_many, list[str]))
    err = TicketResult.Err(SharableModelError.ParametersNotInitialized())
    results = [TicketResult.Ok(ticket()), err]
    encoded = model_sharing.encode_batch_response(results, 300)
    assert encoded[:4] == b"\x01\xac\x02\x02"  # Some(300) as a varint, then 2 results
    assert encoded.endswith(b"\x01\x05")
    decoded = model_sharing.decode_batch_response(encoded, 2)
    assert decoded == results
    assert model_sharing.results_version(decoded) == 300
    unversioned = model_sharing.encode_batch_response(results, None)
    assert unversioned[:2] == b"\x00\x02"
    assert (
        model_sharing.results_version(model_sharing.decode_batch_response(unversioned, 2)) is None
    )
    with pytest.raises(PostcardError, match="2 results for 3 names"):
        model_sharing.decode_batch_response(encoded, 3)


def test_ticket_round_trip_and_hash() -> None:
    t = ticket(3, size=1234)
    assert from_bytes(to_bytes(t, BlobTicket), BlobTicket) == t
    assert t.addr.libp2p_addrs() == ["/ip4/127.0.0.1/tcp/4001"]
    assert t.addr.blob_addrs() == ["127.0.0.1:4002"]
    assert blob_hash(b"") == bytes.fromhex(
        "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    )


def test_fmt_bytes_matches_upstream() -> None:
    assert fmt_bytes(0) == "0 B"
    assert fmt_bytes(1023) == "1023 B"
    assert fmt_bytes(1024) == "1.00 KB"
    assert fmt_bytes(1536) == "1.50 KB"
    assert fmt_bytes(5 * 1024**2) == "5.00 MB"
    assert fmt_bytes(3 * 1024**5) == "3.00 PB"
    assert fmt_bytes(2048 * 1024**5) == "2048.00 PB"
