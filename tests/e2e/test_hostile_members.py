"""Issue 13, hostile members: a real `psyche-server run` with two honest `psyche-client train`
processes on a shortened tiny CPU run, and the actors of `scripts/chaos/hostile_members.py`.

* A private run (`--authorized-keys`): a key it does not list is refused at login; a listed key
  that never joins sends 500 each of Checkpoint, Witness and HealthCheck. Upstream broadcast the
  whole run state to every client for each Checkpoint (83 times the normal traffic); now the
  bytes the server sends the first client (through a counting proxy) in the window of spam stay
  within `TRAFFIC_FACTOR` of a quiet window just before. The run finishes, both clients exit 0
  with the same model.
* A silent member joins and never delivers, and reconnects whenever it stops being a member.
  It is dropped (a health check, or the round it should have witnessed ends without a witness)
  and named; the next epoch runs with the two honest clients only, although it is connected and
  has joined again, and every batch of that epoch is trained and applied. The run finishes, both
  clients exit 0 with the same model (an honest client too slow for a round on a starved
  machine may be banned too: it sits out an epoch and comes back).

Without the fixes the first test fails on the traffic factor (one broadcast per Checkpoint) and
on the refused key (served), the second because the silent member is back in the next epoch.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from ..processes import REPO, Processes, events, free_port, wait_event
from ..timing import scaled

sys.path.insert(0, str(REPO / "scripts" / "chaos"))
import hostile_members as hm

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

TRAFFIC_FACTOR = 2.0
WINDOW = 4.0
SPAMMER, STRANGER, SILENT = 77, 99, 66
LOOPBACK = ("--bind-address", "127.0.0.1")  # the coordinator and its data server


def short_id(number: int) -> str:
    return hm.test_key(number).public_key[:4].hex()


def start_honest(processes: Processes, port: int, *, proxy_port: int | None = None) -> list[Any]:
    return [
        processes.start(
            f"client-{n}",
            hm.client_command(proxy_port if (n == 1 and proxy_port) else port),
            env={"RAW_IDENTITY_SECRET_KEY": f"{n:064x}"},
        )
        for n in (1, 2)
    ]


def finish_with_the_same_model(processes: Processes, clients: list[Any], timeout: float) -> None:
    """Both clients reach Finished, exit 0 and end with the same model."""
    for client in clients:
        code = client.popen.wait(scaled(timeout))
        assert code == 0, client.text()[-4000:]
    finals = []
    for client in clients:
        assert events(client, "run_finished"), client.text()[-3000:]
        last = events(client, "cooldown_model")[-1]
        finals.append((last["epoch"], last["step"], last["model_hash"]))
    assert finals[0] == finals[1], finals


def test_a_private_run_refuses_strangers_and_a_non_members_spam_is_not_amplified(
    processes: Processes, tmp_path: Path
) -> None:
    run = hm.write_run(tmp_path / "run", total_steps=12, epoch_time=60)
    keys = tmp_path / "authorized_keys"
    keys.write_text(
        "# the honest clients and a key that never joins\n"
        + "".join(f"{hm.test_key(n).public_key.hex()}\n" for n in (1, 2, SPAMMER))
    )
    port = free_port()
    server = processes.start(
        "server", hm.server_command(run, port, *LOOPBACK, "--authorized-keys", str(keys))
    )
    processes.wait_for(
        server,
        r"serving run 'tiny-cpu' on port \d+ \(127\.0\.0\.1\); private run: 3 authorized keys",
        60,
    )
    data_port = re.search(r"127\.0\.0\.1:(\d+)", (run / "state.toml").read_text()).group(1)  # type: ignore[union-attr]
    assert f"training data server listening on 127.0.0.1:{data_port}" in server.text()
    address = f"127.0.0.1:{port}"
    with hm.CountingProxy(port) as proxy:
        clients = start_honest(processes, port, proxy_port=proxy.port)
        # a key the run does not list: its handshake is fine, then the server hangs up
        stranger = processes.start(
            "stranger", hm.actor_command("spam", "--server-addr", address, "--key-number",
                                         str(STRANGER), "--count", "1"),
        )  # fmt: skip
        processes.wait_for(stranger, r'"refused"', 60)
        processes.wait_for(
            server, rf"key {hm.test_key(STRANGER).public_key.hex()} is not allowed", 10
        )

        wait_event(clients[0], "applied_results", lambda e: True, 180)
        go = tmp_path / "go"
        spammer = processes.start(
            "spammer", hm.actor_command("spam", "--server-addr", address, "--key-number",
                                        str(SPAMMER), "--count", "500", "--go-file", str(go)),
        )  # fmt: skip
        processes.wait_for(spammer, r'"ready"', 60)
        start = proxy.bytes_down()
        hm.time.sleep(WINDOW)
        quiet = proxy.bytes_down() - start
        start = proxy.bytes_down()
        go.touch()
        processes.wait_for(spammer, r'"sent"', 30)
        hm.time.sleep(WINDOW)
        spammed = proxy.bytes_down() - start
        processes.stop(spammer)
        assert quiet > 0
        assert spammed < TRAFFIC_FACTOR * quiet, (quiet, spammed)
        text = server.text()
        assert f"ignoring a Checkpoint from {short_id(SPAMMER)}" in text, text[-3000:]
        assert "ignoring a HealthCheck" in text
        assert "ignoring a Witness" in text
        assert text.count("ignoring a Checkpoint") == 1  # the rest are counted, not logged
        finish_with_the_same_model(processes, clients, 240)


def test_a_silent_member_is_dropped_and_sits_out_the_next_epoch(
    processes: Processes, tmp_path: Path
) -> None:
    # epoch 0 trains about 4-8 steps, the silent member's epoch 1-5: the run ends in or after
    # the epoch it sits out
    run = hm.write_run(tmp_path / "run", total_steps=18, epoch_time=10, max_round_train_time=8)
    port = free_port()
    server = processes.start("server", hm.server_command(run, port, *LOOPBACK))
    processes.wait_for(server, r"serving run 'tiny-cpu' .*open run: anyone may join", 60)
    clients = start_honest(processes, port)
    processes.wait_for(server, r"-> RoundTrain \(epoch 0", 180)
    silent = processes.start(
        "silent", hm.actor_command("silent", "--server-addr", f"127.0.0.1:{port}",
                                   "--run-id", "tiny-cpu", "--key-number", str(SILENT)),
    )  # fmt: skip
    member = wait_event(silent, "member", lambda e: True, 120)
    banned = processes.wait_for(
        server, rf"{short_id(SILENT)} did not deliver \((.*)\): left out of the run's epochs "
        r"before (\d+)", 120,
    )  # fmt: skip
    sits_out = int(banned.group(2)) - 1
    assert sits_out == member["epoch"] + 1  # --ban-epochs 1 (the default)
    # it comes back at once, joins again, and waits while the next epoch starts without it (this
    # ban's come-back: the line is logged whether or not its old Join was still pending)
    wait_event(silent, "joined", lambda e: e["ts"] > member["ts"], 120)
    processes.wait_for(
        server,
        rf"added pending client {short_id(SILENT)}; it sits out the epochs before "
        rf"{banned.group(2)} ",
        120,
        after=banned.end(),
    )
    started = processes.wait_for(
        server, rf"-> Warmup \(epoch {sits_out}, step (\d+), (\d+) clients\)", 120
    )
    assert started.group(2) == "2", server.text()[-3000:]
    first_step = int(started.group(1))
    ended = processes.wait_for(server, rf"epoch {sits_out} finished at step (\d+)|-> Finished", 180)
    processes.stop(silent)
    finish_with_the_same_model(processes, clients, 240)

    # the epoch it sat out: two clients, every batch assigned to them, all trained and applied
    rounds = [e for e in events(clients[0], "round_start") if e["epoch"] == sits_out]
    assert rounds, clients[0].text()[-3000:]
    for start in rounds:
        assert start["clients"] == 2
        assert not any(a.endswith(f"={short_id(SILENT)}") for a in start["assignments"])
    applied = {e["step"]: e["batches"] for e in events(clients[0], "applied_results")}
    assigned = {s["step"]: sorted(a.split("=")[0] for a in s["assignments"]) for s in rounds}
    last = int(ended.group(1)) if ended.group(1) else max(assigned)
    # results are applied two steps later; the epoch's last two rounds train nothing
    for step, batches in assigned.items():
        if first_step <= step and step + 2 <= last and batches:
            assert sorted(applied.get(step + 2, [])) == batches, (step, applied, assigned)
    applying = range(first_step + 2, last + 1)
    untrained = [e for e in events(clients[0], "untrained_batch") if e["step"] in applying]
    assert not untrained, untrained
    # The silent member was banned. So may an honest client be on a starved machine (a round's
    # training that outlasts `max_round_train_time`, seen at 7.8 s for this tiny model in CI:
    # nobody can tell that from a refusal); then it sat out and came back (the run still ended
    # with both clients' models identical, above).
    bans = re.findall(r"(\w+) did not deliver \(([^)]*)\)", server.text())
    assert short_id(SILENT) in {who for who, _ in bans}
