"""A peer that leaves the run is forgotten by the blob routes (psyche.network.blob_routes
`BlobRoutes.forget`, called by `NetworkConnection.set_allowed_peers`), between real nodes on
loopback: every table held for it is emptied and its kept side-channel session is closed (the
provider's server sees it end), while fetching from the members that stay still works. Before,
a long-running client kept an entry per peer it ever fetched from, and the session until idle."""

from __future__ import annotations

import os

import trio
import trio.testing

from psyche.network.blob_routes import SIDE_CHANNEL, BlobRoutes
from psyche.network.connection import NetworkConnection
from psyche.network.download import DownloadComplete
from psyche.network.testing import open_nodes
from psyche.network.transmittable import DownloadType

DEADLINE = 30


def _held_for(routes: BlobRoutes, peer: bytes) -> list[str]:
    """The names of the tables that still hold something for `peer`."""
    tables = {
        "slots": routes._slots,
        "sessions": routes._sessions,
        "side channel down": routes._side_channel_down,
        "older providers": routes._older_providers,
        "direct suspect": routes._direct_suspect,
        "routes": routes.routes,
    }
    return [name for name, table in tables.items() if peer in table]


async def _fetch(fetcher: NetworkConnection, provider: NetworkConnection, tag: str) -> None:
    """`fetcher` downloads a fresh blob of `provider`'s and gets its bytes."""
    data = os.urandom(200_000)
    ticket, _ = await provider.add_downloadable(data, tag)
    with trio.fail_after(DEADLINE):
        done = await fetcher.start_download(ticket, tag, DownloadType.DistroResult([])).finished()
    assert isinstance(done, DownloadComplete)
    assert bytes(done.data) == data


def test_a_peer_removed_from_the_run_is_forgotten_and_its_session_closed() -> None:
    async def main() -> None:
        async with open_nodes(3) as (fetcher, leaving, staying):
            routes = fetcher.blob_routes
            gone = leaving.endpoint_id
            for i, provider in enumerate((leaving, staying)):
                await _fetch(fetcher, provider, f"distro-result_{i}")
                assert routes.routes[provider.endpoint_id] == SIDE_CHANNEL
                assert provider.blob_server.sessions == 1  # kept for the next blob
            # what failures would have left behind for the peer (a side channel that failed,
            # an older provider, a direct path that stalled), as they would have noted it
            now = trio.current_time()
            routes._side_channel_down[gone] = now
            routes._older_providers[gone] = now
            routes._direct_suspect[gone] = now
            assert _held_for(routes, gone) == [
                "slots",
                "sessions",
                "side channel down",
                "older providers",
                "direct suspect",
                "routes",
            ]

            fetcher.set_allowed_peers([fetcher.endpoint_id, staying.endpoint_id])
            for _ in range(DEADLINE * 100):  # (forget runs in the network's nursery)
                if not (_held_for(routes, gone) or leaving.blob_server.sessions):
                    break
                await trio.sleep(0.01)
            assert _held_for(routes, gone) == []
            assert gone not in routes.peers()
            assert leaving.blob_server.sessions == 0, "the kept session to it was closed"

            # the member that stays is fetched from as before, on its kept session
            await _fetch(fetcher, staying, "distro-result_2")
            assert routes.routes[staying.endpoint_id] == SIDE_CHANNEL
            assert staying.blob_server.sessions == 1
            assert routes.peers() == {staying.endpoint_id}

    trio.run(main)


def test_a_fetch_under_way_when_its_provider_is_forgotten_leaves_nothing_behind() -> None:
    """Forgetting a provider while a fetch from it runs lets the fetch finish on its session
    (closed as it ends), and the fetch forgets again on its way out what it noted meanwhile
    (its route), so nothing stays held for the peer."""

    async def main() -> None:
        async with open_nodes(2) as (fetcher, leaving), trio.open_nursery() as nursery:
            routes = fetcher.blob_routes
            gone = leaving.endpoint_id
            ticket, _ = await leaving.add_downloadable(os.urandom(8 << 20), "model-big")
            forgotten: list[int] = []

            def progress(received: int) -> None:
                if not forgotten:  # mid-transfer: the peer leaves
                    forgotten.append(received)
                    nursery.start_soon(routes.forget, gone)

            with trio.fail_after(DEADLINE):
                data = await routes.fetch(ticket.addr, ticket.hash, ticket.size, progress)
            assert len(data) == ticket.size, "the fetch under way finished (its hash checked)"
            assert forgotten
            assert forgotten[0] < ticket.size
            await trio.testing.wait_all_tasks_blocked()
            assert _held_for(routes, gone) == []
            for _ in range(DEADLINE * 100):
                if not leaving.blob_server.sessions:
                    break
                await trio.sleep(0.01)
            assert leaving.blob_server.sessions == 0
            nursery.cancel_scope.cancel()

    trio.run(main)
