"""The TCP data server and its client over real loopback sockets."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import trio

from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.identity import SecretKey
from psyche.core.node_identity import NodeIdentity
from psyche.core.token_size import TokenSize
from psyche.data_provider import (
    DataProviderError,
    DataProviderTcpClient,
    DataProviderTcpServer,
    LocalDataProvider,
    TokenizedData,
)
from psyche.data_provider.server import main as server_main
from psyche.data_provider.server import read_allow_file, watch_allow_file
from psyche.data_provider.wire import RawTrainingData, TrainingData
from psyche.transport import encode_challenge_response

from ..polling import poll_until
from .conftest import serve_until

pytestmark = pytest.mark.anyio
SEED = bytes(range(1, 33))


@pytest.fixture
def local(tmp_path: Path, write_tokens) -> LocalDataProvider:
    write_tokens(tmp_path / "data" / "a.ds", np.arange(5000) % 32000)
    write_tokens(tmp_path / "data" / "b.ds", (np.arange(3000) * 7) % 32000)
    provider = LocalDataProvider.new_from_directory(
        tmp_path / "data", TokenSize.TwoBytes, 64, Shuffle.Seeded(SEED)
    )
    yield provider
    provider.close()


def address(server: DataProviderTcpServer) -> str:
    return f"127.0.0.1:{server.local_addr[1]}"


async def test_clients_in_the_run_get_exactly_the_local_samples(local: LocalDataProvider) -> None:
    key, stranger = SecretKey.generate(), SecretKey.generate()
    async with DataProviderTcpServer.start(
        local, host="127.0.0.1", allowed=[key.public_key]
    ) as server:
        client = await DataProviderTcpClient.connect(address(server), key)
        try:
            for batch in (BatchId(0, 0), BatchId(3, 40), BatchId(100, 123)):
                assert await client.get_samples(batch) == await local.get_samples(batch)
            assert server.provided_sequences == {key.public_key: 1 + 38 + 24}
        finally:
            await client.aclose()
        outsider = await DataProviderTcpClient.connect(address(server), stranger)
        with pytest.raises(DataProviderError, match=r"rejected B\[0, 1\]: NotInThisRound"):
            await outsider.get_samples(BatchId(0, 1))
        # The allowlist follows the coordinator's epoch clients (by p2p identity).
        state = SimpleNamespace(
            epoch_state=SimpleNamespace(
                clients=[SimpleNamespace(id=NodeIdentity.from_single_key(stranger.public_key))]
            )
        )
        server.update_from_coordinator(state)
        assert len(await outsider.get_samples(BatchId(0, 1))) == 2
        await outsider.aclose()
        again = await DataProviderTcpClient.connect(address(server), key)
        with pytest.raises(DataProviderError, match="NotInThisRound"):
            await again.get_samples(BatchId(0, 0))
        await again.aclose()


async def test_bad_requests_are_rejected_and_the_server_keeps_serving(
    local: LocalDataProvider,
) -> None:
    key = SecretKey.generate()
    n = local.num_sequences()
    async with DataProviderTcpServer.start(local, host="127.0.0.1", allow_any=True) as server:
        client = await DataProviderTcpClient.connect(address(server), key)
        with pytest.raises(DataProviderError, match="WrongDataIdForStep"):
            await client.get_samples(BatchId(n - 1, n + 5))
        # A hostile peer: valid handshake, then garbage; only its connection is dropped.
        with trio.socket.socket() as raw:
            await raw.connect(("127.0.0.1", server.local_addr[1]))
            header = await raw.recv(4)
            challenge = (await raw.recv(int.from_bytes(header, "big")))[1:]
            response = encode_challenge_response(SecretKey.generate(), challenge)
            await raw.send(len(response).to_bytes(4, "big") + response)
            garbage = b"\x01\x00\xff\xff\xff\xff\xff"
            await raw.send(len(garbage).to_bytes(4, "big") + garbage)
            assert await raw.recv(10) == b""  # closed by the server
        assert len(await client.get_samples(BatchId(0, 9))) == 10
        assert server.connected_clients() == [key.public_key]
        await client.aclose()


async def test_reply_larger_than_a_frame_is_rejected(local: LocalDataProvider) -> None:
    key = SecretKey.generate()
    async with DataProviderTcpServer.start(
        local, host="127.0.0.1", allow_any=True, max_send_frame=2000
    ) as server:
        client = await DataProviderTcpClient.connect(address(server), key)
        with pytest.raises(DataProviderError, match="WrongDataIdForStep"):
            await client.get_samples(
                BatchId(0, 40)
            )  # refused before reading: 41*64 tokens > 2000 B
        with pytest.raises(DataProviderError, match="WrongDataIdForStep"):
            await client.get_samples(BatchId(0, 20))  # read, encoded, too large
        assert len(await client.get_samples(BatchId(0, 3))) == 4
        await client.aclose()


class Stalls:
    seq_len = 4

    def __init__(self) -> None:
        self.started = trio.Event()

    async def get_samples(self, data_ids: BatchId) -> list[TokenizedData]:
        self.started.set()
        await trio.sleep_forever()
        raise AssertionError


async def test_server_gone_mid_request_then_back(local: LocalDataProvider) -> None:
    key = SecretKey.generate()
    stalls = Stalls()
    async with trio.open_nursery() as nursery:
        cancel = trio.CancelScope()
        port = await serve_until(nursery, stalls, cancel)
        client = await DataProviderTcpClient.connect(f"127.0.0.1:{port}", key)

        async def stop_when_stalled() -> None:
            await stalls.started.wait()
            cancel.cancel()

        nursery.start_soon(stop_when_stalled)
        with pytest.raises(DataProviderError, match=r"failed while serving B\[0, 1\]"):
            await client.get_samples(BatchId(0, 1))
    # The next request reconnects: a server back on the same port serves it.
    async with DataProviderTcpServer.start(local, host="127.0.0.1", port=port, allow_any=True):
        assert await client.get_samples(BatchId(2, 3)) == await local.get_samples(BatchId(2, 3))
    await client.aclose()
    with pytest.raises(DataProviderError, match="cannot connect to data server"):
        await DataProviderTcpClient.connect(f"127.0.0.1:{port}", key)


async def test_allow_file_is_followed(
    tmp_path: Path, local: LocalDataProvider, monkeypatch, caplog
) -> None:
    monkeypatch.setattr("psyche.data_provider.server.ALLOW_FILE_POLL_SECONDS", 0.02)
    a, b = SecretKey.generate(), SecretKey.generate()
    allow = tmp_path / "allow.txt"
    allow.write_text(f"# run clients\n{a.public_key.hex()}\n")
    assert read_allow_file(allow) == {a.public_key}

    async def until(predicate) -> None:
        with trio.fail_after(20):
            await poll_until(predicate, 0.02)

    async with (
        DataProviderTcpServer.start(local, host="127.0.0.1") as server,
        trio.open_nursery() as nursery,
    ):
        assert not server.is_allowed(a.public_key)
        nursery.start_soon(watch_allow_file, server, allow, set())
        await until(lambda: server.is_allowed(a.public_key))
        assert not server.is_allowed(b.public_key)
        allow.write_text(f"{b.public_key.hex()}\n")
        await until(lambda: server.is_allowed(b.public_key))
        assert not server.is_allowed(a.public_key)
        # A broken file keeps the last good list: wait until the watcher has read it (it says
        # so), then look.
        with caplog.at_level("WARNING", logger="psyche.data_provider.server"):
            allow.write_text("not a key\n")
            await until(lambda: "cannot read allowlist" in caplog.text)
        assert server.is_allowed(b.public_key)
        assert not server.is_allowed(a.public_key)
        nursery.cancel_scope.cancel()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_standalone_server_cli(tmp_path: Path, write_tokens) -> None:
    write_tokens(tmp_path / "tokens" / "x.ds", np.arange(2000) % 1000)
    (tmp_path / "conf").mkdir()
    config = tmp_path / "conf" / "data.toml"
    config.write_text(
        f'dir = "../tokens"\ntoken_size = "TwoBytes"\nseq_len = 16\nshuffle_seed = {list(SEED)}\n'
    )
    key = SecretKey.generate()
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "psyche.data_provider.server",
            "--data-config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--allow",
            key.public_key.hex(),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        client = None
        while client is None:
            try:
                client = await DataProviderTcpClient.connect(f"127.0.0.1:{port}", key)
            except DataProviderError:
                assert proc.poll() is None, proc.communicate()[0]
                assert time.monotonic() < deadline, proc.communicate()[0]
                await trio.sleep(0.1)
        expected = LocalDataProvider.new_from_directory(
            tmp_path / "tokens", TokenSize.TwoBytes, 16, Shuffle.Seeded(SEED)
        )
        assert await client.get_samples(BatchId(5, 9)) == await expected.get_samples(BatchId(5, 9))
        await client.aclose()
        expected.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_standalone_server_cli_reports_a_bad_config(tmp_path: Path, caplog) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('dir = "."\ntoken_size = "ThreeBytes"\nseq_len = 16\nshuffle_seed = [1]\n')
    assert server_main(["--data-config", str(bad), "--port", "0"]) == 1
    assert "bad.toml" in caplog.text
    assert "token_size" in caplog.text
    assert "shuffle_seed" in caplog.text
    assert server_main(["--data-config", str(tmp_path / "none.toml"), "--port", "0"]) == 1
    assert "cannot read data config" in caplog.text
    assert server_main(["--data-config", str(bad), "--port", "1", "--allow", "zz"]) == 1
    assert "not an ed25519 public key" in caplog.text


# ---------------------------------------------------------------------------------------------
# The raw-token extension and the fallback to upstream's messages


async def test_python_peers_use_raw_tokens_with_identical_results(
    local: LocalDataProvider,
) -> None:
    key = SecretKey.generate()
    async with DataProviderTcpServer.start(local, host="127.0.0.1", allow_any=True) as server:
        client = await DataProviderTcpClient.connect(address(server), key)
        assert client.raw_replies is None
        for batch in (BatchId(0, 0), BatchId(3, 40), BatchId(100, 123)):
            expected = local.read_batch(batch)
            got = await client.get_batch(batch)
            assert got.dtype == np.int32
            assert np.array_equal(got, expected)
            assert await client.get_samples(batch) == await local.get_samples(batch)
        assert client.raw_replies is True
        assert isinstance(await client._fetch(BatchId(1, 2)), RawTrainingData)
        # What a Rust client asks for, it gets in upstream's form, from the same server.
        client.raw_replies = False
        reply = await client._fetch(BatchId(3, 40))
        assert isinstance(reply, TrainingData)
        assert reply.raw_data == await local.get_samples(BatchId(3, 40))
        await client.aclose()


async def test_upstream_only_server_gets_upstream_requests_after_one_drop(
    local: LocalDataProvider, caplog
) -> None:
    key = SecretKey.generate()
    async with DataProviderTcpServer.start(
        local, host="127.0.0.1", allow_any=True, upstream_only=True
    ) as server:
        client = await DataProviderTcpClient.connect(address(server), key)
        with caplog.at_level("INFO", logger="psyche"):
            for batch in (BatchId(0, 3), BatchId(10, 20), BatchId(5, 5)):
                assert np.array_equal(await client.get_batch(batch), local.read_batch(batch))
                assert await client.get_samples(batch) == await local.get_samples(batch)
        assert client.raw_replies is False
        # One drop (the server could not decode the raw request), then one new connection that
        # serves every later request.
        assert caplog.text.count("dropped the connection on the raw-token request") == 1
        assert caplog.text.count("Connected to server at") == 1
        await client.aclose()


class WithLabels:
    """A provider of preprocessed-style samples: they must travel in upstream's form."""

    seq_len = 4

    async def get_samples(self, data_ids: BatchId) -> list[TokenizedData]:
        return [
            TokenizedData(np.arange(4) + i, labels=np.full(4, -100))
            for i in range(data_ids.start, data_ids.end + 1)
        ]


