"""Fuzzing every decoder that reads bytes from a peer or from disk.

Each target is a decode function, a few valid encodings to mutate (bit flips, truncations,
splices, appended junk, huge length prefixes) besides purely random bytes, and the typed errors
it may raise. Anything else (IndexError, KeyError, TypeError, struct.error, OverflowError,
MemoryError, RecursionError...) is a crash a hostile peer could provoke, and fails the test.

`PSYCHE_FUZZ_EXAMPLES` scales the examples per target (CI: 150; `just chaos` runs 2000).
"""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("PSYCHE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 150,
    suppress_health_check=list(HealthCheck),
    database=None,
)


@dataclass(frozen=True)
class Target:
    decode: Callable[[bytes], Any]
    samples: list[bytes]
    errors: tuple[type[BaseException], ...] = (ValueError,)


# ---- valid samples ---------------------------------------------------------------------------


def _key(n: int) -> Any:
    from psyche.core.identity import SecretKey

    return SecretKey.from_bytes(n.to_bytes(32, "big"))


def _coordinator() -> Any:
    from psyche.coordinator.testing import quick_coordinator

    return quick_coordinator()


def _endpoint() -> Any:
    from psyche.network.ticket import EndpointAddr, TransportAddr

    key = _key(5)
    return EndpointAddr(
        key.public_key,
        [TransportAddr.Libp2p("/ip4/127.0.0.1/tcp/4001"), TransportAddr.BlobTcp("127.0.0.1:4002")],
    )


def _ticket() -> Any:
    from psyche.network.ticket import BlobFormat, BlobTicket

    return BlobTicket(_endpoint(), BlobFormat.Raw, bytes(range(32)), 1234)


def _broadcast(step: int = 3) -> Any:
    from psyche.client.round.broadcast import Broadcast, BroadcastType, Commitment, TrainingResult
    from psyche.coordinator.committee_selection import CommitteeProof
    from psyche.core.batch_id import BatchId

    key = _key(5)
    digest = bytes(range(32))
    return Broadcast(
        step=step,
        proof=CommitteeProof(),
        commitment=Commitment(digest, key.sign(digest)),
        nonce=7,
        data=BroadcastType.TrainingResult(TrainingResult(BatchId(0, 3), _ticket())),
    )


def _good_distro() -> tuple[Any, list[Any]]:
    import torch

    from psyche.core.batch_id import BatchId
    from psyche.modeling.distro import Distro, quantize_results
    from psyche.modeling.serialized_distro import transmittable_distro_result

    g = torch.Generator().manual_seed(0)
    params = [
        ("a.weight", torch.nn.Parameter(torch.randn(32, 48, generator=g))),
        ("b.bias", torch.nn.Parameter(torch.randn(40, generator=g))),
    ]
    distro = Distro(params, 0.999, 16, 4)
    for _, p in params:
        p.grad = torch.randn(p.shape, generator=g)
    results = quantize_results(distro.generate([], 0.0, 1e-3))
    return transmittable_distro_result(results, 3, 0, BatchId(0, 1)), distro.layouts()


# ---- targets ---------------------------------------------------------------------------------


