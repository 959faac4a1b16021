"""Choosing the IPv4 address to bind (upstream `--bind-interface`) and the one to announce."""

from __future__ import annotations

import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux


class InterfaceError(ValueError):
    pass


def interface_ipv4(name: str) -> str:
    """IPv4 of the interface `name`, or of the first whose name starts with it when it ends in `*`.

    Errors as upstream: `no interface with name "…" found.`
    """
    wildcard = name.endswith("*")
    wanted = name[:-1] if wildcard else name
    for _, candidate in socket.if_nameindex():
        if (candidate.startswith(wanted) if wildcard else candidate == wanted) and (
            ip := _ipv4_of(candidate)
        ):
            return ip
    raise InterfaceError(f'no interface with name "{wanted}" found.')


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(
                s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15])
            )
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def default_route_ipv4() -> str:
    """The address the kernel would use to reach the internet (no packet is sent); loopback
    when there is no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere real
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def announce_host(bind_host: str, override: str | None) -> str:
    """What peers should dial: the override (public IP behind NAT), the bound address, or the
    default-route address when bound to every interface."""
    if override:
        return override
    if bind_host in ("0.0.0.0", ""):
        return default_route_ipv4()
    return bind_host
