"""A child process with no network at all: `argv(command)` runs `command` in a network namespace
of its own that holds nothing but a loopback interface that is down (`unshare --net`, inside a
user namespace of its own where the test is not root). Every socket the command opens fails
there at once: no route leads anywhere, so no packet can leave, not even to loopback. The
namespace has no name and needs no teardown: it goes away with the last process in it.

What this is for: a real name lookup that fails without asking anyone. The system resolver
(glibc's `getaddrinfo`, through `socket.getaddrinfo`) cannot reach the name server that
/etc/resolv.conf names and fails at once with a real `socket.gaierror` ("temporary failure in
name resolution"), where a lookup in the test's own namespace would send a DNS query out of the
machine (and stall where the resolver is slow). A resolver daemon reached through a Unix socket
lives outside the namespace and would ask on the child's behalf: systemd-resolved (the
`resolve` NSS module) never does for a name under `.invalid` (RFC 6761, what the tests look
up), and where nscd runs (its socket exists) there is no such guarantee: `unavailable()` says so.

`unavailable()` says why a child cannot be cut off so here (the `unshare` command missing, user
namespaces refused, nscd running), for tests to skip with that reason.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

NSCD_SOCKET = Path("/var/run/nscd/socket")
"""Where glibc asks nscd first, before its own resolver."""


def _unshare() -> list[str]:
    """root can make a network namespace directly (user namespaces may be off); anyone else
    first makes a user namespace in which they are root."""
    if os.geteuid() == 0:
        return ["unshare", "--net"]
    return ["unshare", "--user", "--map-root-user", "--net"]


@functools.cache
def unavailable() -> str | None:
    """Why a process cannot be started here with no network and no resolver, or None."""
    if NSCD_SOCKET.exists():
        return f"nscd runs here ({NSCD_SOCKET}): it would look names up outside the namespace"
    if shutil.which("unshare") is None:
        return "the `unshare` command (util-linux) is not installed"
    probe = subprocess.run(
        [*_unshare(), "true"], capture_output=True, text=True, timeout=30, check=False
    )
    if probe.returncode != 0:
        return f"cannot make a network namespace: {probe.stderr.strip()}"
    return None


def argv(command: list[str]) -> list[str]:
    """`command` run in a new network namespace with only a down loopback in it."""
    return [*_unshare(), "--", *command]


__all__ = ["argv", "unavailable"]
