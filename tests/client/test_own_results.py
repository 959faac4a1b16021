"""What a client's DisTrO training subtracts from its momentum (`own_results_to_subtract`): the
own results of the last round it trained, however many rounds it sat out in between."""

from __future__ import annotations

from typing import Any

from psyche.client.round.state import RoundState
from psyche.client.round.train import RoundPlan, own_results_to_subtract
from psyche.core.batch_id import BatchId


def plan(*, trains: bool, zero_optim: bool = False) -> RoundPlan:
    return RoundPlan(
        state=RoundState(),
        have_training=True,
        assigned_batches=[BatchId(0, 3)] if trains else [],
        warmup_lr_between=None,
        zero_optim=zero_optim,
    )


def rounds(schedule: list[tuple[bool, bool]]) -> list[list[Any]]:
    """Run `schedule` (trains, zero_optim) a round at a time, each round that trains sending
    results named after its round; what each round's training subtracted."""
    owed: list[Any] = []
    previous: list[Any] = []
    subtracted = []
    for number, (trains, zero) in enumerate(schedule):
        taken, owed = own_results_to_subtract(owed, previous, plan(trains=trains, zero_optim=zero))
        subtracted.append(taken)
        previous = [[f"sent in round {number}"]] if trains else []
    return subtracted


def test_a_client_that_trains_every_round_subtracts_the_previous_rounds_results() -> None:
    # upstream's rule, unchanged for a client that trains every round
    assert rounds([(True, True), (True, False), (True, False)]) == [
        [],
        [["sent in round 0"]],
        [["sent in round 1"]],
    ]


def test_a_round_sat_out_keeps_what_is_owed_for_the_next_round_that_trains() -> None:
    # trained, verifier, tie-breaker, trained: round 3 takes out what round 0 sent (upstream
    # would take out nothing, and round 3's result would carry round 0's again)
    assert rounds([(True, True), (False, False), (False, False), (True, False)]) == [
        [],
        [],
        [],
        [["sent in round 0"]],
    ]


def test_a_zeroed_optimizer_owes_nothing() -> None:
    assert rounds([(True, True), (False, False), (True, True)]) == [[], [], []]
