"""Issue 27 on a ServerCore, without sockets: a verifying round's duties are recorded when it
starts, reports are heard once per member and round about its own duties, and a dispute the
tie-breaker decides drops and bans its loser (the trainer that lied, or the verifier that did)."""

from __future__ import annotations

from psyche.coordinator import ClientState, RunState
from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.server_core import ServerCore
from psyche.coordinator.testing import (
    keyed_identity,
    quick_coordinator,
    simulated_identity,
    simulated_key,
    warmup_witness_for,
)
from psyche.coordinator.verification import (
    Finding,
    RoundVerification,
    VerificationDuty,
    VerificationReport,
)
from psyche.core import NodeIdentity

NOW = 1_000_000
CLIENTS = [keyed_identity(i) for i in range(5)]
KEYS = {keyed_identity(i).signer: simulated_key(i) for i in range(5)}


def verifying_round(percent: int = 25) -> tuple[ServerCore, RoundVerification]:
    coordinator = quick_coordinator(init_min_clients=5, global_batch_size=8, epoch_time=60)
    coordinator.config.verification_percent = percent
    core = ServerCore.start(coordinator, now=NOW)
    for client in CLIENTS:
        core.on_join(client, core.run_id)
    core.on_tick(NOW + 2, 1)
    assert core.coordinator.run_state is RunState.Warmup
    for index, client in enumerate(core.coordinator.epoch_state.clients):
        core.on_witness(
            client.id, OpportunisticData.WarmupStep(warmup_witness_for(index)), NOW + 2, 7
        )
    assert core.coordinator.run_state is RunState.RoundTrain
    core.on_tick(NOW + 3, 9)  # the tick after the round started records its duties
    step = core.coordinator.progress.step
    return core, core.verification[step]


def checked(record: RoundVerification) -> tuple[list[VerificationDuty], bytes]:
    """What the round's verifier checks (its draw, signed with its key), and its draw."""
    verifier = record.duties.verifiers[0].verifier
    checks = record.duties.checks(verifier, KEYS[verifier.signer].sign)
    assert checks is not None
    return checks


def report(record: RoundVerification, sender: NodeIdentity, wrong: bool) -> VerificationReport:
    """`sender`'s findings on the batches the verifier checks (a tie-breaker's: the same)."""
    duties, draw = checked(record)
    if record.duties.is_tie_breaker(sender):
        draw = bytes(64)
    return VerificationReport(
        record.duties.step,
        [Finding(d.batch_id, not wrong, 2.0 if wrong else 0.0) for d in duties],
        draw,
    )


def roles(record: RoundVerification) -> tuple[NodeIdentity, NodeIdentity, NodeIdentity]:
    verifier = record.duties.verifiers[0].verifier
    tie_breaker = record.duties.tie_breakers[0].verifier
    return verifier, tie_breaker, checked(record)[0][0].trainer


def state_of(core: ServerCore, node: NodeIdentity) -> ClientState:
    return next(c.state for c in core.coordinator.epoch_state.clients if c.id == node)


def test_upstream_runs_record_no_duties() -> None:
    core = ServerCore.start(quick_coordinator(init_min_clients=2), now=NOW)
    for client in CLIENTS[:2]:
        core.on_join(client, core.run_id)
    core.on_tick(NOW + 2, 1)
    for index, client in enumerate(core.coordinator.epoch_state.clients):
        core.on_witness(
            client.id, OpportunisticData.WarmupStep(warmup_witness_for(index)), NOW + 2, 7
        )
    core.on_tick(NOW + 3, 9)
    assert core.coordinator.run_state is RunState.RoundTrain
    assert core.verification == {}


