"""The chaos proxy over real loopback sockets: it forwards, delays, throttles, attributes each
connection to the process that dialed it, and a partition resets the connections it cuts."""

from __future__ import annotations

import os

import pytest
import trio
from proxy import CLEAR, Proxy, ProxyNet, Rule


async def _echo(stream: trio.SocketStream) -> None:
    try:
        async for chunk in stream:
            await stream.send_all(chunk)
    except trio.BrokenResourceError:
        pass


async def _setup(nursery: trio.Nursery, net: ProxyNet) -> int:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    nursery.start_soon(trio.serve_listeners, _echo, listeners)
    return int(await nursery.start(Proxy(net, "echo", ("127.0.0.1", port)).serve))


async def _roundtrip(port: int, data: bytes) -> tuple[bytes, float]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    start = trio.current_time()
    await stream.send_all(data)
    got = b""
    while len(got) < len(data):
        chunk = await stream.receive_some(1 << 16)
        if not chunk:
            break
        got += chunk
    await stream.aclose()
    return got, trio.current_time() - start


async def _echo_or_raise(stream: trio.SocketStream, data: bytes) -> None:
    """Sends `data` and reads the echo; a closed stream raises as a broken one would."""
    await stream.send_all(data)
    if not await stream.receive_some(10):
        raise trio.BrokenResourceError("closed")


async def _roundtrip_or_raise(port: int, data: bytes) -> None:
    """A round trip through a fresh connection; an empty answer (refused) raises."""
    got, _ = await _roundtrip(port, data)
    if not got:
        raise trio.BrokenResourceError("refused")


def test_forwarding_latency_bandwidth_and_attribution() -> None:
    async def main() -> None:
        net = ProxyNet()
        net.sources.register(os.getpid(), "me")
        async with trio.open_nursery() as nursery:
            port = await _setup(nursery, net)
            got, plain = await _roundtrip(port, b"hello")
            assert got == b"hello"
            assert net.accepted == 1
            net.set(Rule(latency=0.2), src="me", dst="echo")  # both directions
            got, slow = await _roundtrip(port, b"hello")
            assert got == b"hello"
            assert slow >= 0.4 > plain
            net.set(CLEAR, src="me", dst="echo")
            net.set(Rule(bandwidth=100_000), src="me", dst="echo", both=False)
            got, throttled = await _roundtrip(port, b"x" * 50_000)
            assert len(got) == 50_000
            assert throttled >= 0.45
            net.set(Rule(latency=5.0), src="someone-else", dst="echo")  # not us: no effect
            net.set(CLEAR, src="me", dst="echo", both=False)
            _, fast = await _roundtrip(port, b"hello")
            assert fast < 1.0
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_partition_resets_open_connections_and_refuses_new_ones() -> None:
    async def main() -> None:
        net = ProxyNet()
        net.sources.register(os.getpid(), "me")
        async with trio.open_nursery() as nursery:
            port = await _setup(nursery, net)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"ping")
            assert await stream.receive_some(4) == b"ping"
            net.partition("me", others=["echo"])
            with pytest.raises((trio.BrokenResourceError, trio.ClosedResourceError)):
                with trio.fail_after(2):
                    await _echo_or_raise(stream, b"again")
            await stream.aclose()
            refused = net.refused
            with pytest.raises((trio.BrokenResourceError, OSError)):
                await _roundtrip_or_raise(port, b"x")
            assert net.refused == refused + 1
            assert net.refused_from["me"] >= 1
            net.heal("me", others=["echo"])
            got, _ = await _roundtrip(port, b"back")
            assert got == b"back"
            nursery.cancel_scope.cancel()

    trio.run(main)
