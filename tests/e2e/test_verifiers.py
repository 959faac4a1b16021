"""Issue 27, end to end: four real `psyche-client train` processes on loopback in a run with
`verification_percent = 50` (each round: one tie-breaker, one verifier, two trainers), one of
them hostile (`tests/e2e/hostile_client.py`: every result it sends sign flipped). Whenever it
trains, the round's verifier recomputes its batch and accuses it, the tie-breaker's recompute
agrees, and the server drops and bans it: within three rounds of its first lie. No honest
member is accused.

Lean on purpose (the suite's time budget): it stops at the punishment, not at the run's end.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ..processes import Processes, events
from .hostile_run import HONEST, HOSTILE, short_id, start_hostile_run

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_a_verifier_catches_a_lying_trainer_and_the_tie_breaker_confirms(
    processes: Processes, tmp_path: Path
) -> None:
    run = start_hostile_run(
        processes, tmp_path / "run", "sign-flip", 0, total_steps=20, epoch_time=60,
        witness_nodes=0, init_min_clients=4, min_clients=3, verification_percent=50,
    )  # fmt: skip
    server, honest, hostile = run.server, run.honest, run.hostile
    punished = processes.wait_for(
        server, rf"verification: {short_id(HOSTILE)} loses \(trainer\).*? at step (\d+)", 240
    )
    step = int(punished.group(1))
    # within three rounds of its first lie
    trained = events(hostile, "trained_batch")
    assert trained, hostile.text()[-3000:]
    first_lie = trained[0]["step"]
    assert step <= first_lie + 2, (step, first_lie)
    # the server banned it, and nobody else lost anything
    assert re.search(rf"{short_id(HOSTILE)} did not deliver \(verification", server.text())
    losers = set(re.findall(r"verification: (\w+) loses", server.text()))
    assert losers == {short_id(HOSTILE)}, losers
    # what the honest verifiers and tie-breakers found: the lie, and honest results as honest
    findings = [e for client in honest for e in events(client, "verification")]
    assert any(not e["matches"] and e["trainer"] == short_id(HOSTILE) for e in findings)
    honest_ids = {short_id(n) for n in HONEST}
    assert all(e["matches"] for e in findings if e["trainer"] in honest_ids), findings
    assert any(e["trainer"] in honest_ids for e in findings)