def _targets() -> dict[str, Callable[[], Target]]:
    def centralized_to_server() -> Target:
        from psyche.centralized.protocol import (
            CLIENT_TO_SERVER_CODEC,
            ClientToServerMessage,
            ExtensionHello,
            JoinRun,
        )
        from psyche.coordinator.committee_selection import CommitteeProof
        from psyche.core.node_identity import NodeIdentity

        codec = CLIENT_TO_SERVER_CODEC
        ident = NodeIdentity.from_single_key(_key(3).public_key)
        samples = [
            codec.encode(ClientToServerMessage.Join(JoinRun("tiny-cpu"))),
            codec.encode(ClientToServerMessage.ExtensionHello(ExtensionHello())),
            codec.encode(ClientToServerMessage.AnnounceEndpoint(b"x" * 40)),
            codec.encode(ClientToServerMessage.HealthCheck([(ident, CommitteeProof())])),
        ]
        return Target(lambda b: codec.decode(memoryview(b)), samples)

    def centralized_to_client() -> Target:
        from psyche.centralized.protocol import SERVER_TO_CLIENT_CODEC, ServerToClientMessage

        codec = SERVER_TO_CLIENT_CODEC
        samples = [
            codec.encode(ServerToClientMessage.Coordinator(_coordinator())),
            codec.encode(ServerToClientMessage.PeerEndpoints([b"a" * 10, b"b" * 3])),
        ]
        return Target(lambda b: codec.decode(memoryview(b)), samples)

    def tcp_handshake() -> Target:
        from psyche.transport import (
            TcpProtocolError,
            encode_challenge_response,
            verify_challenge_response,
        )

        challenge = bytes(range(32))
        samples = [encode_challenge_response(_key(4), challenge)]
        return Target(
            lambda b: verify_challenge_response(b, challenge),
            samples,
            (ValueError, TcpProtocolError),
        )

    def coordinator_postcard() -> Target:
        from psyche.coordinator.coordinator import Coordinator
        from psyche.core.serde import from_bytes

        return Target(lambda b: from_bytes(b, Coordinator), [_coordinator().to_bytes()])

    def gossip_message() -> Target:
        from psyche.client.round.broadcast import Broadcast
        from psyche.core.signed_message import SignedMessage

        samples = [SignedMessage.sign_and_encode(_key(5), _broadcast(), Broadcast)]
        return Target(lambda b: SignedMessage.verify_and_decode(b, Broadcast), samples)

    def blob_ticket() -> Target:
        from psyche.core.serde import from_bytes, to_bytes
        from psyche.network.ticket import BlobTicket, parse_host_port

        def decode(b: bytes) -> Any:
            ticket = from_bytes(b, BlobTicket)
            for addr in ticket.addr.blob_addrs():
                parse_host_port(addr)
            return ticket

        return Target(decode, [to_bytes(_ticket(), BlobTicket)])

    def address_record() -> Target:
        from psyche.network.discovery import sign_address_record, verify_address_record

        return Target(verify_address_record, [sign_address_record(_key(5), _endpoint())])

    def model_sharing() -> Target:
        from psyche.network import model_sharing
        from psyche.network.transmittable import ModelRequestType, SharableModelError, TicketResult

        samples = [
            model_sharing.encode_request(ModelRequestType.Parameter("model.layers.0.w")),
            model_sharing.encode_request(ModelRequestType.Config()),
            model_sharing.encode_response(TicketResult.Ok(_ticket())),
            model_sharing.encode_response(
                TicketResult.Err(SharableModelError.ParameterUnknown("x"))
            ),
        ]

        def decode(b: bytes) -> Any:
            errors = []
            for fn in (model_sharing.decode_request, model_sharing.decode_response):
                try:
                    fn(b)
                except model_sharing.SharableModelFailure:
                    pass
                except ValueError as e:
                    errors.append(e)
            if len(errors) == 2:
                raise errors[0]

        return Target(decode, samples)

    def peer_exchange() -> Target:
        from psyche.network import peer_exchange

        samples = [
            peer_exchange.encode_request([bytes(32), bytes(range(32))]),
            peer_exchange.encode_response([b"r" * 100]),
        ]

        def decode(b: bytes) -> Any:
            with_errors = 0
            for fn in (peer_exchange.decode_request, peer_exchange.decode_response):
                try:
                    fn(b)
                except ValueError:
                    with_errors += 1
            if with_errors == 2:
                raise ValueError("neither")

        return Target(decode, samples)

    def blob_control() -> Target:
        from psyche.core.serde import from_bytes, to_bytes
        from psyche.network.blob_protocol import Get, Hello, Reply, ServerHello

        hello = Hello(0, bytes(32), bytes(range(32)), bytes(32))
        samples = [
            to_bytes(hello, Hello),
            to_bytes(ServerHello.Refused("no"), ServerHello),
            to_bytes(Get(bytes(64), bytes(32)), Get),
            to_bytes(Reply.Found(100), Reply),
        ]

        def decode(b: bytes) -> Any:
            failures = 0
            for tp in (Hello, ServerHello, Get, Reply):
                try:
                    from_bytes(b, tp)
                except ValueError:
                    failures += 1
            if failures == 4:
                raise ValueError("none")

        return Target(decode, samples)

    def blob_payload() -> Target:
        from psyche.modeling.serialized_distro import TransmittableDistroResult
        from psyche.network.transmittable import download_codec

        codec = download_codec(TransmittableDistroResult)
        payload, _ = _good_distro()
        return Target(codec.decode, [codec.encode(payload)])

    def distro_payload() -> Target:
        from psyche.modeling.serialized_distro import (
            decode_transmittable,
            distro_results_from_transmittable,
        )

        payload, layouts = _good_distro()

        def decode(b: bytes) -> Any:
            decoded = decode_transmittable(b)
            return distro_results_from_transmittable(decoded, layouts, require_1bit=True)

        return Target(decode, [payload.to_bytes()])

    def data_server_wire() -> Target:
        import numpy as np

        from psyche.core.batch_id import BatchId
        from psyche.data_provider import wire

        request = wire.UpstreamRequestCodec()
        reply = wire.ServerMessageCodec()
        samples = [
            request.encode(
                wire.ClientToServerMessage.RequestTrainingData(
                    wire.RequestTrainingData(data_ids=BatchId(0, 3))
                )
            ),
            wire.encode_raw_training_data(
                wire.RawTrainingData(BatchId(0, 1), np.arange(16, dtype=np.int32).reshape(2, 8))
            ),
            wire.encode_varints(np.arange(0, 70000, 999, dtype=np.int64)),
        ]

        def decode(b: bytes) -> Any:
            failures = 0
            for fn in (
                request.decode,
                reply.decode,
                lambda x: wire.decode_raw_training_data(memoryview(x)),
                wire.decode_varints,
            ):
                try:
                    fn(b)
                except ValueError:
                    failures += 1
            if failures == 4:
                raise ValueError("none")

        return Target(decode, samples)

    def solana_coordinator_account() -> Target:
        from psyche.solana.state import (
            CoordinatorAccount,
            coordinator_account_from_bytes,
            coordinator_account_to_bytes,
        )

        account = CoordinatorAccount.zeroed()
        account.version = CoordinatorAccount.VERSION
        return Target(coordinator_account_from_bytes, [coordinator_account_to_bytes(account)])

    def solana_small_accounts() -> Target:
        from psyche.solana.state import Authorization, decode_anchor_account, encode_anchor_account

        auth = Authorization(1, bytes(32), bytes(range(32)), b"scope", True, [bytes(32)], 5)
        samples = [encode_anchor_account(auth)]
        return Target(lambda b: decode_anchor_account(b, Authorization), samples)

    def events_file() -> Target:
        from psyche.centralized.events import read_events

        body = _coordinator().to_bytes()
        record = struct.pack("<qI", 1000, len(body)) + body

        def decode(b: bytes) -> Any:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "state.bin"
                path.write_bytes(b)
                return list(read_events(path))

        return Target(decode, [record, record + record[:50]])

    def saved_state() -> Target:
        from psyche.centralized.save_state import SavedStateError, load_state, save_state

        with tempfile.TemporaryDirectory() as tmp:
            text = save_state(tmp, _coordinator()).read_bytes()

        def decode(b: bytes) -> Any:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "state.toml"
                path.write_bytes(b)
                return load_state(path)

        return Target(decode, [text], (ValueError, SavedStateError, UnicodeDecodeError))

    def run_config() -> Target:
        from psyche.coordinator.run_config import ConfigFileError, load_run_config

        text = (Path(__file__).resolve().parents[2] / "configs/tiny-cpu/state.toml").read_bytes()

        def decode(b: bytes) -> Any:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "state.toml"
                path.write_bytes(b)
                return load_run_config(path)

        return Target(decode, [text], (ConfigFileError, ValueError))

    def data_config() -> Target:
        from psyche.data_provider.data_config import DataConfigError, DataServerInfo

        text = (Path(__file__).resolve().parents[2] / "configs/tiny-cpu/data.toml").read_bytes()

        def decode(b: bytes) -> Any:
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "data.toml"
                path.write_bytes(b)
                return DataServerInfo.load(path)

        return Target(decode, [text], (DataConfigError, ValueError))

    return {
        "centralized-to-server": centralized_to_server,
        "centralized-to-client": centralized_to_client,
        "tcp-handshake": tcp_handshake,
        "coordinator-postcard": coordinator_postcard,
        "gossip-message": gossip_message,
        "blob-ticket": blob_ticket,
        "address-record": address_record,
        "model-sharing": model_sharing,
        "peer-exchange": peer_exchange,
        "blob-control": blob_control,
        "blob-payload": blob_payload,
        "distro-payload": distro_payload,
        "data-server-wire": data_server_wire,
        "solana-coordinator-account": solana_coordinator_account,
        "solana-small-accounts": solana_small_accounts,
        "events-file": events_file,
        "saved-state": saved_state,
        "run-config": run_config,
        "data-config": data_config,
    }


