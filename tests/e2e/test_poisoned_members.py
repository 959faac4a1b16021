"""Issue 25, end to end: a run of four real `psyche-client train` processes on loopback, one of them
hostile (`tests/e2e/hostile_client.py`: its first result honest, every later one a lie that
hashes to its commitment and passes every check of its bytes), with every client a witness
(`witness_nodes = 0`: the checks decide by majority; with one witness a round the hostile member
attests its own lies whenever it is elected, see docs/reliability.md, "Poisoned results").

* DisTrO, sign-flipped results: no honest client applies any of the hostile member's lies, the
  coordinator drops it (a trainer without witness quorum is health-checked out, as for a missing
  result), and the three honest clients finish the run with the same model.

The loss against a three-client honest run is a benchmark figure (`scripts/bench/poison.py` for
the simulations), not asserted here: two runs of real processes train different batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ..processes import Proc, Processes, events
from .hostile_run import HOSTILE, short_id, start_hostile_run

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def assignees(client: Proc) -> dict[tuple[int, str], str]:
    """(step, batch) -> the short id of the client it was assigned to, as `client` saw it."""
    out = {}
    for start in events(client, "round_start"):
        for entry in start["assignments"]:
            batch, who = entry.rsplit("=", 1)
            out[(start["step"], batch)] = who
    return out


def test_a_hostile_members_lies_are_never_applied_and_the_honest_clients_agree(
    processes: Processes, tmp_path: Path
) -> None:
    run = start_hostile_run(
        processes, tmp_path / "run", "sign-flip", 1, total_steps=14, epoch_time=40,
        witness_nodes=0, init_min_clients=4, min_clients=3,
    )  # fmt: skip
    server, honest, hostile = run.server, run.honest, run.hostile
    # the coordinator drops it: its lies get no witness quorum
    processes.wait_for(server, rf"{short_id(HOSTILE)} did not deliver", 240)
    outcomes: list[Any] = []
    for client in honest:
        assert client.popen.wait(600) == 0, client.text()[-4000:]
        assert events(client, "run_finished"), client.text()[-3000:]
        last = events(client, "cooldown_model")[-1]
        outcomes.append((last["epoch"], last["step"], last["model_hash"]))
    processes.stop(hostile)
    assert len(set(outcomes)) == 1, outcomes  # the three honest clients hold one model

    # what it trained, in order: its first result honest, every later one a lie
    trained = events(hostile, "trained_batch")
    assert len(trained) >= 2, hostile.text()[-3000:]
    lies = {(e["step"], str(e["batch_id"])) for e in trained[1:]}
    for client in honest:
        seen = assignees(client)
        assert any(who == short_id(HOSTILE) for who in seen.values())  # it was given batches
        for applied in events(client, "applied_results"):
            for batch in applied["batches"]:
                key = (applied["step"] - 2, str(batch))  # a round's results apply two later
                assert key not in lies, (client.name, key)
    # honest clients applied honest results throughout (the run trained)
    applied_batches = [b for e in events(honest[0], "applied_results") for b in e["batches"]]
    assert len(applied_batches) >= 6, honest[0].text()[-3000:]
