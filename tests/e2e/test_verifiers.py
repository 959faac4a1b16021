"""Issue 27, end to end: four real `psyche-client train` processes on loopback in a run with
`verification_percent = 25`, the issue's goal (each round: one tie-breaker, one verifier, rounded
up from 25 % of the other three, and two trainers; 50 % elects the same committees), one of
them hostile twice over (`tests/e2e/hostile_client.py`): as a trainer every result it sends is
sign flipped, as a verifier it accuses every result it verified (as tie-breaker it is honest).
In the first round it is trainer or verifier, the honest verifier's accusation or its own false
one meets the honest tie-breaker's verdict, and the server drops and bans it as the liar it
was in that round: within three rounds of its first lie. No honest member is accused. The
tie-breaker of a round recomputes only its disputed batches, in the next round, from the
weights it saved (`psyche.client.round.verify`). (Which role it has first is the round seed's
choice; tests/coordinator/test_server_verification.py and
tests/centralized/test_server_verification.py take both paths every time.)

Lean on purpose (the suite's time budget): it stops at the punishment, not at the run's end.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ..processes import Processes, events
from .hostile_run import HONEST, HOSTILE, short_id, start_hostile_run, start_verifying_run

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_the_tie_breaker_punishes_whoever_lied_trainer_or_verifier(
    processes: Processes, tmp_path: Path
) -> None:
    # punished for what it was in that round (checked there), within three rounds of its first lie
    punished = start_verifying_run(processes, tmp_path / "run")
    role, step, committees = punished.role, punished.step, punished.committees
    server, honest, hostile = punished.run.server, punished.run.honest, punished.run.hostile
    lied = [e["step"] for e in events(hostile, "trained_batch")]
    lied += [s for s, committee in committees.items() if committee == "Verifier"]
    assert step <= min(lied) + 2, (step, lied)
    # every round of the four: one tie-breaker, one verifier, two trainers
    by_step: dict[int, list[str]] = {}
    for client in (*honest, hostile):
        for e in events(client, "round_start"):
            by_step.setdefault(e["step"], []).append(e["committee"])
    rounds_of_four = [sorted(c) for c in by_step.values() if len(c) == 4]
    assert rounds_of_four, by_step
    assert all(c == ["TieBreaker", "Trainer", "Trainer", "Verifier"] for c in rounds_of_four)
    # the server banned it, and nobody else lost anything
    assert re.search(
        rf"{short_id(HOSTILE)} did not deliver \(verification, as {role}", server.text()
    )
    losers = set(re.findall(r"verification: (\w+) loses", server.text()))
    assert losers == {short_id(HOSTILE)}, losers
    # the tie-breaker recomputed only disputed batches, in the round after (from the weights it
    # saved): its findings are all about rounds it announced disputes of, the lie's among them
    findings = [e for client in honest for e in events(client, "verification")]
    disputed = {e["step"] for client in honest for e in events(client, "verification_disputes")}
    assert step in disputed, (step, disputed)
    assert {e["step"] for e in findings if e["role"] == "tie-breaker"} <= disputed, findings
    # what the honest verifiers and tie-breakers found: honest results as honest, and the lie
    honest_ids = {short_id(n) for n in HONEST}
    assert all(e["matches"] for e in findings if e["trainer"] in honest_ids), findings
    at_step = [e for e in findings if e["step"] == step]
    if role == "trainer":  # the honest verifier and tie-breaker found its lie
        assert any(not e["matches"] and e["trainer"] == short_id(HOSTILE) for e in at_step)
    else:  # the honest tie-breaker found right what it accused
        assert at_step
        assert all(e["matches"] and e["trainer"] in honest_ids for e in at_step)


def test_followers_catch_a_one_percent_bias_the_statistics_cannot_see(
    processes: Processes, tmp_path: Path
) -> None:
    """Exact verification (`exact_verification_threads = 1`: every member on one CPU thread):
    the hostile member adds a bias of 1 % of its update's norm in a fixed direction to every
    result (`Attack.Bias`); each trainer's three followers (here: the three others) rebuild its
    commitment bit for bit (`psyche.client.round.follow`), and their three words convict it
    within three rounds of its first lie. No honest follower accuses anybody. The hostile
    member follows too but reports nothing (`HOSTILE_FOLLOWER=silent`: its biased rebuilds would
    accuse the honest trainers and lose as a follower first; the unit tests hold that rule)."""
    run = start_hostile_run(
        processes, tmp_path / "run", "bias", 0, {"HOSTILE_FOLLOWER": "silent"},
        config_lines="exact_verification_threads = 1",
        total_steps=20, epoch_time=60, witness_nodes=0, init_min_clients=4, min_clients=3,
        verification_percent=25,
    )  # fmt: skip
    # it lies from its first training round, which the seed may put a few rounds in (each
    # round it is one of two trainers of four): three rounds from then at most
    processes.wait_for(run.hostile, r'"message": "trained_batch"', 600)
    punished = processes.wait_for(
        run.server,
        rf"verification: {short_id(HOSTILE)} loses \((\w+)\): its commitment .*? at step (\d+)"
        r" is not what (\d) of \d followers rebuilt",
        240,
    )
    role, step = punished.group(1), int(punished.group(2))
    assert role == "trainer", punished.group(0)
    lied = [e["step"] for e in events(run.hostile, "trained_batch")]
    assert lied
    assert step <= min(lied) + 2, (step, lied)
    assert re.search(
        rf"{short_id(HOSTILE)} did not deliver \(verification, as trainer", run.server.text()
    )
    losers = set(re.findall(r"verification: (\w+) loses", run.server.text()))
    assert losers == {short_id(HOSTILE)}, losers
    # the honest followers: every honest commitment rebuilt bit for bit, the biased one not
    followed = [e for client in run.honest for e in events(client, "followed")]
    honest_ids = {short_id(n) for n in HONEST}
    assert followed, "no follower compared anything"
    assert all(e["matches"] for e in followed if e["trainer"] in honest_ids), followed
    assert any(e["trainer"] in honest_ids for e in followed), followed
    caught = [e for e in followed if e["trainer"] == short_id(HOSTILE) and e["step"] == step]
    assert len(caught) == 3, caught
    assert not any(e["matches"] for e in caught), caught
