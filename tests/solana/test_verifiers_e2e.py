"""Issue 27 on Solana, end to end: four real `psyche-solana-client train` processes on a local
endpoint (its own process) in a run with `verification_percent = 25` (each round one
tie-breaker, one verifier, two trainers), one of them hostile twice over
(tests/solana/hostile_solana_client.py: sign-flipped results as a trainer, every verified result
accused as a verifier, honest as tie-breaker). The clients' own verifiers and tie-breakers
recompute, send their reports as `verification_report` transactions, and the coordinator
program decides: the hostile member is dropped and slashed, the members that found it out
credited, whichever role it lied in first; `show --json` and the honest clients' logs say so.

Lean on purpose (the suite's time budget): it stops at the punishment.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ..timing import MAX_SCALE
from .processes import (
    Processes,
    json_events,
    wait_event,
)
from .support import VERIFYING
from .verification_support import SLASHING_RATE, open_verifying_run, shown_run, start_members

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420 * MAX_SCALE)]

RUN_ID = "solana-verify"


def test_the_program_punishes_the_member_that_lied(tmp_path: Path) -> None:
    processes = Processes(tmp_path)
    try:
        endpoint = open_verifying_run(processes, tmp_path, RUN_ID, VERIFYING)
        wallets = endpoint.wallets

        honest, _ = start_members(
            processes, endpoint, RUN_ID, "sign-flip", {"HOSTILE_VERIFIER": "1"}
        )
        hostile = str(wallets["hostile"].pubkey())
        # The honest clients' watcher logs the program's punishment.
        punished = wait_event(honest[0], "verification_punished", lambda e: True, 360 * MAX_SCALE)
        dumped = shown_run(endpoint, RUN_ID)
    finally:
        processes.stop_all()

    log = dumped["verification"]["log"]
    # One punishment per dispute it lost (a lying verifier accused both trainers), slashed
    # once.
    punishments = [e for e in log if e["kind"] == "punished"]
    assert punishments
    assert {e["subject"] for e in punishments} == {hostile}
    assert {e["role"] for e in punishments} <= {"trainer", "verifier"}
    assert sum(e["slashed"] for e in punishments) == SLASHING_RATE
    punishment = punishments[0]
    assert punishment["slashed"] == SLASHING_RATE
    assert punishment["credited"]
    assert hostile not in punishment["credited"]
    assert punished["step"] == punishment["step"]
    clients = dumped["coordinator_account"]["clients"]
    assert clients[hostile]["slashed"] == SLASHING_RATE
    assert sum(c["slashed"] for c in clients.values()) == SLASHING_RATE
    for credited in punishment["credited"]:
        assert clients[credited]["earned"] >= punishment["credit_each"] > 0
    # No honest member accused an honest member: every "does not match" finding is about the
    # hostile one, or the hostile one's lie.
    verified = [e for e in log if e["kind"] == "verified"]
    assert verified
    assert all(hostile in (e["subject"], e["by"]) for e in verified if not e["matches"])
    assert hostile in dumped["verification"]["bans"]
    # Health checks named nobody honest: a verifying run judges the trainers of the round the
    # witnesses attest, so a member that verified then and trains now owed them nothing (the
    # witnesses once dropped such a member, which then exited on `LeftRun`).
    hostile_node = bytes(wallets["hostile"].pubkey())[:4].hex()  # as a log names a member
    for client in honest:
        for check in json_events(client.text(), "health_check"):
            assert set(check["unhealthy"]) <= {hostile_node}, (client.name, check)
