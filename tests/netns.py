"""Network namespaces for NAT tests: a public segment, masquerading routers, hosts behind them.

    with nat_topology(nat_hosts=2, public_hosts=1) as net:
        server = net.wan                      # 198.18.0.1, on the public segment
        a, b = net.nat                        # each behind its own NAT router
        argv = net.exec(a, [sys.executable, "-m", ...])   # run a command inside a's namespace

Layout (every address in 198.18.0.0/15, the range reserved for network benchmarks and tests):

* `wan` (198.18.0.1/24): the public segment, a bridge in a namespace of its own; the server
  and its relay run here.
* router `r<i>` (WAN 198.18.0.<10+i>, LAN 198.19.<i>.1/24): forwards its LAN to the public
  segment behind a masquerading NAT (nftables), accepts from outside only what belongs to a
  connection from inside, and drops the rest silently (no reset), as a home router does. It
  keeps a connection's source port where it can (a "cone" NAT, through which TCP hole punching
  can work) unless `i` is in `symmetric`: then every connection gets a random port, so the port
  a peer observed is never the one the next connection uses and hole punching cannot work;
* NAT host `n<i>` (198.19.<i>.2, default route via its router);
* public host `p<j>` (198.18.0.<20+j>) on the public segment.

Nothing connects these namespaces to the machine's own: test traffic never leaves them. Each
topology's namespaces are named `psy16-<pid>-<role>`; `nat_topology` deletes them at the end
(after killing whatever still runs inside), even when the test fails, and deletes the leftovers
of runs that were killed before they could. `unavailable()` says why namespaces cannot be made
here (not root, `ip` or `nft` missing, namespaces refused), for tests to skip with that reason.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

PREFIX = "psy16"
WAN_IP = "198.18.0.1"


@dataclass(frozen=True)
class Host:
    ns: str
    ip: str
    router: str | None = None
    """The namespace of the NAT router in front of it (None: on the public segment)."""
    router_wan_ip: str | None = None


@dataclass
class Topology:
    wan: Host
    nat: list[Host] = field(default_factory=list)
    public: list[Host] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    def exec(self, host: Host, argv: list[str]) -> list[str]:
        """`argv` run inside `host`'s namespace."""
        return ["ip", "netns", "exec", host.ns, *argv]

    def block(self, host: Host, peer_ip: str) -> None:
        """Make `host`'s router drop everything between `host` and `peer_ip` (both ways),
        connections already open included: a path that dies without a word."""
        assert host.router is not None
        for direction in ("ip daddr", "ip saddr"):
            nft(host.router, f"insert rule ip filter forward {direction} {peer_ip} drop")

    def unblock(self, host: Host) -> None:
        assert host.router is not None
        nft(host.router, "flush chain ip filter forward")
        nft(host.router, FORWARD_RULES)


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)


def ip(*args: str) -> None:
    run("ip", *args)


def nft(ns: str, command: str) -> None:
    run("ip", "netns", "exec", ns, "nft", *command.split())


FORWARD_RULES = (
    "add rule ip filter forward ct state established,related accept ; "
    "add rule ip filter forward iifname lan0 oifname wan0 accept"
)


def _router_ruleset(symmetric: bool) -> str:
    masquerade = "masquerade fully-random" if symmetric else "masquerade"
    return f"""
table ip nat {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan0" {masquerade}
    }}
}}
table ip filter {{
    chain forward {{
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "lan0" oifname "wan0" accept
    }}
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "wan0" ct state new drop
    }}
}}
"""


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if shutil.which("nft") is None:
        return "the `nft` command (Debian package nftables) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    result = run("ip", "netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"cannot make a network namespace: {result.stderr.strip()}"
    try:
        nft_check = run("ip", "netns", "exec", probe, "nft", "list", "ruleset", check=False)
        if nft_check.returncode != 0:
            return f"nftables does not work in a namespace: {nft_check.stderr.strip()}"
    finally:
        run("ip", "netns", "del", probe, check=False)
    return None


