"""Helpers for tests and benchmarks: several real nodes on 127.0.0.1 in one trio loop."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from typing import Any

import trio

from psyche.core.identity import SecretKey
from psyche.network.connection import NetworkConfig, NetworkConnection
from psyche.network.events import NetworkEvent
from psyche.network.sharable_model import ParameterCodec, SharableModel
from psyche.network.ticket import EndpointAddr, TransportAddr


def only_relayed(addr: EndpointAddr) -> EndpointAddr:
    """`addr` with its relayed (`/p2p-circuit`) libp2p addresses only: a peer known so is
    reached through its relay, as one behind NAT is."""
    return EndpointAddr(
        addr.id,
        [
            a
            for a in addr.addrs
            if isinstance(a, TransportAddr.Libp2p) and "/p2p-circuit" in a.value
        ],
    )


def local_config(run_id: str = "test-run", **overrides: Any) -> NetworkConfig:
    return replace(NetworkConfig(run_id=run_id, bind_host="127.0.0.1"), **overrides)


@asynccontextmanager
async def open_nodes(
    count: int,
    *,
    run_id: str = "test-run",
    broadcast_type: Any = bytes,
    distro_result_type: Any = bytes,
    model_codec: ParameterCodec | None = None,
    allow_each_other: bool = True,
    keys: Sequence[SecretKey] | None = None,
    **config: Any,
) -> AsyncIterator[list[NetworkConnection]]:
    """`count` nodes, each allowing all the others (as clients of one run would). Raw `bytes`
    stand in for the application's gossip messages and DisTrO results unless told otherwise;
    `model_codec`: the model parameters' (none shared by default). `keys`: the nodes'
    identities (random by default)."""
    identities = list(keys) if keys is not None else [SecretKey.generate() for _ in range(count)]
    async with AsyncExitStack() as stack:
        nodes = [
            await stack.enter_async_context(
                NetworkConnection.open(
                    local_config(run_id, secret_key=key, **config),
                    broadcast_type=broadcast_type,
                    distro_result_type=distro_result_type,
                    model_codec=model_codec,
                )
            )
            for key in identities[:count]
        ]
        if allow_each_other:
            ids = [n.endpoint_id for n in nodes]
            for node in nodes:
                node.set_allowed_peers(ids)
        yield nodes


def introduce(a: NetworkConnection, b: NetworkConnection) -> None:
    """Tell `a` where `b` is (what a bootstrap list or discovery would)."""
    a.address_book.add(b.endpoint_addr())


async def connect_pairs(
    nodes: Sequence[NetworkConnection], pairs: Sequence[tuple[int, int]]
) -> None:
    async with trio.open_nursery() as nursery:
        for i, j in pairs:
            introduce(nodes[i], nodes[j])
            nursery.start_soon(nodes[i].connect, nodes[j].endpoint_id)


def ring(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


def full_mesh(n: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(n) for j in range(i + 1, n)]


async def silent_flood(port: int, count: int, held: int = 50) -> None:
    """`count` TCP connections from 127.0.0.1 to `port` that never send a byte, at most `held`
    open at once (the oldest closed to open the next): what a stranger with no key can do to
    a listener; a libp2p host evicts the older ones while they wait for their handshake."""
    open_now: deque[trio.SocketStream] = deque()
    try:
        for _ in range(count):
            open_now.append(await trio.open_tcp_stream("127.0.0.1", port))
            if len(open_now) > held:
                await open_now.popleft().aclose()
    finally:
        for stream in open_now:
            await stream.aclose()


async def wait_until(
    predicate: Callable[[], bool], timeout: float = 10.0, poll: float = 0.02
) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(poll)


async def serve_model(
    network: NetworkConnection,
    model: SharableModel,
    *,
    on_other_event: Callable[[NetworkEvent], None] | None = None,
) -> None:
    """A provider: `network` serves `model` (it answers model-sharing requests by itself) while
    this reads its events (until cancelled), handing them to `on_other_event` if given."""
    network.shared_model = model
    while True:
        event = await network.next_event()
        if on_other_event is not None:
            on_other_event(event)
