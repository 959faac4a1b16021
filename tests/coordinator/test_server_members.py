"""Issue 13's server rules on a ServerCore, event by event: only members are heard, a private run
admits only its authorized keys, and a member that does not deliver sits out `ban_epochs` epochs
(while honest clients are never banned)."""

from __future__ import annotations

import logging
from copy import deepcopy
from dataclasses import replace

import pytest

from psyche.coordinator import ClientState, RunState, WitnessMetadata
from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.committee_selection import CommitteeSelection
from psyche.coordinator.model import Checkpoint, HubRepo
from psyche.coordinator.server_core import ServerCore
from psyche.coordinator.testing import (
    health_checks_for,
    quick_coordinator,
    round_witness_for,
    simulated_identity,
    warmup_witness_for,
)
from psyche.core.node_identity import NodeIdentity

NOW = 1_000_000
RUN = "test-run"
A, B, C, D = (simulated_identity(i) for i in range(4))


def started(*, clients: int = 3, **kw: object) -> ServerCore:
    # one witness a round, as configs/tiny-cpu; min_clients 1 so an epoch goes on with fewer
    coordinator = quick_coordinator(clients, 8, 1, min_clients=1)
    return ServerCore.start(coordinator, now=NOW, **kw)  # type: ignore[arg-type]


def start_epoch(core: ServerCore, now: int, *joining: NodeIdentity) -> int:
    """Join `joining`, tick until the epoch's first round trains (every member sends its warmup
    witness); the time reached."""
    for client in joining:
        core.on_join(client, RUN)
    for _ in range(20):
        now += 1
        core.on_tick(now, now)
        if core.coordinator.run_state is RunState.Warmup:
            break
    assert core.coordinator.run_state is RunState.Warmup, core.coordinator.run_state
    for index, client in enumerate(core.coordinator.epoch_state.clients):
        core.on_witness(client.id, OpportunisticData.WarmupStep(warmup_witness_for(index)), now, 7)
    assert core.coordinator.run_state is RunState.RoundTrain
    return now


def epoch_clients(core: ServerCore) -> list[NodeIdentity]:
    return [c.id for c in core.coordinator.epoch_state.clients]


def elected_witness(core: ServerCore) -> NodeIdentity:
    selection = CommitteeSelection.from_coordinator(core.coordinator, 0)
    clients = core.coordinator.epoch_state.clients
    (witness,) = [c.id for i, c in enumerate(clients) if selection.get_witness(i).witness]
    return witness


def witness_round(
    core: ServerCore,
    now: int,
    *,
    silent: frozenset[NodeIdentity] = frozenset(),
    untrained: frozenset[NodeIdentity] = frozenset(),
) -> int:
    """The round's elected witnesses (but `silent` ones) attest every trainer (but `silent` and
    `untrained` ones); then tick until the round is over. Returns the time reached."""
    coordinator = core.coordinator
    clients = coordinator.epoch_state.clients
    participants = [c.id for c in clients if c.id not in silent | untrained]
    step = coordinator.progress.step
    for index, client in enumerate(clients):
        if client.id in silent or client.state is not ClientState.Healthy:
            continue
        witness = round_witness_for(
            coordinator, index, participants=participants, bloom_keys=range(8)
        )
        if witness is not None:
            data = OpportunisticData.WitnessStep((witness, WitnessMetadata()))
            core.on_witness(client.id, data, now, 7)
    for _ in range(20):
        if coordinator.progress.step != step or coordinator.run_state is RunState.Cooldown:
            break
        now += 1
        core.on_tick(now, now)
    return now


def finish_epoch(core: ServerCore, now: int) -> int:
    """Tick through the cooldown into WaitingForMembers (the next epoch's number)."""
    for _ in range(20):
        if core.coordinator.run_state is RunState.WaitingForMembers:
            return now
        now += 1
        core.on_tick(now, now)
    raise AssertionError(core.coordinator.run_state)


# ---- only members are heard ----------------------------------------------------------------


