"""The server's rules (upstream app.rs) on a ServerCore, without sockets: each event's effect on
the pending set and the coordinator, and which events ask for a broadcast."""

from __future__ import annotations

import random

from psyche.coordinator import ClientState, Coordinator, RunState, WitnessMetadata
from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.model import Checkpoint, HubRepo
from psyche.coordinator.resume import close_epoch, prepare_for_start, resume_snapshot
from psyche.coordinator.server_core import ServerCore
from psyche.coordinator.testing import (
    Simulation,
    quick_coordinator,
    round_witness_for,
    simulated_identity,
    warmup_witness_for,
)

NOW = 1_000_000
A, B, C = (simulated_identity(i) for i in range(3))


def started(coordinator: Coordinator | None = None, **kw: object) -> ServerCore:
    return ServerCore.start(coordinator or quick_coordinator(), now=NOW, **kw)  # type: ignore[arg-type]


def to_warmup(core: ServerCore, *clients: object, now: int = NOW) -> int:
    for client in clients or (A, B):
        core.on_join(client, core.run_id)  # type: ignore[arg-type]
    now += 2  # past waiting_for_members_extra_time
    core.on_tick(now, 1)
    assert core.coordinator.run_state is RunState.Warmup
    return now


def to_round_train(core: ServerCore, now: int) -> int:
    for index, client in enumerate(core.coordinator.epoch_state.clients):
        core.on_witness(client.id, OpportunisticData.WarmupStep(warmup_witness_for(index)), now, 7)
    assert core.coordinator.run_state is RunState.RoundTrain
    return now


def test_join_with_the_run_id_makes_a_client_pending() -> None:
    core = started()
    assert core.on_join(A, "test-run") is False  # no broadcast
    assert core.on_join(B, "other-run") is False
    assert list(core.pending_clients) == [A]
    core.on_join(A, "test-run")
    assert list(core.pending_clients) == [A]


def test_enough_pending_clients_start_warmup_after_the_extra_time() -> None:
    core = started()
    core.on_join(A, "test-run")
    core.on_tick(NOW + 5, 1)
    assert core.coordinator.run_state is RunState.WaitingForMembers
    core.on_join(B, "test-run")
    core.on_tick(NOW + 5, 1)
    assert core.coordinator.run_state is RunState.Warmup
    assert [c.id for c in core.coordinator.epoch_state.clients] == [A, B]


def test_disconnect_removes_pending_and_withdraws() -> None:
    core = started()
    now = to_warmup(core)
    core.on_disconnect(B)
    assert list(core.pending_clients) == [A]
    assert core.coordinator.epoch_state.clients[1].state is ClientState.Withdrawn
    # upstream test 4: the next tick sees too few clients and waits for members again
    core.on_tick(now + 1, 2)
    assert core.coordinator.run_state is RunState.WaitingForMembers
    assert len(core.coordinator.epoch_state.clients) == 1


def test_no_withdraw_on_disconnect_when_disabled() -> None:
    core = started(withdraw_on_disconnect=False)
    to_warmup(core)
    core.on_disconnect(B)
    assert list(core.pending_clients) == [A]
    assert all(c.state is ClientState.Healthy for c in core.coordinator.epoch_state.clients)


def test_a_finished_runs_clients_leave_without_being_withdrawn() -> None:
    core = started()
    to_warmup(core)
    core.coordinator.run_state = RunState.Finished
    before = core.coordinator.to_bytes()
    core.on_disconnect(B)  # every client leaves a finished run: nothing changes
    assert core.coordinator.to_bytes() == before
    assert list(core.pending_clients) == [A]


def test_the_newest_witness_loss_is_kept_for_the_summary() -> None:
    core = started(quick_coordinator(2, 4, 2))
    now = to_round_train(core, to_warmup(core))
    clients = core.coordinator.epoch_state.clients
    participants = [c.id for c in clients]
    losses = [float("inf"), 4.5]  # a witness that trained nothing reports inf: not kept
    for index, (client, loss) in enumerate(zip(clients, losses)):
        witness = round_witness_for(
            core.coordinator, index, participants=participants, bloom_keys=range(8)
        )
        assert witness is not None
        data = OpportunisticData.WitnessStep((witness, WitnessMetadata(loss=loss)))
        core.on_witness(client.id, data, now, 1)
        assert core.last_reported_loss == (None if index == 0 else 4.5)


