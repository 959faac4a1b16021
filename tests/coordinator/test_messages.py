"""Messages applied to the coordinator (upstream coordinator.rs has no unit tests; these pin each
rule of the spec §2.10-§2.11 and the error precedence)."""

from __future__ import annotations

import pytest

from psyche.coordinator import (
    Checkpoint,
    Client,
    ClientState,
    Commitment,
    Committee,
    CommitteeProof,
    CommitteeSelection,
    Coordinator,
    CoordinatorError,
    CoordinatorErrorKind,
    CoordinatorPanic,
    CoordinatorUnimplemented,
    GcsRepo,
    HubRepo,
    Round,
    RunState,
    TickResult,
    Witness,
    WitnessBloom,
    WitnessProof,
)
from psyche.coordinator.testing import (
    bloom_of,
    health_checks_for,
    integration_test_coordinator,
    round_witness_for,
    simulated_identity,
    warmup_witness_for,
)
from psyche.core import NodeIdentity, sha256

Kind = CoordinatorErrorKind
KEYS = [11, 22, 33, 44, 55, 66, 77, 88]


def ids(n: int) -> list[NodeIdentity]:
    return [simulated_identity(i) for i in range(n)]


def raises(kind: CoordinatorErrorKind, fn, *args) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CoordinatorError) as info:
        fn(*args)
    assert info.value.kind is kind
    assert str(info.value) == str(kind)


def in_warmup(n: int = 4, witness_nodes: int = 1, now: int = 100) -> Coordinator:
    coordinator = integration_test_coordinator(n, 8, witness_nodes)
    assert coordinator.tick(ids(n), now, 1) == TickResult.Ticked()
    assert coordinator.run_state is RunState.Warmup
    return coordinator


def in_training(n: int = 4, witness_nodes: int = 1, seed: int = 5) -> Coordinator:
    coordinator = in_warmup(n, witness_nodes)
    coordinator.tick(None, 120, seed)
    assert coordinator.run_state is RunState.RoundTrain
    return coordinator


def witnesses_of(coordinator: Coordinator) -> list[tuple[NodeIdentity, Witness]]:
    clients = coordinator.epoch_state.clients
    participants = [c.id for c in clients]
    found = []
    for i, client in enumerate(clients):
        witness = round_witness_for(coordinator, i, participants=participants, bloom_keys=KEYS)
        if witness is not None:
            found.append((client.id, witness))
    return found


def next_round(coordinator: Coordinator, now: int, seed: int) -> int:
    """Honest witnesses, then the round's witness phase times out; returns the new time."""
    for sender, witness in witnesses_of(coordinator):
        coordinator.witness(sender, witness, now)
    if coordinator.run_state is RunState.RoundTrain:
        now += coordinator.config.max_round_train_time
        coordinator.tick(None, now, seed)
    now += coordinator.config.round_witness_time
    coordinator.tick(None, now, seed)
    return now


# ---- tick: halted and timing --------------------------------------------------------------------


@pytest.mark.parametrize("state", [RunState.Uninitialized, RunState.Finished, RunState.Paused])
def test_tick_when_halted(state: RunState) -> None:
    coordinator = integration_test_coordinator(2, 4, 1)
    coordinator.run_state = state
    before = coordinator.copy()
    raises(Kind.Halted, coordinator.tick, ids(2), 50, 1)
    assert coordinator == before


def test_no_transition_in_the_second_a_state_began() -> None:
    coordinator = integration_test_coordinator(2, 4, 1)
    coordinator.config.waiting_for_members_extra_time = 0  # invalid upstream, but shows the guard
    coordinator.run_state_start_unix_timestamp = 77
    coordinator.tick(ids(2), 77, 1)
    assert coordinator.run_state is RunState.WaitingForMembers
    coordinator.tick(ids(2), 78, 1)
    assert coordinator.run_state is RunState.Warmup


def test_waiting_needs_enough_pending_clients_and_the_extra_time() -> None:
    coordinator = integration_test_coordinator(3, 4, 1)
    coordinator.run_state_start_unix_timestamp = 1000
    coordinator.tick(ids(2), 1010, 1)
    assert coordinator.run_state is RunState.WaitingForMembers
    coordinator.tick(None, 1010, 1)  # no information about pending clients
    assert coordinator.run_state is RunState.WaitingForMembers
    coordinator.tick(ids(3), 1001, 1)  # extra time (2 s since entering) not yet over
    assert coordinator.run_state is RunState.WaitingForMembers
    coordinator.tick(ids(3), 1002, 1)
    assert coordinator.run_state is RunState.Warmup
    assert coordinator.run_state_start_unix_timestamp == 1002
    assert [c.id for c in coordinator.epoch_state.clients] == ids(3)
    assert coordinator.epoch_state.start_timestamp == 1002
    assert coordinator.epoch_state.first_round


