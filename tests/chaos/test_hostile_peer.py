"""The long hostile-peer scenario (`just chaos`; CI runs the short one in test_chaos_short.py):
a hostile member among three real clients for 60 s, rejoining every epoch after it is dropped,
playing every payload lie in turn. Each lie is refused, the honest clients' models stay identical
and never take in the offender's batches, the offender loses its place through the honest
witnesses' health checks (a witness attests only a payload that hashes right, decodes for this
model and passes its checks: `psyche.modeling.screening`), and no process falls over."""

from __future__ import annotations

from typing import Any

import pytest

from .offender import offenders_batches_refused

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.chaos_long]

ADVERSARY = 66
MODES = "invalid-payload,hash-mismatch,wrong-step,garbage-blob,oversized-blob,invalid-payload"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from cluster import RunSpec
    from scenarios import Scenario, run_captured, start_adversary

    scenario = Scenario(
        "hostile",
        "a hostile member among three clients",
        60,
        None,
        RunSpec(num_clients=3, config={"init_min_clients": 4, "witness_nodes": 0}),
        extra=start_adversary(ADVERSARY, MODES),
    )
    return run_captured(scenario, tmp_path_factory.mktemp("hostile"))


def test_no_process_falls_over(run: dict[str, Any]) -> None:
    assert not run["result"].unexpected_exits, run["result"].unexpected_exits


def test_every_lie_was_told(run: dict[str, Any]) -> None:
    from metrics import of

    told = {e["mode"] for e in of(run["nodes"]["adversary"][0], "attack")}
    assert set(MODES.split(",")) | {"raw-frames", "unassigned", "forged", "replay"} <= told, told


def test_honest_models_stay_identical_without_the_offenders_batches(run: dict[str, Any]) -> None:
    from cluster import client_short_id
    from metrics import of

    result = run["result"]
    assert result.epochs_checked >= 1, result.model_problems  # no cooldown compared proves nothing
    assert result.models_identical, result
    assert not result.applied_problems, result
    offender = client_short_id(ADVERSARY)
    nodes = run["nodes"]
    events = nodes["client-1"][0]
    applied = {e["step"]: set(e["batches"]) for e in of(events, "applied_results")}
    trained = {
        (e["step"], e["batch_id"])
        for name, (evs, _) in nodes.items()
        if name.startswith("client-")
        for e in of(evs, "trained_batch")
    }
    # the offender was given work whose round was applied: its results were there to refuse
    assert offenders_batches_refused(events, offender) >= 1
    for step, batches in applied.items():
        assert all((step - 2, b) in trained for b in batches), (step, batches)


def test_every_lie_is_refused_and_logged(run: dict[str, Any]) -> None:
    nodes = run["nodes"]
    honest = "\n".join(text for name, (_, text) in nodes.items() if name.startswith("client-"))
    for evidence in (
        '"payload_invalid"',  # decodable, hashes right, no result of this model
        "payload hash does not match the commitment",
        "the announcement for step",  # a payload for another step
        "undecodable blob",  # random bytes for a payload
        "exceeds the limit",  # an announced blob beyond any client's limit
        "Invalid signature on commitment",  # a commitment signed by another key
        "dropping gossip message",  # broken envelope, impersonation, junk
    ):
        assert evidence in honest, evidence
    # a Join for another run is refused, with the reason (since issue 24, item 11)
    assert "unknown run id 'another-run'" in nodes["server"][1]


def test_the_offender_loses_its_place(run: dict[str, Any]) -> None:
    from metrics import of

    server = run["nodes"]["server"][1]
    assert "Dropped 1 clients from health check" in server
    assert of(run["nodes"]["adversary"][0], "dropped")