def test_exited_clients_are_kicked_from_pending_unless_they_join_again() -> None:
    core = started()
    now = to_warmup(core, A, B, C)
    core.coordinator.withdraw(2)
    core.on_tick(now + 1, 3)  # warmup moves C to the exited clients
    assert [c.id for c in core.coordinator.epoch_state.exited_clients] == [C]
    core.on_tick(now + 1, 4)
    assert C not in core.pending_clients  # its Join from before the epoch is undone
    # a Join sent after it left asks to come back: kept on every later tick (upstream undid it)
    core.on_join(C, "test-run")
    for seed in (5, 6, 7):
        core.on_tick(now + 1, seed)
    assert C in core.pending_clients


def test_init_warmup_time_lasts_until_the_run_is_active() -> None:
    core = started(init_warmup_time=30)
    assert core.original_warmup_time == 2
    assert core.coordinator.config.warmup_time == 30
    now = to_warmup(core)
    core.after_change()
    assert core.coordinator.config.warmup_time == 30
    core.on_tick(now + 10, 5)
    assert core.coordinator.run_state is RunState.Warmup  # 30 s, not 2
    to_round_train(core, now + 10)
    core.after_change()
    assert core.coordinator.config.warmup_time == 2
    # and a saved state never keeps the override
    early = started(init_warmup_time=30)
    assert early.snapshot().config.warmup_time == 2


def test_broadcast_rules() -> None:
    core = started(quick_coordinator(2, 4, 2))
    now = to_warmup(core)
    clients = core.coordinator.epoch_state.clients
    # a warmup witness that does not change the state: no broadcast; the last one does
    assert not core.on_witness(A, OpportunisticData.WarmupStep(warmup_witness_for(0)), now, 1)
    assert core.on_witness(B, OpportunisticData.WarmupStep(warmup_witness_for(1)), now, 1)
    assert core.coordinator.run_state is RunState.RoundTrain
    # a rejected witness: logged, no broadcast, nothing changes
    before = core.coordinator.to_bytes()
    assert not core.on_witness(A, OpportunisticData.WarmupStep(warmup_witness_for(0)), now, 1)
    assert core.coordinator.to_bytes() == before
    # both round witnesses: the second moves training to the witness phase (broadcast)
    changed = []
    for index, client in enumerate(clients):
        witness = round_witness_for(
            core.coordinator, index, participants=[c.id for c in clients], bloom_keys=range(8)
        )
        assert witness is not None
        data = OpportunisticData.WitnessStep((witness, WitnessMetadata()))
        changed.append(core.on_witness(client.id, data, now, 1))
    assert changed == [False, True]
    assert core.coordinator.run_state is RunState.RoundWitness
    # a health check that drops nobody (rejected before height 2): no broadcast
    assert not core.on_health_check(A, [])
    # a checkpoint broadcasts only when a member's changes the run's (upstream: always, even
    # from a stranger); a stranger's is dropped unheard
    core.coordinator.model.value.checkpoint = Checkpoint.Hub(HubRepo("old"))  # type: ignore[attr-defined]
    assert not core.on_checkpoint(C, Checkpoint.Hub(HubRepo("x")))
    assert core.ignored.counts == {"Checkpoint from non-members": 1}
    assert core.on_checkpoint(A, Checkpoint.Hub(HubRepo("x")))
    assert core.coordinator.model.value.checkpoint == Checkpoint.Hub(HubRepo("x"))  # type: ignore[attr-defined]
    assert not core.on_checkpoint(B, Checkpoint.Hub(HubRepo("x")))  # the same again


def test_health_check_drops_broadcast() -> None:
    sim = Simulation(quick_coordinator(3, 3, 3), now=NOW, rng=random.Random(5), record=False)
    for i in range(3):
        sim.join(simulated_identity(i))
    sim.tick(2)
    sim.send_warmup_witnesses()
    for _ in range(2):
        sim.send_round_witnesses(missing=[simulated_identity(2)])
        sim.tick(1)
        sim.tick(1)
    assert sim.coordinator.run_state is RunState.RoundTrain
    core = ServerCore(sim.coordinator, 2)
    from psyche.coordinator.testing import health_checks_for

    checks = health_checks_for(core.coordinator)
    assert [c for c, _ in checks] == [simulated_identity(2)]
    assert core.on_health_check(simulated_identity(0), checks) is True
    assert core.coordinator.epoch_state.clients[2].state is ClientState.Dropped
    assert core.on_health_check(simulated_identity(0), checks) is False  # already dropped
    # a list longer than the run's clients (repeats) is refused before the coordinator sees it
    assert core.on_health_check(simulated_identity(0), checks * 4) is False