def test_at_most_256_clients_in_pending_order() -> None:
    coordinator = integration_test_coordinator(2, 4, 1)
    coordinator.tick(ids(300)[::-1], 10, 1)
    clients = [c.id for c in coordinator.epoch_state.clients]
    assert clients == ids(300)[::-1][:256]


def test_new_epoch_zeroes_the_epoch_state_but_keeps_cold_start() -> None:
    coordinator = integration_test_coordinator(2, 4, 1)
    coordinator.progress.step = 17
    coordinator.epoch_state.cold_start_epoch = True
    coordinator.epoch_state.exited_clients = [Client(simulated_identity(99), ClientState.Dropped)]
    coordinator.epoch_state.rounds[2].height = 9
    coordinator.epoch_state.rounds_head = 2
    coordinator.tick(ids(2), 10, 1)
    epoch_state = coordinator.epoch_state
    assert epoch_state.exited_clients == []
    assert all(r == Round() for r in epoch_state.rounds)
    assert (epoch_state.rounds_head, epoch_state.start_step, epoch_state.last_step) == (0, 17, 0)
    assert epoch_state.cold_start_epoch
    assert epoch_state.first_round
    assert coordinator.get_cold_start_warmup_bounds() is None  # LLM.dummy has 0 steps
    coordinator.model.value.cold_start_warmup_steps = 5
    assert coordinator.get_cold_start_warmup_bounds() == (17, 22)


def test_warmup_times_out_into_the_first_round() -> None:
    coordinator = in_warmup()
    coordinator.tick(None, 119, 1)
    assert coordinator.run_state is RunState.Warmup
    coordinator.tick(None, 120, 4242)
    assert coordinator.run_state is RunState.RoundTrain
    round_ = coordinator.current_round()
    assert round_ is not None
    assert (coordinator.epoch_state.rounds_head, round_.height, round_.data_index) == (0, 0, 0)
    assert (round_.random_seed, round_.clients_len, round_.tie_breaker_tasks) == (4242, 4, 0)
    assert coordinator.is_training_just_starting()


def test_warmup_drops_below_min_clients() -> None:
    coordinator = in_warmup(3)
    coordinator.withdraw(1)
    result = coordinator.tick(None, 101, 1)
    assert result == TickResult.EpochEnd(False)
    assert coordinator.run_state is RunState.WaitingForMembers
    assert len(coordinator.epoch_state.clients) == 2
    assert coordinator.epoch_state.exited_clients[0].exited_height == 0


def test_rounds_advance_data_and_the_ring() -> None:
    coordinator = in_training(4, 1)
    now = 120
    seen = []
    for seed in range(10, 16):
        now = next_round(coordinator, now, seed)
        round_ = coordinator.current_round()
        assert round_ is not None
        seen.append((coordinator.epoch_state.rounds_head, round_.height, round_.data_index))
        assert round_.random_seed == seed
    assert seen == [(1, 1, 8), (2, 2, 16), (3, 3, 24), (0, 4, 32), (1, 5, 40), (2, 6, 48)]
    assert coordinator.progress.step == 6  # zeroed coordinators start at step 0


# ---- warmup witnesses ----------------------------------------------------------------------------


def test_warmup_witness_quorum_starts_training() -> None:
    coordinator = in_warmup(4, witness_nodes=2)
    clients = ids(4)
    coordinator.warmup_witness(clients[1], warmup_witness_for(1), 105, 77)
    assert coordinator.run_state is RunState.Warmup
    raises(
        Kind.DuplicateWitness,
        coordinator.warmup_witness,
        clients[1],
        warmup_witness_for(1),
        105,
        77,
    )
    coordinator.warmup_witness(clients[3], warmup_witness_for(3), 106, 78)
    assert coordinator.run_state is RunState.RoundTrain
    assert coordinator.run_state_start_unix_timestamp == 106
    round_ = coordinator.current_round()
    assert round_ is not None
    assert round_.random_seed == 78
    assert round_.witnesses == []
    # late warmup witnesses are ignored
    before = coordinator.copy()
    coordinator.warmup_witness(clients[0], warmup_witness_for(0), 107, 79)
    assert coordinator == before


def test_warmup_witness_with_zero_witness_nodes_waits_for_everyone_up_to_32() -> None:
    coordinator = in_warmup(3, witness_nodes=0)
    for i, sender in enumerate(ids(3)):
        assert coordinator.run_state is RunState.Warmup
        coordinator.warmup_witness(sender, warmup_witness_for(i), 101, 5)
    assert coordinator.run_state is RunState.RoundTrain


