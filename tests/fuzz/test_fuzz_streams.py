"""Fuzzing the stream protocols end to end: hostile byte streams against the blob side channel
(both sides), and against a real coordinator server on loopback, which must keep serving an
honest client afterwards. `PSYCHE_FUZZ_EXAMPLES` scales the examples as in test_fuzz_decoders."""

from __future__ import annotations

import os

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psyche.core.identity import SecretKey
from psyche.network import blob_protocol
from psyche.network.blob_protocol import BlobProtocolError

EXAMPLES = int(os.environ.get("PSYCHE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 150,
    suppress_health_check=list(HealthCheck),
    database=None,
)
PROVIDER = SecretKey.from_bytes((1).to_bytes(32, "big"))
REQUESTER = SecretKey.from_bytes((2).to_bytes(32, "big"))
BLOB = b"blob bytes " * 20


class ScriptedStream:
    """A byte stream that yields `incoming` in `chunks` and records what is sent."""

    def __init__(self, incoming: bytes, chunk: int) -> None:
        self.incoming = incoming
        self.chunk = max(1, chunk)
        self.sent = bytearray()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += data

    async def receive_into(self, view: memoryview) -> int:
        await trio.lowlevel.checkpoint()
        n = min(len(view), self.chunk, len(self.incoming))
        view[:n] = self.incoming[:n]
        self.incoming = self.incoming[n:]
        return n

    async def aclose(self) -> None:
        return None


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def _valid_hello() -> bytes:
    from psyche.core.serde import to_bytes

    hello = blob_protocol.Hello(0, REQUESTER.public_key, PROVIDER.public_key, bytes(32))
    return _frame(to_bytes(hello, blob_protocol.Hello))


stream_bytes = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda junk: _valid_hello() + junk, st.binary(max_size=200)),
    st.builds(lambda n, junk: n.to_bytes(4, "big") + junk, st.integers(0, 2**32 - 1),
              st.binary(max_size=100)),
)  # fmt: skip


@FUZZ
@given(incoming=stream_bytes, chunk=st.integers(1, 64))
def test_blob_provider_survives_hostile_requesters(incoming: bytes, chunk: int) -> None:
    async def main() -> None:
        stream = ScriptedStream(incoming, chunk)
        try:
            with trio.fail_after(1):  # the real handshake timeout is longer; the stream is short
                await blob_protocol.serve_one(
                    stream, PROVIDER, lambda h: BLOB, lambda peer: peer == REQUESTER.public_key
                )
        except (BlobProtocolError, trio.TooSlowError):
            pass
        # never serves a blob without a valid signed request from an allowed peer
        assert BLOB not in stream.sent

    trio.run(main)


@FUZZ
@given(incoming=st.binary(max_size=400), chunk=st.integers(1, 64))
def test_blob_requester_survives_hostile_providers(incoming: bytes, chunk: int) -> None:
    async def main() -> None:
        stream = ScriptedStream(incoming, chunk)
        with pytest.raises((BlobProtocolError, trio.TooSlowError)):
            with trio.fail_after(1):
                await blob_protocol.fetch_one(
                    stream, REQUESTER, PROVIDER.public_key, bytes(32), 10, lambda n: None
                )

    trio.run(main)


def test_coordinator_server_keeps_serving_after_hostile_connections() -> None:
    """Hypothesis-made byte streams over real sockets to a real server, then an honest client."""
    from psyche.centralized.client import CentralizedBackend
    from psyche.centralized.server import ServerOptions, open_server
    from psyche.coordinator.testing import quick_coordinator

    streams = st.one_of(
        st.binary(max_size=200),
        st.builds(lambda n, junk: n.to_bytes(4, "big") + junk, st.integers(0, 2**32 - 1),
                  st.binary(max_size=64)),
    )  # fmt: skip
    payloads: list[bytes] = []

    @settings(max_examples=min(EXAMPLES, 60), deadline=None, database=None,
              derandomize=True, suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(data=streams)
    def collect(data: bytes) -> None:
        payloads.append(data)

    collect()

    async def main() -> None:
        coordinator = quick_coordinator()
        options = ServerOptions(host="127.0.0.1", port=0, tick_interval=0.1)
        async with open_server(coordinator, options) as server:
            port = server.port

            async def hostile(data: bytes) -> None:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                try:
                    await stream.send_all(data)
                    with trio.move_on_after(0.2):
                        await stream.receive_some(1 << 16)
                except (trio.BrokenResourceError, OSError):
                    pass
                finally:
                    await stream.aclose()

            async with trio.open_nursery() as nursery:
                for data in payloads:
                    nursery.start_soon(hostile, data)
            key = SecretKey.from_bytes((9).to_bytes(32, "big"))
            with trio.fail_after(20):
                async with CentralizedBackend.connect(
                    f"127.0.0.1:{port}", key, coordinator.run_id
                ) as backend:
                    state = await backend.wait_for_new_state()
            assert state.run_id == coordinator.run_id

    trio.run(main)