def test_messages_from_non_members_are_dropped_unheard_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core = started(clients=2)
    now = start_epoch(core, NOW, A, B)
    stranger = simulated_identity(66)
    core.on_join(C, RUN)  # pending, not a member of the running epoch
    before = core.coordinator.to_bytes()
    index = epoch_clients(core).index(elected_witness(core))
    witness = round_witness_for(core.coordinator, index, participants=[A, B], bloom_keys=range(8))
    assert witness is not None
    caplog.set_level(logging.INFO, "psyche.coordinator.server_core")
    for sender in [stranger, C] * 250:
        assert not core.on_checkpoint(sender, Checkpoint.Hub(HubRepo("spam")))
        assert not core.on_witness(
            sender, OpportunisticData.WitnessStep((witness, WitnessMetadata())), now, 1
        )
        assert not core.on_health_check(sender, [(A, witness.proof)])  # type: ignore[list-item]
    # nothing reached the coordinator, nothing asks for a broadcast
    assert core.coordinator.to_bytes() == before
    assert core.ignored.counts == {
        "Checkpoint from non-members": 500,
        "Witness from non-members": 500,
        "HealthCheck from non-members": 500,
    }
    # one line per kind until the interval's summary
    ignored = [r for r in caplog.records if "ignoring a" in r.getMessage()]
    assert len(ignored) == 3, [r.getMessage() for r in ignored]
    caplog.clear()
    core.ignored.flush()
    (summary,) = [r.getMessage() for r in caplog.records]
    assert "499 Checkpoint from non-members" in summary, summary
    assert "499 HealthCheck from non-members" in summary
    assert "499 Witness" in summary


def test_a_members_repeated_checkpoint_is_not_broadcast_again() -> None:
    core = started(clients=2)
    start_epoch(core, NOW, A, B)
    core.coordinator.model.value.checkpoint = Checkpoint.P2P(HubRepo("old"))  # type: ignore[attr-defined]
    assert core.on_checkpoint(A, Checkpoint.Hub(HubRepo("new")))
    assert not any(core.on_checkpoint(A, Checkpoint.Hub(HubRepo("new"))) for _ in range(100))


def test_a_repeated_join_changes_nothing_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    core = started()
    caplog.set_level(logging.INFO, "psyche.coordinator.server_core")
    for _ in range(200):
        assert core.on_join(A, RUN) is False
        assert core.on_join(B, "another-run") is False
    assert list(core.pending_clients) == [A]
    assert sum("added pending client" in r.getMessage() for r in caplog.records) == 1
    assert sum("another-run" in r.getMessage() for r in caplog.records) == 1
    assert core.ignored.counts == {"Join for another run": 200}


# ---- who may join ----------------------------------------------------------------------------


def test_a_private_run_admits_only_its_authorized_keys() -> None:
    core = started(clients=2, authorized=frozenset({A.signer, B.signer}))
    assert core.is_authorized(A.signer)
    assert not core.is_authorized(C.signer)
    for client in (C, A, B, C):
        core.on_join(client, RUN)
    assert list(core.pending_clients) == [A, B]
    assert core.ignored.counts == {"Join from unauthorized keys": 2}
    start_epoch(core, NOW)
    assert epoch_clients(core) == [A, B]
    # an open run (the default) takes anyone with the run id
    open_run = started()
    open_run.on_join(C, RUN)
    assert list(open_run.pending_clients) == [C]


# ---- a member that does not deliver ------------------------------------------------------------


def silent_witness_epoch(core: ServerCore) -> tuple[NodeIdentity, int]:
    """An epoch of A, B, C whose first round's elected witness keeps silent: the round ends
    without a witness, every client is withdrawn and the epoch ends (upstream's rule)."""
    now = start_epoch(core, NOW, A, B, C)
    silent = elected_witness(core)
    now = witness_round(core, now, silent=frozenset({silent}))
    assert core.coordinator.run_state is RunState.Cooldown
    assert all(c.state is ClientState.Withdrawn for c in core.coordinator.epoch_state.clients)
    return silent, finish_epoch(core, now)