def test_warmup_witness_errors_in_order() -> None:
    coordinator = integration_test_coordinator(2, 4, 1)
    sender = ids(2)[0]
    raises(Kind.InvalidRunState, coordinator.warmup_witness, sender, warmup_witness_for(0), 1, 1)
    coordinator.run_state = RunState.Paused
    raises(Kind.Halted, coordinator.warmup_witness, sender, warmup_witness_for(0), 1, 1)
    coordinator.run_state = RunState.RoundWitness
    raises(Kind.InvalidRunState, coordinator.warmup_witness, sender, warmup_witness_for(0), 1, 1)


def test_warmup_duplicate_check_uses_the_stored_index() -> None:
    # Upstream quirk: the check looks up clients[stored.proof.index], not the stored sender.
    coordinator = in_warmup(4, witness_nodes=3)
    a, _b, c, _ = ids(4)
    coordinator.warmup_witness(a, warmup_witness_for(2), 101, 1)  # a claims c's index
    raises(Kind.DuplicateWitness, coordinator.warmup_witness, c, warmup_witness_for(2), 101, 1)
    coordinator.warmup_witness(a, warmup_witness_for(0), 101, 1)  # a again, under its own index


def test_warmup_witness_with_a_stored_index_past_the_clients_panics() -> None:
    coordinator = in_warmup(4, witness_nodes=3)
    a, b, *_ = ids(4)
    coordinator.warmup_witness(a, warmup_witness_for(9), 101, 1)  # accepted unchecked
    before = coordinator.copy()
    with pytest.raises(CoordinatorPanic, match="index out of bounds"):
        coordinator.warmup_witness(b, warmup_witness_for(1), 101, 1)
    assert coordinator == before


def test_warmup_witnesses_full() -> None:
    coordinator = in_warmup(40, witness_nodes=5)
    round_ = coordinator.current_round()
    assert round_ is not None
    round_.witnesses = [warmup_witness_for(i) for i in range(32)]
    raises(
        Kind.WitnessesFull, coordinator.warmup_witness, ids(40)[35], warmup_witness_for(35), 1, 1
    )


# ---- round witnesses -----------------------------------------------------------------------------


def test_witness_opportunistic_switch_and_later_witnesses() -> None:
    coordinator = in_training(8, witness_nodes=2)
    (first, w1), (second, w2) = witnesses_of(coordinator)
    coordinator.witness(first, w1, 121)
    assert coordinator.run_state is RunState.RoundTrain
    raises(Kind.DuplicateWitness, coordinator.witness, first, w1, 121)
    coordinator.witness(second, w2, 122)
    assert coordinator.run_state is RunState.RoundWitness
    assert coordinator.run_state_start_unix_timestamp == 122
    round_ = coordinator.current_round()
    assert round_ is not None
    assert len(round_.witnesses) == 2


def test_witness_rejects_wrong_proofs() -> None:
    coordinator = in_training(8, witness_nodes=2)
    clients = ids(8)
    selection = CommitteeSelection.from_coordinator(coordinator, 0)
    proofs = [selection.get_witness(i) for i in range(8)]
    witness_index = next(i for i, p in enumerate(proofs) if p.witness)
    other_index = next(i for i, p in enumerate(proofs) if not p.witness)
    good = proofs[witness_index]
    sender = clients[witness_index]

    def attempt(sender: NodeIdentity, proof: WitnessProof) -> None:
        coordinator.witness(sender, Witness(proof), 121)

    # someone else's index, a wrong position, a false flag, an index past the clients
    raises(Kind.InvalidWitness, attempt, clients[other_index], good)
    raises(Kind.InvalidWitness, attempt, sender, WitnessProof(good.position + 1, good.index, True))
    raises(Kind.InvalidWitness, attempt, sender, WitnessProof(good.position, good.index, False))
    raises(Kind.InvalidWitness, attempt, sender, WitnessProof(0, 8, True))
    # a non-witness quoting its true position (witness = false) is still rejected
    raises(Kind.InvalidWitness, attempt, clients[other_index], proofs[other_index])
    # a non-witness claiming to be one
    fake = WitnessProof(proofs[other_index].position, other_index, True)
    raises(Kind.InvalidWitness, attempt, clients[other_index], fake)
    round_ = coordinator.current_round()
    assert round_ is not None
    assert round_.witnesses == []
    attempt(sender, good)


def test_witness_errors_in_order() -> None:
    coordinator = in_warmup(4)
    bogus = Witness(WitnessProof(0, 0, True))
    raises(Kind.InvalidRunState, coordinator.witness, ids(4)[0], bogus, 101)
    coordinator.pause(101)
    raises(Kind.Halted, coordinator.witness, ids(4)[0], bogus, 101)