def test_a_trainer_that_lied_is_dropped_and_banned() -> None:
    core, record = verifying_round()
    verifier, tie_breaker, trainer = roles(record)
    # one verifier at 25 % of 5 clients checks two of the round's three trainers (drawn by its
    # own signature from its pool of all three), the tie-breaker may arbitrate any of the three
    duties, draw = checked(record)
    assert len(duties) == len({d.trainer for d in duties}) == 2
    assert len(record.duties.verifiers) == 3
    assert {d.batch_id for d in record.duties.tie_breakers} == {
        d.batch_id for d in record.duties.verifiers
    }
    accusation = VerificationReport(record.duties.step, [
        Finding(d.batch_id, d.trainer != trainer, 0.0 if d.trainer != trainer else 2.0)
        for d in duties
    ], draw)  # fmt: skip
    assert core.on_verification(verifier, accusation) is False  # one word decides nothing
    assert state_of(core, trainer) is ClientState.Healthy
    assert core.accepted_verification == (verifier, accusation)  # the server relays it
    # the tie-breaker answers only the dispute (in the next round: it recomputes no more)
    verdict = VerificationReport(record.duties.step, [
        Finding(d.batch_id, False, 2.0) for d in record.duties.of(tie_breaker) if d.trainer == trainer
    ])  # fmt: skip
    assert core.on_verification(tie_breaker, verdict) is True  # broadcast: a client dropped
    assert state_of(core, trainer) is ClientState.Dropped
    assert trainer in core.banned
    assert verifier not in core.banned
    assert "verification, as trainer" in core.banned[trainer].reason
    punished = [e for e in core.verification_log if e.kind == "punished"]
    assert [e.subject for e in punished] == [trainer]
    verified = [e for e in core.verification_log if e.kind == "verified"]
    assert {(e.by, e.matches) for e in verified if e.subject == trainer} == {
        (verifier, False),
        (tie_breaker, False),
    }


def test_a_verifier_that_lied_is_dropped_and_banned() -> None:
    core, record = verifying_round()
    verifier, tie_breaker, trainer = roles(record)
    # before any accusation the tie-breaker is not heard (nothing is disputed)
    assert core.on_verification(tie_breaker, report(record, tie_breaker, wrong=False)) is False
    assert core.accepted_verification is None
    assert core.on_verification(verifier, report(record, verifier, wrong=True)) is False
    assert state_of(core, verifier) is ClientState.Healthy  # one word decides nothing
    assert core.on_verification(tie_breaker, report(record, tie_breaker, wrong=False)) is True
    assert state_of(core, verifier) is ClientState.Dropped
    assert state_of(core, trainer) is ClientState.Healthy
    assert set(core.banned) == {verifier}
    assert "verification, as verifier" in core.banned[verifier].reason


def test_strangers_floods_and_wrong_reports_cost_nothing() -> None:
    core, record = verifying_round()
    verifier, tie_breaker, trainer = roles(record)
    stranger = simulated_identity(99)
    before = core.coordinator.to_bytes()
    assert core.on_verification(stranger, report(record, verifier, wrong=True)) is False
    assert core.ignored.counts == {"Verification from non-members": 1}
    # a trainer has no duty; another step is no recent verified round
    assert core.on_verification(trainer, VerificationReport(record.duties.step, [])) is False
    assert core.on_verification(verifier, VerificationReport(record.duties.step + 5, [])) is False
    # one report per sender and round: the flood after it is refused, one count each
    assert core.on_verification(verifier, report(record, verifier, wrong=False)) is False
    for _ in range(100):
        assert core.on_verification(verifier, report(record, verifier, wrong=True)) is False
    assert core.rejected.counts == {"Verification": 102}
    assert core.coordinator.to_bytes() == before
    assert not core.banned
    # and the honest verdict of the tie-breaker changes nothing either
    assert core.on_verification(tie_breaker, report(record, tie_breaker, wrong=False)) is False
    assert not core.banned
    assert core.coordinator.to_bytes() == before


def test_duties_are_kept_for_the_latest_rounds_only() -> None:
    core, record = verifying_round()
    from psyche.coordinator.server_core import VERIFIED_ROUNDS

    steps = {record.duties.step}
    now = NOW + 3
    for _ in range(40):
        now += 1
        core.on_tick(now, now)
        steps |= set(core.verification)
        assert len(core.verification) <= VERIFIED_ROUNDS
    assert len(steps) > VERIFIED_ROUNDS  # rounds went by, each recorded once


def test_a_round_is_recorded_before_its_first_tick() -> None:
    # the round started by the last warmup witness, no tick since: a report still finds it
    core, _ = verifying_round()
    core.verification.clear()
    step = core.coordinator.progress.step
    record_again = core.on_verification(CLIENTS[0], VerificationReport(step, []))
    assert record_again is False
    assert step in core.verification
