"""Issue 27's cost goal, end to end (`config.verifiers_train`): four real `psyche-client train`
processes on loopback at `verification_percent = 25` where the verifier and the tie-breaker train
a share too, one of them hostile twice over (sign-flipped results, every verified result accused
as a verifier; tests/e2e/test_verifiers.py's run with the option on). Every member trains every
round; the hostile one is still punished within three rounds of its first lie; an honest
verifier's recomputes come after its own training (in the round's idle time: whether they end
within the round is a timing figure, `scripts/bench/verify.py --cost`, not asserted here), and
no honest member is accused.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from ..processes import Processes, events
from ..timing import Deadline
from .hostile_run import HONEST, HOSTILE, short_id, start_verifying_run

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_verifiers_that_train_still_punish_the_liar_and_check_within_the_round(
    processes: Processes, tmp_path: Path
) -> None:
    punished = start_verifying_run(processes, tmp_path / "run", "verifiers_train = true")
    step, committees = punished.step, punished.committees
    server, honest, hostile = punished.run.server, punished.run.honest, punished.run.hostile
    assert step <= min(committees) + 2, (step, committees)  # it lies every round from its first
    losers = set(re.findall(r"verification: (\w+) loses", server.text()))
    assert losers == {short_id(HOSTILE)}, losers
    # every member trained in every round it had that is over (a later one started),
    # whatever its committee
    for client in (*honest, hostile):
        started = {e["step"]: e["committee"] for e in events(client, "round_start")}
        trained = {e["step"] for e in events(client, "trained_batch")}
        over = [s for s in started if s + 1 in started]
        assert over, (client.name, started)
        assert [s for s in over if s not in trained] == [], (client.name, started, trained)

    # an honest verifier's recomputes of a round come after its own training of that round (a
    # tie-breaker's come in the next round, by design); the run goes on after the punishment
    # until one such round is over
    def verifier_rounds_checked() -> int:
        checked = 0
        for client in honest:
            starts = {e["step"]: e for e in events(client, "round_start")}
            own = {e["step"]: e["ts"] for e in events(client, "trained_batch")}
            for e in events(client, "verification_recomputed"):
                step = e["step"]
                if starts[step]["committee"] == "Verifier" and step + 1 in starts:
                    assert own.get(step) is not None, (client.name, "no own training", e)
                    assert own[step] <= e["ts"], (client.name, e)
                    checked += 1
        return checked

    deadline = Deadline(120)
    while not verifier_rounds_checked():
        assert not deadline.expired(), f"no honest verifier's round was over in {deadline}"
        assert server.popen.poll() is None, server.text()[-2000:]
        time.sleep(1)
    honest_ids = {short_id(n) for n in HONEST}
    findings = [e for client in honest for e in events(client, "verification")]
    assert all(e["matches"] for e in findings if e["trainer"] in honest_ids), findings