def test_witness_when_the_round_has_too_few_nodes() -> None:
    coordinator = in_training(4, witness_nodes=3)
    round_ = coordinator.current_round()
    assert round_ is not None
    round_.clients_len = 2  # fewer nodes than witnesses: no committee can be drawn
    raises(Kind.InvalidCommitteeSelection, coordinator.witness, ids(4)[0], Witness(), 121)


# ---- round end ------------------------------------------------------------------------------------


def test_round_without_witnesses_withdraws_everyone() -> None:
    coordinator = in_training(3)
    coordinator.tick(None, 125, 1)
    assert coordinator.run_state is RunState.RoundWitness
    coordinator.tick(None, 127, 1)
    assert coordinator.run_state is RunState.Cooldown
    assert all(c.state is ClientState.Withdrawn for c in coordinator.epoch_state.clients)
    assert coordinator.progress.step == 1
    coordinator.tick(None, 130, 1)
    assert coordinator.run_state is RunState.WaitingForMembers
    assert coordinator.epoch_state.clients == []
    assert [c.exited_height for c in coordinator.epoch_state.exited_clients] == [0, 0, 0]


def test_round_below_witness_quorum_ends_the_epoch() -> None:
    coordinator = in_training(8, witness_nodes=4)  # quorum 2
    coordinator.epoch_state.cold_start_epoch = True
    (sender, witness), *_ = witnesses_of(coordinator)
    coordinator.witness(sender, witness, 121)
    coordinator.tick(None, 125, 1)
    coordinator.tick(None, 127, 1)
    assert coordinator.run_state is RunState.Cooldown
    round_ = coordinator.current_round()
    assert round_ is not None
    assert round_.witnesses == []
    assert coordinator.tick(None, 129, 1) == TickResult.Ticked()
    assert coordinator.tick(None, 130, 1) == TickResult.EpochEnd(True)
    assert coordinator.run_state is RunState.WaitingForMembers
    assert coordinator.progress.epoch == 1
    assert coordinator.progress.epoch_start_data_index == 8
    assert not coordinator.epoch_state.cold_start_epoch  # a completed epoch warms the run


def test_epoch_timeout_runs_two_more_rounds() -> None:
    coordinator = in_training(2, witness_nodes=1)  # epoch started at 100, lasts 30 s
    now = 120
    log = []
    while coordinator.run_state is not RunState.Cooldown:
        now = next_round(coordinator, now, 1)  # the single witness arrives at once: 2 s rounds
        log.append((now, coordinator.progress.step, coordinator.epoch_state.last_step))
    # the round ending at 130 sees the epoch timeout: last_step = step + 2, two more rounds
    assert log[:5] == [(122, 1, 0), (124, 2, 0), (126, 3, 0), (128, 4, 0), (130, 5, 7)]
    assert log[5:] == [(132, 6, 7), (134, 7, 7)]
    round_ = coordinator.current_round()
    assert round_ is not None
    assert round_.height == 6


def test_last_step_needs_at_least_four() -> None:
    coordinator = in_training(2, witness_nodes=1)
    coordinator.config.epoch_time = 1
    now = next_round(coordinator, 120, 1)
    # step 0 -> 1: last_step would be 3 < 4, so it stays unset and is retried next round
    assert (coordinator.progress.step, coordinator.epoch_state.last_step) == (1, 0)
    now = next_round(coordinator, now, 1)
    assert (coordinator.progress.step, coordinator.epoch_state.last_step) == (2, 4)
    now = next_round(coordinator, now, 1)
    assert coordinator.run_state is RunState.RoundTrain
    next_round(coordinator, now, 1)
    assert coordinator.run_state is RunState.Cooldown
    assert coordinator.progress.step == 4


def test_total_steps_finishes_the_run() -> None:
    coordinator = in_training(2, witness_nodes=1)
    coordinator.config.total_steps = 3
    now = 120
    while coordinator.run_state is RunState.RoundTrain:
        now = next_round(coordinator, now, 1)
    assert coordinator.run_state is RunState.Cooldown
    assert coordinator.progress.step == 3
    assert coordinator.tick(None, now + 3, 1) == TickResult.EpochEnd(True)
    assert coordinator.run_state is RunState.Finished
    raises(Kind.Halted, coordinator.tick, ids(2), now + 10, 1)


# ---- cooldown and checkpoints --------------------------------------------------------------------