def _namespaces() -> list[str]:
    listing = run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def delete_namespace(ns: str) -> None:
    """Kill what runs in `ns`, then delete it."""
    pids = run("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    run("ip", "netns", "del", ns, check=False)


def clean_leftovers() -> list[str]:
    """Delete the namespaces of topologies whose test process is gone (a killed run)."""
    removed = []
    for ns in _namespaces():
        match = re.fullmatch(rf"{PREFIX}-(\d+)-\w+", ns)
        if match and not _alive(int(match.group(1))):
            delete_namespace(ns)
            removed.append(ns)
    return removed


@contextlib.contextmanager
def nat_topology(
    nat_hosts: int = 2, public_hosts: int = 0, symmetric: Iterable[int] = ()
) -> Iterator[Topology]:
    """`nat_hosts` hosts each behind its own NAT (numbered from 1; those in `symmetric` behind
    a port-randomizing one) and `public_hosts` on the public segment, for the block."""
    symmetric = set(symmetric)
    clean_leftovers()
    tag = f"{PREFIX}-{os.getpid()}"
    wan = Host(f"{tag}-wan", WAN_IP)
    topology = Topology(wan)
    try:
        _add_namespace(topology, wan.ns)
        ip("-n", wan.ns, "link", "add", "br0", "type", "bridge")
        ip("-n", wan.ns, "addr", "add", f"{WAN_IP}/24", "dev", "br0")
        ip("-n", wan.ns, "link", "set", "br0", "up")
        for i in range(1, nat_hosts + 1):
            topology.nat.append(_nat_host(topology, tag, i, i in symmetric))
        for j in range(1, public_hosts + 1):
            host = Host(f"{tag}-p{j}", f"198.18.0.{20 + j}")
            _add_namespace(topology, host.ns)
            _uplink(wan.ns, host.ns, "eth0", f"q{j}", f"{host.ip}/24")
            topology.public.append(host)
        yield topology
    finally:
        for ns in reversed(topology.namespaces):
            delete_namespace(ns)


def _add_namespace(topology: Topology, ns: str) -> None:
    ip("netns", "add", ns)
    topology.namespaces.append(ns)
    ip("-n", ns, "link", "set", "lo", "up")


def _uplink(wan_ns: str, ns: str, inside: str, bridge_port: str, address: str) -> None:
    """A veth from `ns` (named `inside`, holding `address`) to the public segment's bridge."""
    ip(
        "-n",
        ns,
        "link",
        "add",
        inside,
        "type",
        "veth",
        "peer",
        "name",
        bridge_port,
        "netns",
        wan_ns,
    )
    ip("-n", wan_ns, "link", "set", bridge_port, "master", "br0", "up")
    ip("-n", ns, "addr", "add", address, "dev", inside)
    ip("-n", ns, "link", "set", inside, "up")


def _nat_host(topology: Topology, tag: str, i: int, symmetric: bool) -> Host:
    router, inside = f"{tag}-r{i}", f"{tag}-n{i}"
    router_wan = f"198.18.0.{10 + i}"
    for ns in (router, inside):
        _add_namespace(topology, ns)
    _uplink(topology.wan.ns, router, "wan0", f"r{i}", f"{router_wan}/24")
    ip("-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", inside)
    ip("-n", router, "addr", "add", f"198.19.{i}.1/24", "dev", "lan0")
    ip("-n", router, "link", "set", "lan0", "up")
    ip("-n", inside, "addr", "add", f"198.19.{i}.2/24", "dev", "eth0")
    ip("-n", inside, "link", "set", "eth0", "up")
    ip("-n", inside, "route", "add", "default", "via", f"198.19.{i}.1")
    run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    subprocess.run(
        ["ip", "netns", "exec", router, "nft", "-f", "-"],
        input=_router_ruleset(symmetric),
        text=True,
        check=True,
        capture_output=True,
        timeout=30,
    )
    return Host(inside, f"198.19.{i}.2", router, router_wan)


__all__ = ["Host", "Topology", "clean_leftovers", "nat_topology", "unavailable"]