def test_halted_tick_and_pause_toggle() -> None:
    core = started()
    core.toggle_pause(NOW)
    assert core.coordinator.run_state is RunState.Paused
    assert core.on_tick(NOW + 5, 1).epoch_end is None  # Halted: silent
    core.toggle_pause(NOW + 6)
    assert core.coordinator.run_state is RunState.WaitingForMembers


def test_a_full_epoch_without_witnesses_ends_successfully() -> None:
    core = started()
    now = to_round_train(core, to_warmup(core))
    ends = []
    for t in range(now + 1, now + 40):
        outcome = core.on_tick(t, t)
        if outcome.epoch_end is not None:
            ends.append(outcome.epoch_end)
            break
    # no witness: everyone withdrawn, cooldown, epoch 1, the checkpoint now P2P
    assert ends == [True]
    assert core.coordinator.progress.epoch == 1
    assert isinstance(core.coordinator.model.value.checkpoint, Checkpoint.P2P)  # type: ignore[attr-defined]


# ---- the state a server starts from and saves ----------------------------------------------


def mid_epoch() -> ServerCore:
    core = started()
    to_round_train(core, to_warmup(core, A, B, C))
    core.coordinator.withdraw(2)
    return core


def test_snapshot_closes_a_running_epoch_as_its_cooldown_would() -> None:
    core = mid_epoch()
    live = core.coordinator
    current = live.current_round()
    assert current is not None
    snapshot = core.snapshot()
    assert live.run_state is RunState.RoundTrain  # the live state is untouched
    assert snapshot.run_state is RunState.WaitingForMembers
    assert snapshot.progress.epoch == live.progress.epoch + 1
    assert snapshot.progress.step == live.progress.step
    assert snapshot.progress.epoch_start_data_index == current.data_index + 4
    assert [c.id for c in snapshot.epoch_state.clients] == [A, B]  # identities kept
    assert snapshot.epoch_state.exited_clients == []
    assert snapshot.model.value.checkpoint == Checkpoint.P2P(HubRepo(""))  # type: ignore[attr-defined]


def test_closing_matches_a_real_cooldown() -> None:
    """A state saved in cooldown equals the state the cooldown tick produces."""
    sim = Simulation(quick_coordinator(), now=NOW, rng=random.Random(2), record=False)
    sim.join(A)
    sim.join(B)
    sim.tick(2)
    sim.send_warmup_witnesses()
    sim.run_until(lambda c: c.run_state is RunState.Cooldown, 100)
    closed = sim.coordinator.copy()
    close_epoch(closed)
    sim.run_until(lambda c: c.run_state is not RunState.Cooldown, 10)
    ticked = sim.coordinator
    assert ticked.run_state is RunState.WaitingForMembers
    assert closed.progress == ticked.progress
    assert closed.model == ticked.model
    assert [c.id for c in closed.epoch_state.clients] == [c.id for c in ticked.epoch_state.clients]


def test_snapshot_is_idempotent_and_keeps_finished_runs_finished() -> None:
    core = mid_epoch()
    once = core.snapshot()
    assert resume_snapshot(once, once.config.warmup_time) == once
    finished = quick_coordinator()
    finished.run_state = RunState.Finished
    assert resume_snapshot(finished, 2).run_state is RunState.Finished
    assert prepare_for_start(finished, NOW).run_state is RunState.Finished


def test_start_counts_waiting_time_from_now_only_for_saved_states() -> None:
    fresh = quick_coordinator()
    assert prepare_for_start(fresh, NOW).run_state_start_unix_timestamp == 0
    saved = mid_epoch().snapshot()
    assert saved.run_state_start_unix_timestamp != 0
    assert prepare_for_start(saved, NOW + 99).run_state_start_unix_timestamp == NOW + 99


def test_a_returning_client_keeps_the_p2p_checkpoint() -> None:
    """After a restart, a client of the last epoch rejoining keeps the model peer to peer; with
    only newcomers the checkpoint falls back to the repo (upstream's rule)."""
    saved = mid_epoch().snapshot()
    for joiners, expected in (
        ([A, C], Checkpoint.P2P),
        ([C, simulated_identity(9)], Checkpoint.Hub),
    ):
        core = ServerCore.start(saved.copy(), now=NOW)
        for client in joiners:
            core.on_join(client, "test-run")
        core.on_tick(NOW + 2, 1)
        assert core.coordinator.run_state is RunState.Warmup
        assert isinstance(core.coordinator.model.value.checkpoint, expected)  # type: ignore[attr-defined]
        assert core.coordinator.progress == saved.progress