HUB_A, HUB_B = HubRepo("org/a"), HubRepo("org/b", "rev")
GCS_A, GCS_B = GcsRepo("bucket-a"), GcsRepo("bucket-b", "prefix")
CURRENT = [
    Checkpoint.Ephemeral(),
    Checkpoint.Dummy(HUB_A),
    Checkpoint.Hub(HUB_A),
    Checkpoint.P2P(HUB_A),
    Checkpoint.Gcs(GCS_A),
    Checkpoint.P2PGcs(GCS_A),
]
INCOMING = [
    Checkpoint.Ephemeral(),
    Checkpoint.Dummy(HUB_B),
    Checkpoint.Hub(HUB_B),
    Checkpoint.P2P(HUB_B),
    Checkpoint.Gcs(GCS_B),
    Checkpoint.P2PGcs(GCS_B),
]
UPDATES = {
    ("P2P", "Hub"): Checkpoint.P2P(HUB_B),
    ("P2PGcs", "Gcs"): Checkpoint.P2PGcs(GCS_B),
    ("Hub", "Hub"): Checkpoint.Hub(HUB_B),
    ("Gcs", "Gcs"): Checkpoint.Gcs(GCS_B),
    ("P2PGcs", "Hub"): Checkpoint.P2P(HUB_B),
    ("P2P", "Gcs"): Checkpoint.P2PGcs(GCS_B),
}


@pytest.mark.parametrize("current", CURRENT, ids=lambda c: c.variant_name)
@pytest.mark.parametrize("incoming", INCOMING, ids=lambda c: c.variant_name)
def test_checkpoint_update_table(current: Checkpoint, incoming: Checkpoint) -> None:
    coordinator = in_warmup(2)
    coordinator.model.value.checkpoint = current
    coordinator.checkpoint(ids(2)[1], 1, incoming)
    key = (current.variant_name, incoming.variant_name)
    assert coordinator.model.value.checkpoint == UPDATES.get(key, current)


def test_checkpoint_needs_the_senders_index() -> None:
    coordinator = in_warmup(2)
    a, _b = ids(2)
    raises(Kind.InvalidCommitteeProof, coordinator.checkpoint, a, 1, Checkpoint.Hub(HUB_B))
    raises(Kind.InvalidCommitteeProof, coordinator.checkpoint, a, 2, Checkpoint.Hub(HUB_B))
    coordinator.run_state = RunState.Finished  # no state check upstream
    coordinator.model.value.checkpoint = Checkpoint.Hub(HUB_A)
    coordinator.checkpoint(a, 0, Checkpoint.Hub(HUB_B))
    assert coordinator.model.value.checkpoint == Checkpoint.Hub(HUB_B)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (Checkpoint.Hub(HUB_A), Checkpoint.P2P(HUB_A)),
        (Checkpoint.Dummy(HUB_A), Checkpoint.P2P(HUB_A)),
        (Checkpoint.Gcs(GCS_A), Checkpoint.P2PGcs(GCS_A)),
        (Checkpoint.P2P(HUB_A), Checkpoint.P2P(HUB_A)),
        (Checkpoint.Ephemeral(), Checkpoint.Ephemeral()),
    ],
)
def test_cooldown_switches_to_p2p_and_back_when_nobody_returns(
    before: Checkpoint, after: Checkpoint
) -> None:
    coordinator = in_training(2)
    coordinator.model.value.checkpoint = before
    coordinator.pending_pause = False
    coordinator.tick(None, 125, 1)
    coordinator.tick(None, 127, 1)  # no witnesses: cooldown
    coordinator.tick(None, 130, 1)
    assert coordinator.model.value.checkpoint == after
    # none of the last epoch's clients is back: Hub again (P2P needs peers)
    coordinator.tick(ids(4)[2:], 132, 1)
    assert coordinator.run_state is RunState.Warmup
    back = {"P2P": Checkpoint.Hub, "P2PGcs": Checkpoint.Gcs}.get(after.variant_name)
    expected = back(after.value) if back else after  # type: ignore[attr-defined]
    assert coordinator.model.value.checkpoint == expected


def test_p2p_kept_when_a_previous_client_returns() -> None:
    coordinator = in_training(2, witness_nodes=2)  # quorum 2
    coordinator.model.value.checkpoint = Checkpoint.Hub(HUB_A)
    (sender, witness), _ = witnesses_of(coordinator)
    coordinator.witness(sender, witness, 121)
    coordinator.tick(None, 125, 1)
    coordinator.tick(None, 127, 1)  # one witness of two: cooldown, everyone still healthy
    assert coordinator.tick(None, 130, 1) == TickResult.EpochEnd(True)
    assert coordinator.model.value.checkpoint == Checkpoint.P2P(HUB_A)
    coordinator.tick([simulated_identity(7), ids(2)[1]], 132, 1)
    assert coordinator.run_state is RunState.Warmup
    assert coordinator.model.value.checkpoint == Checkpoint.P2P(HUB_A)


