"""A peer that loses its direct path falls back to the relay (issue 16), in real network
namespaces (`tests/netns.py`): a relay on the public segment, a provider and a requester each
behind its own "cone" NAT. The requester reaches the provider through the relay, hole punching
makes the path direct; then the requester's router starts dropping everything between the two
(the punched path dies without a word). The message it gossips at once still arrives (its copy
on the relayed connection: what gossip writes on the dead one is lost), and its next download
completes: opening its stream on the dead connection stalls, so it moves to the relayed
connection within seconds (the pings then find the direct one dead and close it), and the blob
comes over a libp2p stream through the relay.

The nodes are `nat_roles.py` processes (one per namespace). Needs root with `ip` and `nft`;
skips with the reason elsewhere.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from .. import netns
from ..processes import Processes
from .nat_roles import wait_file

pytestmark = pytest.mark.slow

ROLES = Path(__file__).with_name("nat_roles.py")


def test_a_lost_direct_path_falls_back_to_the_relay(tmp_path: Path) -> None:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(reason)
    from psyche.network.blob_routes import LIBP2P_RELAYED

    processes = Processes(tmp_path)
    with netns.nat_topology(nat_hosts=2) as net:
        provider_host, requester_host = net.nat

        def start(name: str, host: netns.Host, *args: str):  # type: ignore[no-untyped-def]
            argv = [sys.executable, str(ROLES), "--workdir", str(tmp_path), "--role", *args]
            return processes.start(name, net.exec(host, argv))

        try:
            start("relay", net.wan, "relay")
            start("provider", provider_host, "provider", "--size", "1000000")
            requester = start("requester", requester_host, "requester", "--mode", "fallback")
            wait_file(tmp_path / "direct", 120)
            punched = (tmp_path / "direct").read_text()
            assert punched != "None", f"no hole punch through a cone NAT:\n{requester.text()}"
            assert requester_host.router is not None
            assert provider_host.router_wan_ip is not None
            net.block(requester_host, provider_host.router_wan_ip)
            (tmp_path / "blocked").write_text("")
            assert requester.popen.wait(150) == 0, requester.text()
            wait_file(tmp_path / "received-after", 30)
        finally:
            for proc in processes.started:  # helpers with nothing to save: no grace period
                processes.signal(proc, signal.SIGKILL)
                proc.popen.wait()
    result = json.loads(requester.text().strip().splitlines()[-1])
    assert result["first_paths"] == ["relayed"]  # the private address answers nobody
    assert result["complete"], result
    assert result["route"] == LIBP2P_RELAYED, result
    # moved by the stall watch (the stream it opened on the dead path gave nothing for 3 s),
    # not after pings (every 5 s, as in a client) found the connection dead
    assert result["direct_suspected"], result
    assert set(result["paths_after"]) == {"relayed"}, result
    # the message gossiped just after the block came by its copy on the relay
    before = max(
        (json.loads(f.read_text()) for f in tmp_path.glob("received-before-*")),
        key=lambda said: int(said["mirrored_first"]),
    )
    after = json.loads((tmp_path / "received-after").read_text())
    assert after["mirrored_first"] == before["mirrored_first"] + 1, (before, after)
