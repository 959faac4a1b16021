"""Exact verification (followers, issue 27) on Solana, end to end: four real
`psyche-solana-client train` processes on a local endpoint (its own process) in a run with
`verification_percent = 25` and `exact_verification_threads = 1` (set by the owner's
`update-config`, kept in the run's verification account). The hostile member adds a bias of
1 % of its update's norm in a fixed direction to every result (`Attack.Bias`, which the
statistical verifiers cannot see) and reports nothing as a follower (`HOSTILE_FOLLOWER=silent`).
Its three followers (the three honest members) rebuild its commitment, find it differs and send
their follower reports as `verification_report` transactions; the coordinator program convicts
it on their three words: dropped, banned, slashed, the three credited; `show --json` says so.
The centralized twin is tests/e2e/test_verifiers.py's
`test_followers_catch_a_one_percent_bias_the_statistics_cannot_see`; the program's rules are
tests/solana/test_following.py's.

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

RUN_ID = "solana-follow"


def test_three_followers_convict_a_biased_trainer_through_the_program(tmp_path: Path) -> None:
    processes = Processes(tmp_path)
    try:
        endpoint = open_verifying_run(
            processes, tmp_path, RUN_ID, {**VERIFYING, "exact_verification_threads": 1}
        )
        wallets = endpoint.wallets

        honest, liar = start_members(
            processes, endpoint, RUN_ID, "bias", {"HOSTILE_FOLLOWER": "silent"}
        )
        hostile = str(wallets["hostile"].pubkey())
        punished = wait_event(honest[0], "verification_punished", lambda e: True, 360 * MAX_SCALE)
        dumped = shown_run(endpoint, RUN_ID)
    finally:
        processes.stop_all()

    verification = dumped["verification"]
    assert verification["exact_verification_threads"] == 1
    log = verification["log"]
    (punishment,) = [e for e in log if e["kind"] == "punished"]
    assert punishment["subject"] == hostile
    assert punishment["role"] == "trainer"
    assert punishment["slashed"] == SLASHING_RATE
    honest_keys = {str(wallets[n].pubkey()) for n in "abc"}
    assert set(punishment["credited"]) == honest_keys
    assert punished["step"] == punishment["step"]
    # caught within three rounds of its first lie (the goal): it lies from its first
    # training round, which the seed may put a few rounds in (each round it is one of two
    # trainers of four)
    lied = [e["step"] for e in json_events(liar.text(), "trained_batch")]
    assert lied
    assert min(lied) <= punishment["step"] <= min(lied) + 2, (punishment["step"], lied)
    print(f"first lie at step {min(lied)}, convicted at step {punishment['step']}")
    followed = [e for e in log if e["kind"] == "followed"]
    # the three honest followers found the biased commitment differs; every honest commitment
    # they followed was rebuilt bit for bit (nobody honest accused)
    caught = [e for e in followed if e["subject"] == hostile and e["step"] == punishment["step"]]
    assert {e["by"] for e in caught} == honest_keys
    assert not any(e["matches"] for e in caught)
    assert all(e["matches"] for e in followed if e["subject"] in honest_keys), followed
    clients = dumped["coordinator_account"]["clients"]
    assert clients[hostile]["slashed"] == SLASHING_RATE
    assert sum(c["slashed"] for c in clients.values()) == SLASHING_RATE
    assert hostile in verification["bans"]
    # the clients logged what they followed (psyche.client.round.follow)
    for client in honest:
        assert json_events(client.text(), "followed"), client.name