def test_after_a_pause_nobody_serves_the_model() -> None:
    # Pausing withdraws everyone, so the next epoch falls back to the hub even if the same
    # clients return (upstream behaviour).
    coordinator = in_training(2)
    coordinator.model.value.checkpoint = Checkpoint.Hub(HUB_A)
    coordinator.pause(121)
    now = next_round(coordinator, 121, 1)
    coordinator.tick(None, now + 3, 1)
    assert coordinator.run_state is RunState.Paused
    assert coordinator.model.value.checkpoint == Checkpoint.P2P(HUB_A)
    coordinator.resume(now + 4)
    coordinator.tick(ids(2), now + 6, 1)
    assert coordinator.run_state is RunState.Warmup
    assert coordinator.model.value.checkpoint == Checkpoint.Hub(HUB_A)


# ---- withdraw, pause, resume ---------------------------------------------------------------------


def test_withdraw() -> None:
    coordinator = in_warmup(2)
    coordinator.withdraw(1)
    assert coordinator.epoch_state.clients[1].state is ClientState.Withdrawn
    raises(Kind.InvalidWithdraw, coordinator.withdraw, 1)
    raises(Kind.InvalidWithdraw, coordinator.withdraw, 2)
    coordinator.withdraw_all()
    assert all(c.state is ClientState.Withdrawn for c in coordinator.epoch_state.clients)


def test_pause_while_waiting_or_warming_up_is_immediate() -> None:
    for coordinator in (integration_test_coordinator(2, 4, 1), in_warmup(2)):
        coordinator.pause(200)
        assert coordinator.run_state is RunState.Paused
        assert coordinator.run_state_start_unix_timestamp == 200
        assert coordinator.epoch_state.cold_start_epoch
        assert all(c.state is ClientState.Withdrawn for c in coordinator.epoch_state.clients)
        raises(Kind.Halted, coordinator.pause, 201)
        coordinator.resume(202)
        assert coordinator.run_state is RunState.WaitingForMembers


def test_pause_while_training_waits_for_the_epoch_end() -> None:
    coordinator = in_training(2)
    coordinator.pause(121)
    assert coordinator.pending_pause
    assert coordinator.run_state is RunState.RoundTrain
    now = next_round(coordinator, 121, 1)
    assert coordinator.run_state is RunState.Cooldown
    assert coordinator.tick(None, now + 3, 1) == TickResult.EpochEnd(True)
    assert coordinator.run_state is RunState.Paused
    assert not coordinator.pending_pause
    assert coordinator.epoch_state.cold_start_epoch
    assert all(c.state is ClientState.Withdrawn for c in coordinator.epoch_state.clients)
    raises(Kind.CannotResume, in_training(2).resume, 1)
    coordinator.resume(now + 10)
    assert coordinator.run_state is RunState.WaitingForMembers
    coordinator.tick(ids(2), now + 12, 1)
    assert coordinator.epoch_state.cold_start_epoch  # kept into the new epoch
    coordinator.model.value.cold_start_warmup_steps = 3
    assert coordinator.get_cold_start_warmup_bounds() == (1, 4)


def test_resume_after_the_last_step_finishes() -> None:
    coordinator = integration_test_coordinator(2, 4, 1)
    coordinator.pause(5)
    coordinator.progress.step = 100
    coordinator.resume(6)
    assert coordinator.run_state is RunState.Finished


# ---- health checks ----------------------------------------------------------------------------------


def trained(
    n: int, witness_nodes: int, rounds: int, missing: frozenset[int] = frozenset()
) -> Coordinator:
    """`rounds` complete rounds in which every witness leaves the `missing` indices out."""
    coordinator = in_training(n, witness_nodes)
    now = 120
    for seed in range(rounds):
        clients = coordinator.epoch_state.clients
        participants = [c.id for i, c in enumerate(clients) if i not in missing]
        for i, client in enumerate(clients):
            witness = round_witness_for(coordinator, i, participants=participants, bloom_keys=KEYS)
            if witness is not None:
                coordinator.witness(client.id, witness, now)
        now += 2
        coordinator.tick(None, now, 1000 + seed)
        assert coordinator.run_state is RunState.RoundTrain
    return coordinator


def test_health_check_drops_unhealthy_trainers() -> None:
    coordinator = trained(6, 3, 2, missing=frozenset({4}))
    checks = health_checks_for(coordinator)
    assert [node for node, _ in checks] == [ids(6)[4]]
    assert coordinator.health_check(ids(6)[0], checks) == 1
    assert coordinator.epoch_state.clients[4].state is ClientState.Dropped
    assert coordinator.health_check(ids(6)[0], checks) == 0  # already dropped
    # the dropped client leaves at the end of the round
    coordinator.tick(None, coordinator.run_state_start_unix_timestamp + 5, 1)
    coordinator.tick(None, coordinator.run_state_start_unix_timestamp + 2, 1)
    assert [c.id for c in coordinator.epoch_state.exited_clients] == [ids(6)[4]]
    assert coordinator.epoch_state.exited_clients[0].exited_height == 2