def test_a_silent_witness_sits_out_the_next_epoch_and_the_others_go_on() -> None:
    core = started(clients=2)  # init_min_clients 2: the two others can start without it
    silent, now = silent_witness_epoch(core)
    others = [c for c in (A, B, C) if c != silent]
    assert set(core.banned) == {silent}
    assert core.banned[silent].until_epoch == 2
    # it joins again at once (and again): it waits, the others start epoch 1 without it
    core.on_join(silent, RUN)
    now = start_epoch(core, now, silent)
    assert core.coordinator.progress.epoch == 1
    assert epoch_clients(core) == others
    assert silent in core.pending_clients  # kept: it comes back by itself
    # epoch 1 delivers; at epoch 2 the ban is over and it is a member again
    while core.coordinator.run_state is not RunState.Cooldown:
        now = witness_round(core, now)
    now = finish_epoch(core, now)
    start_epoch(core, now)
    assert core.coordinator.progress.epoch == 2
    assert silent in epoch_clients(core)
    assert not core.banned


def test_a_member_that_fails_again_soon_after_its_ban_is_banned_twice_as_long(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A first offence costs `ban_epochs`; one within as many epochs after the ban as it lasted
    doubles the last ban (up to MAX_BAN_EPOCHS); a member clean for that long starts afresh."""
    core = started(clients=2, ban_epochs=2)
    silent, _ = silent_witness_epoch(core)
    assert (core.banned[silent].epochs, core.banned[silent].until_epoch) == (2, 3)
    caplog.set_level(logging.WARNING, "psyche.coordinator.server_core")
    # the same member fails again (dropped by a health check) in the epochs that follow
    offences = []
    for epoch in (3, 6, 11, 20, 37, 70, 135):
        core.coordinator.progress.epoch = epoch
        core._disconnected.clear()
        core._ban(silent, "dropped by a health check from someone")
        core._ban(silent, "elected witness of a later step")  # same epoch: no second ban
        ban = core.banned[silent]
        offences.append((ban.epochs, ban.until_epoch))
    assert offences == [(4, 8), (8, 15), (16, 28), (32, 53), (64, 102), (64, 135), (64, 200)]
    assert (
        caplog.records[-1]
        .getMessage()
        .endswith(
            "left out of the run's epochs before 200 (64 epochs; it did so again soon after its last ban)"
        )
    )
    # clean for as long after its last ban as that ban lasted: the record is forgotten
    core.coordinator.progress.epoch = 200 + 64
    core.admissible_pending()
    assert not core.banned
    assert not core.ban_record
    core._ban(silent, "dropped by a health check from someone")
    assert core.banned[silent].epochs == 2


def test_ban_epochs_zero_keeps_upstreams_rules() -> None:
    core = started(clients=2, ban_epochs=0)
    silent, now = silent_witness_epoch(core)
    assert not core.banned
    start_epoch(core, now)
    assert silent in epoch_clients(core)
    assert len(epoch_clients(core)) == 3


def test_a_witness_that_sent_a_witness_or_disconnected_is_never_banned() -> None:
    # it sent one (too late, or invalid: the coordinator refused it): it did not keep silent
    core = started(clients=2)
    now = start_epoch(core, NOW, A, B, C)
    witness = elected_witness(core)
    index = epoch_clients(core).index(witness)
    valid = round_witness_for(core.coordinator, index, participants=[], bloom_keys=range(8))
    assert valid is not None
    invalid = replace(valid, proof=replace(valid.proof, witness=False))
    core.on_witness(witness, OpportunisticData.WitnessStep((invalid, WitnessMetadata())), now, 1)
    assert core.rejected.counts == {"Witness (InvalidWitness)": 1}
    now = witness_round(core, now, silent=frozenset({witness}))
    assert core.coordinator.run_state is RunState.Cooldown
    assert not core.banned
    # it lost its connection during the epoch (kept in the run: no withdraw on disconnect)
    core = started(clients=2, withdraw_on_disconnect=False)
    now = start_epoch(core, NOW, A, B, C)
    witness = elected_witness(core)
    core.on_disconnect(witness)
    core.on_join(witness, RUN)  # the restarted process is back within the round
    now = witness_round(core, now, silent=frozenset({witness}))
    assert core.coordinator.run_state is RunState.Cooldown
    assert not core.banned


def test_a_ban_never_keeps_a_run_waiting_that_could_start_with_it() -> None:
    core = started(clients=3)  # init_min_clients 3: the run needs the silent one back
    silent, now = silent_witness_epoch(core)
    assert silent in core.banned
    core.on_join(silent, RUN)
    start_epoch(core, now)
    assert len(epoch_clients(core)) == 3


def health_check_epoch(core: ServerCore) -> tuple[NodeIdentity, int]:
    """An epoch of A, B, C in which one that is never elected witness never trains either: once
    the pipeline is full the round's witness names it in a health check and it is dropped."""
    now = start_epoch(core, NOW, A, B, C)
    idle = never_elected(core, now, 3)
    while True:
        now = witness_round(core, now, silent=frozenset({idle}))
        round_ = core.coordinator.current_round()
        assert round_ is not None
        if round_.height >= 2:
            break
    checks = health_checks_for(core.coordinator)
    assert [c for c, _ in checks] == [idle]
    assert core.on_health_check(elected_witness(core), checks) is True
    assert idle in core.banned
    assert core.banned[idle].reason.startswith("dropped by a health check")
    while core.coordinator.run_state is not RunState.Cooldown:
        now = witness_round(core, now)
    return idle, finish_epoch(core, now)


def test_a_member_dropped_by_a_health_check_cannot_come_straight_back_by_reconnecting() -> None:
    core = started(clients=2)
    dropped, now = health_check_epoch(core)
    # upstream's bypass: reconnect (exempt from the kick) and join again
    core.on_disconnect(dropped)
    core.on_join(dropped, RUN)
    assert dropped in core.pending_clients
    now = start_epoch(core, now)
    assert dropped not in epoch_clients(core)
    assert len(epoch_clients(core)) == 2
    while core.coordinator.run_state is not RunState.Cooldown:
        now = witness_round(core, now)
    start_epoch(core, finish_epoch(core, now))
    assert dropped in epoch_clients(core)


def never_elected(core: ServerCore, now: int, rounds: int) -> NodeIdentity:
    """A client that is no elected witness of the next `rounds` rounds (found on a copy where
    everyone delivers: who is elected depends only on the seeds and the number of clients)."""
    trial = deepcopy(core)
    elected = set()
    for _ in range(rounds):
        elected.add(elected_witness(trial))
        now = witness_round(trial, now)
    (choice, *_) = [c for c in epoch_clients(core) if c not in elected]
    return choice


def test_a_client_that_left_is_not_banned_by_a_later_health_check() -> None:
    core = started(clients=2, withdraw_on_disconnect=False)
    now = start_epoch(core, NOW, A, B, C)
    crashed = never_elected(core, now, 3)
    core.on_disconnect(crashed)  # a crash: it stays in the run (no withdraw), silent
    while True:
        now = witness_round(core, now, silent=frozenset({crashed}))
        round_ = core.coordinator.current_round()
        assert round_ is not None
        assert core.coordinator.run_state is RunState.RoundTrain
        if round_.height >= 2:
            break
    checks = health_checks_for(core.coordinator)
    assert [c for c, _ in checks] == [crashed]
    assert core.on_health_check(elected_witness(core), checks) is True
    assert not core.banned


# ---- issue 24: a late witness is not a silent one; a banned member's Join is kept -------------


def late_witness_epoch(core: ServerCore) -> tuple[NodeIdentity, OpportunisticData, int]:
    """An epoch of A, B, C whose first round's elected witness sends its witness only after the
    round ended (held back here: a loaded machine). Returns it, its witness, the time reached
    (the run in Cooldown)."""
    now = start_epoch(core, NOW, A, B, C)
    late = elected_witness(core)
    index = epoch_clients(core).index(late)
    witness = round_witness_for(
        core.coordinator, index, participants=[A, B, C], bloom_keys=range(8)
    )
    assert witness is not None
    metadata = WitnessMetadata(step=core.coordinator.progress.step)
    now = witness_round(core, now, silent=frozenset({late}))
    assert core.coordinator.run_state is RunState.Cooldown
    assert late in core.banned  # silent so far
    return late, OpportunisticData.WitnessStep((witness, metadata)), now


def test_a_witness_that_arrives_after_its_round_lifts_the_ban_and_the_run_goes_on() -> None:
    """Issue 24, item 3: the round ended without a witness (every client withdrawn), then the
    elected witness's message arrives. Before, it was banned and dropped from the pending set,
    and a run that needs it waited forever with the client connected."""
    core = started(clients=3)  # the next epoch needs all three
    late, data, now = late_witness_epoch(core)
    now = finish_epoch(core, now)  # it arrives even later: after the cooldown
    core.on_witness(late, data, now, 1)
    assert not core.banned
    assert late not in core.ban_record
    start_epoch(core, now)  # nobody joins again
    assert core.coordinator.progress.epoch == 1
    assert set(epoch_clients(core)) == {A, B, C}


def test_a_witness_later_than_the_next_epochs_start_does_not_lift_the_ban() -> None:
    core = started(clients=2)
    late, data, now = late_witness_epoch(core)
    now = start_epoch(core, finish_epoch(core, now))
    assert late not in epoch_clients(core)
    core.on_witness(late, data, now, 1)
    assert late in core.banned


def test_a_banned_witness_is_back_after_its_ban_without_joining_again() -> None:
    """Issue 24, item 3: docs/centralized.md says a banned member's Join is kept; it was kicked
    when the cooldown passed in one tick (a loaded server skips ticks), and a client that does
    not know it was banned (it stays connected, joined) never came back."""
    core = started(clients=2)
    now = start_epoch(core, NOW, A, B, C)
    silent = elected_witness(core)
    step = core.coordinator.progress.step
    while core.coordinator.progress.step == step:  # its round, one tick per phase
        now += 10
        core.on_tick(now, now)
    assert core.coordinator.run_state is RunState.Cooldown
    assert silent in core.banned
    now += 10
    core.on_tick(now, now)  # the whole cooldown in one tick
    assert core.coordinator.run_state is RunState.WaitingForMembers
    now = start_epoch(core, now)  # epoch 1: the others, without it
    assert silent not in epoch_clients(core)
    assert silent in core.pending_clients
    while core.coordinator.run_state is not RunState.Cooldown:
        now = witness_round(core, now)
    start_epoch(core, finish_epoch(core, now))
    assert core.coordinator.progress.epoch == 2
    assert silent in epoch_clients(core)


def test_a_member_dropped_by_a_health_check_is_back_after_its_ban_without_joining_again() -> None:
    core = started(clients=2)
    dropped, now = health_check_epoch(core)
    assert dropped in core.pending_clients  # its Join kept, not kicked
    now = start_epoch(core, now)
    assert dropped not in epoch_clients(core)
    while core.coordinator.run_state is not RunState.Cooldown:
        now = witness_round(core, now)
    start_epoch(core, finish_epoch(core, now))
    assert dropped in epoch_clients(core)


@pytest.mark.parametrize("disconnect_first", [True, False])
def test_a_banned_members_come_back_join_is_logged_once_however_its_events_are_ordered(
    caplog: pytest.LogCaptureFixture, disconnect_first: bool
) -> None:
    """A dropped member that reconnects and joins again is logged the same way whether its old
    connection's disconnect is handled first (its old Join removed) or its new connection's Join
    is (the old Join still pending; the server then ignores the stale disconnect): the latter
    logged nothing, and tests/e2e/test_hostile_members.py waited for a later ban's line."""
    core = started(clients=2)
    dropped, now = health_check_epoch(core)
    caplog.set_level(logging.INFO, "psyche.coordinator.server_core")
    if disconnect_first:
        core.on_disconnect(dropped)
    for _ in range(5):
        core.on_join(dropped, RUN)
    (line,) = [r.getMessage() for r in caplog.records if "added pending client" in r.getMessage()]
    until = core.banned[dropped].until_epoch
    assert line.startswith(f"added pending client {dropped}; it sits out the epochs before {until}")
    assert dropped in core.pending_clients
    now = start_epoch(core, now)
    assert dropped not in epoch_clients(core)


def test_ban_epochs_zero_still_kicks_a_dropped_member_that_says_nothing() -> None:
    core = started(clients=2, ban_epochs=0)
    now = start_epoch(core, NOW, A, B, C)
    idle = never_elected(core, now, 3)
    while (round_ := core.coordinator.current_round()) is not None and round_.height < 2:
        now = witness_round(core, now, silent=frozenset({idle}))
    assert core.on_health_check(elected_witness(core), health_checks_for(core.coordinator))
    now = witness_round(core, now)
    core.on_tick(now + 1, 1)
    assert idle not in core.pending_clients  # upstream's rule
