"""The local endpoint started again on its ports (`LocalnetHandle.start` after `stop`) while
another socket holds one of them for a moment: an outgoing connection of another process can
be given the port as its local one while the endpoint is down (CI run 33, two test phases side
by side: `OSError: [Errno 98] Address already in use` in
`test_sends_wait_out_an_rpc_outage_and_ticks_do_not_pile_up`). It waits for the port instead of
failing; a port held for good still fails, with the OSError."""

from __future__ import annotations

import socket

import pytest
import trio

from psyche.solana.localnet import server as localnet_server
from psyche.solana.localnet.ledger import Ledger
from psyche.solana.localnet.server import start_localnet


def _hold(port: int) -> socket.socket:
    """A socket bound to `port` without SO_REUSEADDR, as an outgoing connection's is."""
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", port))
    held.listen(1)
    return held


def test_a_restart_waits_for_a_port_held_for_a_moment() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            net = await start_localnet(nursery, Ledger())
            port = net.server.rpc_port
            await net.stop()
            held = _hold(port)

            async def release() -> None:
                await trio.sleep(0.5)
                held.close()

            nursery.start_soon(release)
            with trio.fail_after(30):
                await net.start()
            assert net.server.rpc_port == port
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_port_held_for_good_fails_with_the_os_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(localnet_server, "RESTART_BIND_SECONDS", 0.3)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            net = await start_localnet(nursery, Ledger())
            await net.stop()
            held = _hold(net.server.rpc_port)
            failed: BaseException | None = None
            try:
                await net.start()
            except (OSError, BaseExceptionGroup) as e:
                failed = e
            finally:
                held.close()
            assert failed is not None
            assert localnet_server._address_in_use(failed)
            await net.start()  # and the handle is usable once the port is free
            nursery.cancel_scope.cancel()

    trio.run(main)
