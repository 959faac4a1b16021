"""`psyche-server relay` as a process on loopback: it prints the address clients take with
`--iroh-relay`, gives a slot to a key of `--authorized-keys` and none to a stranger, stops
cleanly on SIGINT, and refuses to start with nobody to serve."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import trio

from psyche.core.identity import SecretKey
from psyche.network.testing import open_nodes, wait_until

from ..processes import REPO, Processes, free_port

DEADLINE = 60


def relay_command(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "psyche.cli.server",
        "relay",
        "--bind-address",
        "127.0.0.1",
        *args,
    ]


def test_the_relay_serves_its_authorized_keys_only(tmp_path: Path) -> None:
    member, stranger = SecretKey.generate(), SecretKey.generate()
    keys = tmp_path / "members.txt"
    keys.write_text(f"# the run's clients\n{member.public_key.hex()}\n")
    SecretKey.generate().write_file(tmp_path / "relay.key")
    processes = Processes(tmp_path)
    relay = processes.start(
        "relay",
        relay_command(
            "--relay-port", str(free_port()), "--authorized-keys", str(keys),
            "--identity-secret-key-path", str(tmp_path / "relay.key"),
        ),
    )  # fmt: skip
    try:
        line = processes.wait_for(relay, r"clients take --iroh-relay (\S+)", DEADLINE)
        address = line.group(1)

        async def main() -> None:
            for key, wanted in ((member, "reserved"), (stranger, "unreachable")):
                async with open_nodes(1, keys=[key], relays=(address,), reachability="private") as (
                    node,
                ):
                    await wait_until(
                        lambda n=node: (
                            [r.state for r in n.reachability.relays.values()]
                            in (["reserved"], ["unreachable"])
                        ),
                        DEADLINE,
                    )
                    states = [r.state for r in node.reachability.relays.values()]
                    assert states == [wanted], (key.public_key.hex(), states)

        trio.run(main)
        assert processes.stop(relay) == 0  # SIGINT: a clean stop
    finally:
        processes.stop_all()
    text = relay.text()
    assert "got SIGINT, shutting down" in text, text
    assert re.search(r"refusing inbound connection from \S+: not in allowlist", text), text
    assert "Traceback" not in text, text


def test_the_relay_refuses_to_start_with_nobody_to_serve() -> None:
    done = subprocess.run(
        relay_command(), cwd=REPO, capture_output=True, text=True, timeout=DEADLINE
    )
    assert done.returncode == 2
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert lines[-1].endswith("give --authorized-keys FILE (the run's members) or --open (anyone)")
    assert "Traceback" not in done.stderr