TARGETS = _targets()
_built: dict[str, Target] = {}


def target(name: str) -> Target:
    if name not in _built:
        _built[name] = TARGETS[name]()
    return _built[name]


# ---- mutations -------------------------------------------------------------------------------


@st.composite
def hostile_bytes(draw: st.DrawFn, samples: list[bytes]) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=512))
    data = bytearray(draw(st.sampled_from(samples)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.integers(0, 6))
        pos = draw(st.integers(0, max(0, len(data))))
        if op == 0 and data:  # flip bits
            i = min(pos, len(data) - 1)
            data[i] ^= draw(st.integers(1, 255))
        elif op == 1:  # truncate
            del data[pos:]
        elif op == 2:  # append junk
            data += draw(st.binary(min_size=1, max_size=64))
        elif op == 3:  # insert junk
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == 4:  # a huge varint length / count
            data[pos:pos] = draw(st.sampled_from([b"\xff\xff\xff\xff\x0f", b"\x80" * 10, b"\xff"]))
        elif op == 5 and data:  # delete a span
            del data[pos : pos + draw(st.integers(1, 32))]
        elif op == 6:  # overwrite with extreme integers
            data[pos : pos + 8] = draw(st.sampled_from([b"\xff" * 8, b"\x00" * 8, b"\x7f" * 8]))
    return bytes(data)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_decoder_refuses_hostile_bytes_with_a_typed_error(name: str) -> None:
    t = target(name)
    for sample in t.samples:  # the samples themselves decode
        t.decode(sample)

    @FUZZ
    @given(data=hostile_bytes(t.samples))
    def run(data: bytes) -> None:
        with contextlib.suppress(*t.errors):
            t.decode(data)

    run()
