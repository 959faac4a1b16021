"""The data server's bounds (psyche.data_provider.tcp_server over psyche.transport): strangers'
claims cost nothing, a member that asks without reading is dropped, rejections do not flood the
log, an idle connection is closed and its client reconnects by itself, and the limits given to
`start` are the ones applied. Real sockets on loopback; every wait is bounded."""

from __future__ import annotations

import logging
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.identity import SecretKey
from psyche.core.token_size import TokenSize
from psyche.data_provider import (
    DataProviderError,
    DataProviderTcpClient,
    DataProviderTcpServer,
    LocalDataProvider,
)
from psyche.data_provider.wire import ClientToServerMessage, RequestTrainingData
from psyche.transport import (
    SERVER_MAX_FRAME_LENGTH,
    ConnectionLimits,
    FramedStream,
    PostcardCodec,
    encode_challenge_response,
    encode_else,
)

from ..polling import poll_until

pytestmark = pytest.mark.anyio

DEADLINE = 30  # seconds: generous, for a busy 2-core machine
MIB = 1 << 20
SEED = bytes(range(1, 33))
SEQ_LEN = 64


@pytest.fixture
def local(tmp_path: Path, write_tokens) -> LocalDataProvider:  # type: ignore[no-untyped-def]
    write_tokens(tmp_path / "data" / "a.ds", np.arange(64_000) % 32000)
    provider = LocalDataProvider.new_from_directory(
        tmp_path / "data", TokenSize.TwoBytes, SEQ_LEN, Shuffle.Seeded(SEED)
    )
    yield provider
    provider.close()


def address(server: DataProviderTcpServer) -> str:
    return f"127.0.0.1:{server.local_addr[1]}"


async def raw_connection(server: DataProviderTcpServer) -> tuple[trio.SocketStream, FramedStream]:
    stream = await trio.open_tcp_stream("127.0.0.1", server.local_addr[1])
    return stream, FramedStream(stream, max_receive_frame=64 * MIB, max_send_frame=MIB)


async def login(framed: FramedStream, key: SecretKey) -> None:
    challenge = await framed.receive()
    assert challenge is not None
    await framed.send(encode_challenge_response(key, bytes(challenge[1:])))


async def closed_by_server(stream: trio.SocketStream) -> bool:
    with trio.fail_after(DEADLINE):
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
    return True


async def wait_until(predicate) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(DEADLINE):
        await poll_until(predicate, 0.01)


async def test_strangers_claiming_8_mib_cost_nothing_and_members_keep_fetching(
    local: LocalDataProvider,
) -> None:
    key = SecretKey.generate()
    limits = ConnectionLimits(max_pending=200, max_pending_per_address=200)
    async with DataProviderTcpServer.start(
        local, host="127.0.0.1", allowed=[key.public_key], limits=limits
    ) as server:
        client = await DataProviderTcpClient.connect(address(server), key)
        expected = await local.get_samples(BatchId(0, 7))
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            streams = []
            for _ in range(100):
                stream, framed = await raw_connection(server)
                await framed.receive()  # the challenge
                await stream.send_all(SERVER_MAX_FRAME_LENGTH.to_bytes(4, "big"))
                streams.append(stream)
                assert await client.get_samples(BatchId(0, 7)) == expected
            for stream in streams:
                assert await closed_by_server(stream)
                await stream.aclose()
            await trio.testing.wait_all_tasks_blocked()
            assert tracemalloc.get_traced_memory()[1] - before < 8 * MIB
        finally:
            tracemalloc.stop()
        assert server.connected_clients() == [key.public_key]
        await client.aclose()


async def test_a_member_that_asks_without_reading_is_dropped(
    local: LocalDataProvider, caplog
) -> None:
    caplog.set_level(logging.WARNING)
    greedy, honest = SecretKey.generate(), SecretKey.generate()
    limits = ConnectionLimits(max_queued_bytes=256 * 1024)
    async with DataProviderTcpServer.start(
        local, host="127.0.0.1", allowed=[greedy.public_key, honest.public_key], limits=limits
    ) as server:
        client = await DataProviderTcpClient.connect(address(server), honest)
        stream, framed = await raw_connection(server)
        await login(framed, greedy)
        # 128 sequences of 64 tokens a reply (32 KiB raw); 2000 of them are far more than the
        # socket buffers and the queue hold.
        request = encode_else(
            PostcardCodec(ClientToServerMessage).encode(
                ClientToServerMessage.RequestRawTrainingData(RequestTrainingData(BatchId(0, 127)))
            )
        )
        with trio.fail_after(DEADLINE):
            try:
                for _ in range(2000):
                    await framed.send(request)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # dropped while still asking
            await wait_until(lambda: server.connected_clients() == [honest.public_key])
        assert "is not reading" in caplog.text
        assert len(await client.get_samples(BatchId(0, 127))) == 128
        await stream.aclose()
        await client.aclose()


async def test_rejections_are_logged_once_per_interval(local: LocalDataProvider, caplog) -> None:
    caplog.set_level(logging.INFO)
    stranger = SecretKey.generate()
    async with DataProviderTcpServer.start(local, host="127.0.0.1") as server:
        client = await DataProviderTcpClient.connect(address(server), stranger)
        for i in range(50):
            with pytest.raises(DataProviderError, match="NotInThisRound"):
                await client.get_samples(BatchId(i, i))
        assert server.rejections.counts == {"NotInThisRound": 50}
        lines = [r for r in caplog.records if "rejecting" in r.getMessage()]
        assert len(lines) == 1
        server.rejections.flush()
        assert "49 NotInThisRound" in caplog.records[-1].getMessage()
        await client.aclose()


async def test_an_idle_connection_is_closed_and_the_client_reconnects(
    local: LocalDataProvider,
) -> None:
    key = SecretKey.generate()
    limits = ConnectionLimits(idle_timeout=0.5)
    async with DataProviderTcpServer.start(
        local, host="127.0.0.1", allowed=[key.public_key], limits=limits
    ) as server:
        client = await DataProviderTcpClient.connect(address(server), key)
        expected = await local.get_samples(BatchId(3, 5))
        assert await client.get_samples(BatchId(3, 5)) == expected
        await wait_until(lambda: not server.connected_clients())  # closed for idling
        assert server.drops.counts["IdleTimeout"] == 1
        # The next request notices the closed connection and opens a new one by itself.
        assert await client.get_samples(BatchId(3, 5)) == expected
        assert client.raw_replies is True
        await client.aclose()


async def test_the_limits_given_are_applied(local: LocalDataProvider) -> None:
    first, second = SecretKey.generate(), SecretKey.generate()
    limits = ConnectionLimits(max_connections=1)
    async with DataProviderTcpServer.start(
        local, host="127.0.0.1", allow_any=True, limits=limits
    ) as server:
        client = await DataProviderTcpClient.connect(address(server), first)
        assert len(await client.get_samples(BatchId(0, 1))) == 2
        refused = await DataProviderTcpClient.connect(address(server), second)
        with pytest.raises(DataProviderError, match="failed while serving"):
            await refused.get_samples(BatchId(0, 1))
        assert server.limits is limits
        await refused.aclose()
        await client.aclose()
