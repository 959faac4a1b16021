"""`config.verifiers_train` on Solana, end to end and short: the owner's `update-config` turns
it on for a run at `verification_percent = 25` on a local endpoint (its own process), five real
`psyche-solana-client train` processes follow it, and every member trains in every round that
is over, whatever its committee (the verifier and the tie-breaker included: before, a Solana
run refused the option and its verifiers trained nothing); the verifier's checks still reach
the program, every one matching (all five are honest), and `show --json` says the run's
verifiers train. Five members, not four: a round's verifier then has a pool of three batches
(the three trainers'; the tie-breaker's and its own are in no pool) and checks the two its
draw picks, so its report goes with its `Ed25519SigVerify` precompile instruction, which the
program reads back from the instructions sysvar: `show --json` keeps the accepted draw (at four
members the pool is two batches, checked whole, without a draw). The punishment path with the
option on is tests/e2e/test_verifiers_train.py's (centralized); the program's rules with it
are tests/solana/test_verifiers_train.py's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from psyche.cli.solana_client.main import main as solana_client

from ..processes import Proc, events
from ..timing import MAX_SCALE, Deadline
from .processes import Processes, create_run, free_port, member_train_argv, start_endpoint
from .support import VERIFYING, solana_client_output

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(360 * MAX_SCALE)]

RUN_ID = "solana-verifiers-train"
MEMBERS = ("a", "b", "c", "d", "e")
CONFIG = {**VERIFYING, "init_min_clients": len(MEMBERS), "verifiers_train": True}


def rounds_over(client: Proc) -> list[int]:
    """The steps `client` started that are over (it started the next one)."""
    started = {e["step"] for e in events(client, "round_start")}
    return [s for s in started if s + 1 in started]


def drawn_rounds(dumped: dict[str, Any]) -> list[dict[str, Any]]:
    """The kept rounds of `show --json` with a verifier's draw among their reports."""
    return [r for r in dumped["verification"]["rounds"] if r["draws"]]


def test_every_member_of_a_solana_run_trains_when_verifiers_train(tmp_path: Path) -> None:
    processes = Processes(tmp_path)
    try:
        endpoint = start_endpoint(processes, tmp_path, ("owner", *MEMBERS))
        cluster = create_run(endpoint, tmp_path, RUN_ID, CONFIG)
        assert solana_client(["set-paused", "--run-id", RUN_ID, "--resume", *cluster]) == 0
        ports = {name: free_port() for name in MEMBERS}
        clients = [
            processes.start(
                f"client-{name}",
                [sys.executable, "-m", "psyche.cli.solana_client.main",
                 *member_train_argv(endpoint, RUN_ID, name, ports)],
                env={"OMP_NUM_THREADS": "1", "CLIENT_VERSION": "test"},
            )
            for name in MEMBERS
        ]  # fmt: skip

        # Two rounds over at every member, and one verifier's finding heard.
        deadline = Deadline(300 * MAX_SCALE)
        while not (
            all(len(rounds_over(c)) >= 2 for c in clients)
            and any(events(c, "verification") for c in clients)
        ):
            for client in clients:
                assert client.popen.poll() is None, client.text()[-4000:]
            assert not deadline.expired(), [c.text()[-2000:] for c in clients]
            time.sleep(1)
        # ... and a round whose verifier's drawn report the program accepted (its report
        # arrives in the round's witness phase: the kept rounds may not hold one yet)
        show = ["show", "--run-id", RUN_ID, "--json", "--rpc", endpoint.rpc]
        while True:
            dumped = json.loads(solana_client_output([*show, "--ws-rpc", endpoint.ws]))
            if drawn_rounds(dumped):
                break
            assert not deadline.expired(), dumped["verification"]["rounds"]
            time.sleep(1)
    finally:
        processes.stop_all()

    assert dumped["verification"]["verifiers_train"] is True
    for client in clients:
        started = {e["step"]: e["committee"] for e in events(client, "round_start")}
        trained = {e["step"] for e in events(client, "trained_batch")}
        over = rounds_over(client)
        assert [s for s in over if s not in trained] == [], (client.name, started, trained)
    # every member held each committee's share: the verifier and the tie-breaker trained too
    committees_trained = {
        e["committee"]
        for c in clients
        for e in events(c, "round_start")
        if e["step"] in rounds_over(c)
    }
    assert {"Verifier", "TieBreaker"} <= committees_trained, committees_trained
    # The drawn reports: two of the verifier's pool of three, every one matching, each with
    # the draw signature its precompile instruction carried.
    for round_ in drawn_rounds(dumped):
        for verifier, draw in round_["draws"].items():
            duties = round_["duties"]
            pool = {d["batch"] for d in duties if d["verifier"] == verifier}
            assert {d["role"] for d in duties if d["verifier"] == verifier} == {"verifier"}
            assert len(pool) == 3, round_
            checked = round_["reports"][verifier]
            assert len(checked) == 2, round_
            assert {f["batch"] for f in checked} < pool, round_
            assert all(f["matches"] for f in checked), round_
            assert len(bytes.fromhex(draw)) == 64
    findings = [e for c in clients for e in events(c, "verification")]
    assert findings
    assert all(e["matches"] for e in findings), findings
    assert not [e for e in dumped["verification"]["log"] if e["kind"] == "punished"]
