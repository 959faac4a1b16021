"""The chaos figures as pure functions of client events (scripts/chaos/metrics.py)."""

from __future__ import annotations

from typing import Any

from metrics import (
    Fault,
    applied_agreement,
    applied_tokens,
    batch_bounds,
    lost_assignments,
    lost_per_fault,
    median_round_seconds,
    model_agreement,
    rejoin,
)


def ev(message: str, ts: float, **fields: Any) -> dict[str, Any]:
    return {"message": message, "ts": ts, **fields}


def rounds(owner_of: dict[int, dict[str, str]]) -> list[dict[str, Any]]:
    return [
        ev("round_start", 10.0 * step, step=step, assigned=[],
           assignments=[f"{b}={o}" for b, o in table.items()])
        for step, table in owner_of.items()
    ]  # fmt: skip


def test_batch_bounds_and_tokens() -> None:
    assert batch_bounds("B[3, 5]") == (3, 5)
    events = [
        ev("applied_results", 1.0, step=3, batches=["B[0, 2]", "B[3, 7]"]),
        ev("applied_results", 5.0, step=4, batches=["B[8, 15]"]),
    ]
    assert applied_tokens(events, 128, 0.0, 2.0) == 8 * 128
    assert applied_tokens(events, 128, 0.0, 9.0) == 16 * 128


def test_lost_assignments_are_announced_but_never_applied() -> None:
    events = rounds({1: {"B[0, 3]": "a", "B[4, 7]": "b"}, 2: {"B[8, 11]": "a", "B[12, 15]": "b"}})
    events += [
        ev("applied_results", 30.0, step=3, batches=["B[0, 3]", "B[4, 7]"]),
        ev("applied_results", 40.0, step=4, batches=["B[8, 11]"]),  # b's batch of step 2 lost
    ]
    lost = lost_assignments(events)
    assert [(x.step, x.batch, x.owner) for x in lost] == [(2, "B[12, 15]", "b")]
    faults = [Fault(19.0, "sigkill", "client-2", owner="b"), Fault(19.0, "x", "y")]
    assert lost_per_fault(lost, faults, round_secs=10.0) == [1]
    assert lost_per_fault(lost, [Fault(100.0, "sigkill", "c", owner="b")], 10.0) == [0]


def test_model_agreement_and_joiners() -> None:
    same = {
        "c1": [ev("cooldown_model", 1, epoch=0, model_hash="h0")],
        "c2": [
            ev("cooldown_model", 1, epoch=0, model_hash="h0"),
            ev("loaded_model", 2, epoch=1, checkpoint="P2P(x)", model_hash="h0"),
        ],
    }
    agreement = model_agreement(same)
    assert agreement.identical
    assert agreement.epochs_checked == 1
    assert agreement.joiners_checked == 1
    differ = {**same, "c3": [ev("loaded_model", 2, epoch=1, checkpoint="P2P", model_hash="zz")]}
    assert not model_agreement(differ).identical
    split = {**same, "c3": [ev("cooldown_model", 1, epoch=0, model_hash="other")]}
    assert "differ" in model_agreement(split).problems[0]


def test_model_agreement_needs_an_epoch_compared() -> None:
    """No cooldown at all, or one logged by a single client, is no evidence of agreement."""
    nothing = model_agreement({"c1": [], "c2": []})
    assert not nothing.identical
    assert nothing.epochs_checked == 0
    assert "nothing compared" in nothing.problems[0]
    alone = model_agreement(
        {
            "c1": [ev("cooldown_model", 1, epoch=0, model_hash="h0")],
            "c2": [ev("cooldown_model", 2, epoch=1, model_hash="h1")],
        }
    )
    assert not alone.identical
    assert alone.epochs_checked == 0
    two = model_agreement(
        {
            "c1": [ev("cooldown_model", 1, epoch=0, model_hash="h0")],
            "c2": [ev("cooldown_model", 1, epoch=0, model_hash="h0")],
        }
    )
    assert two.identical
    assert two.epochs_checked == 1
    assert two.problems == []


def test_applied_agreement() -> None:
    a = [ev("applied_results", 1, step=3, batches=["B[0, 1]", "B[2, 3]"])]
    b = [ev("applied_results", 1, step=3, batches=["B[2, 3]", "B[0, 1]"])]
    c = [ev("applied_results", 1, step=3, batches=["B[0, 1]"])]
    assert applied_agreement({"a": a, "b": b}) == []
    assert applied_agreement({"a": a, "c": c})


def test_rejoin_counts_rounds_between_the_model_and_training() -> None:
    peers = {"c1": [ev("cooldown_model", 50, epoch=0, model_hash="h")]}
    events = [
        ev("loaded_model", 60, epoch=1, checkpoint="P2P(repo)", model_hash="h"),
        ev("round_start", 65, step=9, assigned=["B[0, 1]"], assignments=[]),
        ev("trained_batch", 66, step=9, batch_id="B[0, 1]"),
    ]
    info = rejoin("c2", 40.0, events, peers, round_starts=[30, 64.9, 70])
    assert info.hash_identical is True
    assert info.rounds_waited == 0
    assert info.seconds == 26
    late = rejoin("c2", 40.0, events, peers, round_starts=[61, 62, 63, 64.9])
    assert late.rounds_waited == 3
    wrong = [{**events[0], "model_hash": "x"}, *events[1:]]
    assert rejoin("c2", 40.0, wrong, peers, [64.9]).hash_identical is False


def test_median_round_seconds_leaves_out_epoch_boundaries() -> None:
    # epoch 0: rounds 3 s apart; 20 s to epoch 1's first round (not a round); then 8 and 3 s
    starts = [(0.0, 0), (3.0, 0), (6.0, 0), (26.0, 1), (34.0, 1), (37.0, 1)]
    assert median_round_seconds(starts) == 3.0
    assert median_round_seconds([(0.0, 0), (3.0, 0), (11.0, 0)]) == 5.5
    assert median_round_seconds([(0.0, 0), (20.0, 1)]) is None