def test_health_check_rejects_a_healthy_accused() -> None:
    coordinator = trained(6, 3, 2, missing=frozenset({4}))
    selection = CommitteeSelection.from_coordinator(coordinator, -1)
    checks = [(ids(6)[4], selection.get_committee(4)), (ids(6)[1], selection.get_committee(1))]
    before = coordinator.copy()
    raises(Kind.InvalidHealthCheck, coordinator.health_check, ids(6)[0], checks)
    assert coordinator == before


def test_health_check_before_the_pipeline_is_full() -> None:
    coordinator = trained(6, 3, 1, missing=frozenset({4}))
    raises(Kind.InvalidHealthCheck, coordinator.health_check, ids(6)[0], [])


def test_health_check_with_a_bad_proof() -> None:
    coordinator = trained(6, 3, 2, missing=frozenset({4}))
    selection = CommitteeSelection.from_coordinator(coordinator, -1)
    good = selection.get_committee(4)
    for proof, accused in [
        (CommitteeProof(good.committee, good.position + 1, 4), ids(6)[4]),
        (good, ids(6)[3]),
        (CommitteeProof(Committee.Trainer, 0, 6), ids(6)[4]),
    ]:
        raises(Kind.InvalidCommitteeProof, coordinator.health_check, ids(6)[0], [(accused, proof)])


def test_health_check_of_a_verifier_is_not_implemented_upstream() -> None:
    coordinator = trained(6, 3, 2)
    previous = coordinator.previous_round()
    assert previous is not None
    previous.tie_breaker_tasks = 6  # everyone a tie-breaker
    selection = CommitteeSelection.from_coordinator(coordinator, -1)
    with pytest.raises(CoordinatorUnimplemented, match="TieBreaker"):
        coordinator.health_check(ids(6)[0], [(ids(6)[2], selection.get_committee(2))])


def test_health_check_errors_in_order() -> None:
    coordinator = in_warmup(2)
    coordinator.pause(101)
    raises(Kind.Halted, coordinator.health_check, ids(2)[0], [])
    coordinator = in_training(2)
    coordinator.epoch_state.rounds_head = 7  # (only reachable from a crafted state)
    raises(Kind.NoActiveRound, coordinator.health_check, ids(2)[0], [])


def test_health_scores_and_quorum() -> None:
    coordinator = trained(6, 3, 2, missing=frozenset({4}))
    previous = coordinator.previous_round()
    assert previous is not None
    scores = [Coordinator.trainer_healthy_score_by_witnesses(i, previous.witnesses) for i in ids(6)]
    assert scores == [3, 3, 3, 3, 0, 3]
    assert [coordinator.trainer_healthy(i) for i in ids(6)] == [True] * 4 + [False, True]


@pytest.mark.parametrize("witness_nodes", [3, 5])
def test_health_score_exactly_at_the_quorum_is_healthy_one_below_is_not(witness_nodes: int) -> None:
    accused = 4
    for below_quorum, expected_healthy in [(0, True), (1, False)]:
        coordinator = trained(6, witness_nodes, 2)
        previous = coordinator.previous_round()
        assert previous is not None
        quorum = coordinator.witness_quorum(len(previous.witnesses))
        assert len(previous.witnesses) == witness_nodes
        assert quorum >= 2
        # Exactly `quorum - below_quorum` witnesses saw the accused trainer; the others did not.
        seen_by = quorum - below_quorum
        everyone_else = [
            c.id for i, c in enumerate(coordinator.epoch_state.clients) if i != accused
        ]
        for witness in previous.witnesses[seen_by:]:
            witness.participant_bloom = bloom_of((sha256(i.signer) for i in everyone_else), KEYS)
        node = ids(6)[accused]
        assert Coordinator.trainer_healthy_score_by_witnesses(node, previous.witnesses) == seen_by
        assert coordinator.trainer_healthy(node) is expected_healthy
        proof = CommitteeSelection.from_coordinator(coordinator, -1).get_committee(accused)
        assert proof.committee is Committee.Trainer
        if expected_healthy:
            raises(Kind.InvalidHealthCheck, coordinator.health_check, ids(6)[0], [(node, proof)])
            assert health_checks_for(coordinator) == []
        else:
            assert [n for n, _ in health_checks_for(coordinator)] == [node]
            assert coordinator.health_check(ids(6)[0], [(node, proof)]) == 1
            assert coordinator.epoch_state.clients[accused].state is ClientState.Dropped