async def test_samples_with_extras_travel_in_upstreams_form() -> None:
    key = SecretKey.generate()
    provider = WithLabels()
    async with DataProviderTcpServer.start(provider, host="127.0.0.1", allow_any=True) as server:
        client = await DataProviderTcpClient.connect(address(server), key)
        batch = BatchId(2, 4)
        assert await client.get_samples(batch) == await provider.get_samples(batch)
        with pytest.raises(DataProviderError, match="read them with get_samples"):
            await client.get_batch(batch)
        await client.aclose()


async def test_a_raw_reply_that_lies_about_its_length_is_refused() -> None:
    from psyche.data_provider.wire import ClientToServerMessage
    from psyche.transport import Message, PostcardCodec, TcpServer

    class Verbatim:
        def encode(self, value: bytes) -> bytes:
            return value

        def decode(self, data: bytes) -> bytes:
            return bytes(data)

    # B[0, 1] x 4 tokens of 2 bytes needs 16 token bytes; this reply carries 14.
    lie = bytes.fromhex("02000104020e") + bytes(14)
    key = SecretKey.generate()
    async with TcpServer.start(
        to_server=PostcardCodec(ClientToServerMessage), to_client=Verbatim(), host="127.0.0.1"
    ) as tcp:

        async def answer() -> None:
            async for event in tcp:
                if isinstance(event, Message):
                    tcp.send_to(event.client, lie)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer)
            client = await DataProviderTcpClient.connect(f"127.0.0.1:{tcp.local_addr[1]}", key)
            with pytest.raises(DataProviderError, match="needs 16"):
                await client.get_batch(BatchId(0, 1))
            assert client.raw_replies is None  # a bad reply is not a verdict on the protocol
            await client.aclose()
            nursery.cancel_scope.cancel()