def test_witness_quorum_table() -> None:
    coordinator = Coordinator.zeroed()
    table = {}
    for wn in range(1, 33):
        coordinator.config.witness_nodes = wn
        table[wn] = coordinator.witness_quorum(0)
    assert table == {
        1: 1, 2: 2, 3: 2, 4: 2, 5: 3, 6: 4, 7: 4, 8: 5, 9: 6, 10: 6, 11: 7, 12: 8, 13: 8,
        14: 9, 15: 10, 16: 10, 17: 11, 18: 12, 19: 12, 20: 13, 21: 14, 22: 14, 23: 15,
        24: 16, 25: 16, 26: 17, 27: 18, 28: 18, 29: 19, 30: 20, 31: 20, 32: 21,
    }  # fmt: skip
    coordinator.config.witness_nodes = 0
    assert coordinator.witness_quorum(9) == 6
    with pytest.raises(CoordinatorPanic, match="unreachable"):
        coordinator.witness_quorum(0)


# ---- consensus ------------------------------------------------------------------------------------


def commitment(n: int) -> Commitment:
    return Commitment(sha256(bytes([n])), bytes(64))


def voter(*seen: int) -> Witness:
    return Witness(broadcast_bloom=bloom_of((commitment(n).data_hash for n in seen), KEYS))


def test_consensus_counts_the_first_commitment_each_witness_saw() -> None:
    commitments = [commitment(n) for n in range(3)]
    select = Coordinator.select_consensus_commitment_by_witnesses
    witnesses = [voter(1, 0), voter(0), voter(2, 1), voter(1)]
    # votes: w0 -> 0 (first in commitment order), w1 -> 0, w2 -> 1, w3 -> 1: a tie, last wins
    assert select(commitments, witnesses, 1) == 1
    assert select(commitments, witnesses, 2) == 1
    assert select(commitments, witnesses, 3) is None
    assert select(commitments, [voter(0), voter(0), voter(2)], 1) == 0
    assert select(commitments, [], 0) == 2  # every score 0 passes quorum 0: the last index
    assert select([], witnesses, 0) is None


# ---- history ----------------------------------------------------------------------------------------


def test_historical_clients() -> None:
    coordinator = Coordinator.zeroed()
    a, b, c, d = (Client(i) for i in ids(4))
    coordinator.epoch_state.clients = [a, c]
    coordinator.epoch_state.exited_clients = [d, b]  # b left last
    assert coordinator.get_client_at_historical_index(1, 4) is c
    assert coordinator.get_client_at_historical_index(3, 4) is b
    assert coordinator.get_client_at_historical_index(2, 4) is d
    assert coordinator.get_client_at_historical_index(4, 4) is None
    assert coordinator.get_client_at_historical_index(3, 9) is None  # past the exited list
    assert coordinator.get_historical_clients(4) == [a, c, d, b]


def test_previous_rounds() -> None:
    coordinator = Coordinator.zeroed()
    rounds = coordinator.epoch_state.rounds
    assert coordinator.previous_round() is None
    assert coordinator.previous_previous_round() is None
    rounds[0].height = 1
    assert coordinator.previous_round() is rounds[3]
    assert coordinator.previous_previous_round() is None
    coordinator.epoch_state.rounds_head = 1
    # upstream quirk: at head 1 the round before the previous one is slot 3, even if unused
    assert coordinator.previous_round() is rounds[0]
    assert coordinator.previous_previous_round() is rounds[3]
    coordinator.epoch_state.rounds_head = 3
    assert coordinator.previous_previous_round() is rounds[1]
    coordinator.epoch_state.rounds_head = 0
    rounds[0].height = 4
    assert coordinator.previous_previous_round() is rounds[2]
    coordinator.epoch_state.rounds_head = 4
    assert coordinator.current_round() is None
    assert coordinator.previous_round() is None


def test_queries() -> None:
    coordinator = integration_test_coordinator(2, 4, 1)
    assert not coordinator.active()
    assert not coordinator.halted()
    coordinator.run_state = RunState.Cooldown
    assert coordinator.active()
    coordinator.run_state = RunState.Uninitialized
    assert coordinator.halted()
    assert coordinator.get_sequence_length() == 2048
    coordinator.progress.epoch_start_data_index = 3
    assert coordinator.total_tokens_processed(None) == 3 * 2048
    coordinator.model.value.cold_start_warmup_steps = 3
    assert not coordinator.check_cold_start_warmup_steps()  # (30 - 20) // 5 = 2 rounds
    coordinator.model.value.cold_start_warmup_steps = 2
    assert coordinator.check_cold_start_warmup_steps()
    coordinator.config.max_round_train_time = 0
    with pytest.raises(CoordinatorPanic, match="divide by zero"):
        coordinator.check_cold_start_warmup_steps()


def test_witness_bloom_is_cores() -> None:
    from psyche.core import WitnessBloom as CoreWitnessBloom

    assert WitnessBloom is CoreWitnessBloom
    assert (WitnessBloom.num_words, WitnessBloom.num_keys) == (16, 8)
