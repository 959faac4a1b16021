"""Verifiers and tie-breakers (`psyche.coordinator.verification`): who verifies whom, the bounds
of a report, and who loses a dispute."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.coordinator import (
    Client,
    Committee,
    CommitteeSelection,
    Coordinator,
    RunState,
    TickResult,
)
from psyche.coordinator.data_selection import assign_data_for_state
from psyche.coordinator.errors import CoordinatorError, CoordinatorErrorKind
from psyche.coordinator.run_config import semantic_problems
from psyche.coordinator.testing import (
    integration_test_coordinator,
    simulated_identity,
)
from psyche.coordinator.verification import (
    MAX_FINDINGS,
    NO_DRAW,
    VERIFIED_BATCHES_PER_VERIFIER,
    Finding,
    RoundDuties,
    RoundVerification,
    VerificationReport,
    draw_message,
    round_duties,
    tie_breaker_tasks_for,
    verification_duties,
    verification_problem,
    verification_seed,
)
from psyche.core import BatchId, NodeIdentity
from psyche.core.deterministic_shuffle import deterministic_shuffle
from psyche.core.serde import PostcardError, from_bytes, max_encoded_size, to_bytes

from .verifying_nodes import checked_by, ids, key_of, report


def round_for(
    n: int, percent: int, seed: int, batch: int = 32, run_id: str = "test-run"
) -> tuple[Coordinator, CommitteeSelection, dict[BatchId, NodeIdentity]]:
    """A round of `n` clients with `percent` % verifiers, started by the coordinator itself."""
    coordinator = integration_test_coordinator(n, batch, 0, run_id)
    coordinator.config.min_clients = coordinator.config.init_min_clients = n
    coordinator.config.verification_percent = percent
    assert coordinator.tick(ids(n), 100, 1) == TickResult.Ticked()
    assert coordinator.tick(ids(n), 125, seed) == TickResult.Ticked()
    assert coordinator.run_state is RunState.RoundTrain
    selection = CommitteeSelection.from_coordinator(coordinator, 0)
    return coordinator, selection, assign_data_for_state(coordinator, selection)


def duties_for(
    n: int, percent: int, seed: int, batch: int = 32, run_id: str = "test-run"
) -> tuple[RoundDuties, dict[BatchId, NodeIdentity]]:
    coordinator, selection, assignments = round_for(n, percent, seed, batch, run_id)
    return duties_of(coordinator, selection, assignments), assignments


def duties_of(
    coordinator: Coordinator,
    selection: CommitteeSelection,
    assignments: dict[BatchId, NodeIdentity],
) -> RoundDuties:
    clients = coordinator.epoch_state.clients
    return round_duties(0, clients, selection, assignments, run_id=coordinator.run_id)


def committees(n: int, percent: int, seed: int) -> dict[NodeIdentity, Committee]:
    coordinator = integration_test_coordinator(n, 32, 0)
    coordinator.config.min_clients = coordinator.config.init_min_clients = n
    coordinator.config.verification_percent = percent
    coordinator.tick(ids(n), 100, 1)
    coordinator.tick(ids(n), 125, seed)
    selection = CommitteeSelection.from_coordinator(coordinator, 0)
    return {
        c.id: selection.get_committee(i).committee
        for i, c in enumerate(coordinator.epoch_state.clients)
    }


# ---- the committees and who verifies whom -------------------------------------------------------


def test_upstream_rounds_have_no_tie_breaker_and_no_verifier() -> None:
    duties, assignments = duties_for(4, 0, 7)
    assert duties.verifiers == ()
    assert duties.tie_breakers == ()
    assert len(set(assignments.values())) == 4  # everyone trains, as upstream


def test_a_verifying_round_elects_one_tie_breaker_and_its_verifiers() -> None:
    by_committee = committees(5, 25, 7)
    counts = {c: list(by_committee.values()).count(c) for c in Committee}
    assert counts == {Committee.TieBreaker: 1, Committee.Verifier: 1, Committee.Trainer: 3}


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(3, 24),
    percent=st.integers(1, 100),
    seed=st.integers(0, 2**64 - 1),
)
def test_a_bounded_sample_is_verified_once_and_the_tie_breaker_recomputes_it(
    n: int, percent: int, seed: int
) -> None:
    duties, assignments = duties_for(n, percent, seed, batch=max(n, 8))
    by_committee = committees(n, percent, seed)
    verifiers = [c for c, k in by_committee.items() if k is Committee.Verifier]
    trainers = {c for c, k in by_committee.items() if k is Committee.Trainer}
    assert set(assignments.values()) <= trainers  # nobody else trains
    pooled = sorted(d.batch_id for d in duties.verifiers)
    if not verifiers:
        assert duties.verifiers == ()
    else:
        # the pools deal every batch once, naming its trainer, evenly
        assert pooled == sorted(assignments)
        for d in duties.verifiers:
            assert assignments[d.batch_id] == d.trainer
            assert by_committee[d.verifier] is Committee.Verifier
        pools = [len(duties.pool(v)) for v in verifiers]
        assert max(pools) - min(pools) <= 1
        # coverage (the draws): min(batches, 2 per verifier), each exactly once
        checked = sorted(d.batch_id for v in verifiers for d in checked_by(duties, v))
        assert len(checked) == len(set(checked))
        assert set(checked) <= set(assignments)
        per = VERIFIED_BATCHES_PER_VERIFIER
        assert len(checked) == min(len(assignments), per * len(verifiers))
        # the load is dealt evenly, and bounded
        loads = [len(checked_by(duties, v)) for v in verifiers]
        assert max(loads) - min(loads) <= 1
        assert max(loads) <= per
    tie_breakers = [c for c, k in by_committee.items() if k is Committee.TieBreaker]
    assert len(tie_breakers) == 1
    assert sorted(d.batch_id for d in duties.tie_breakers) == pooled
    assert dict(duties.assigned) == assignments
    # no one verifies its own result
    assert all(d.verifier != d.trainer for d in (*duties.verifiers, *duties.tie_breakers))


def test_a_round_with_few_verifiers_checks_a_seed_drawn_share() -> None:
    # 21 clients at 10 %: 1 tie-breaker, 2 verifiers, 18 trainers: 4 batches checked a round,
    # which ones drawn from the seed, so over rounds every trainer's turn comes
    checked: set[BatchId] = set()
    for seed in range(12):
        duties, _ = duties_for(21, 10, seed, batch=36)
        verifiers = {d.verifier for d in duties.verifiers}
        assert len(verifiers) == 2
        drawn = [d.batch_id for v in verifiers for d in checked_by(duties, v)]
        assert len(drawn) == 4 == len(set(drawn))
        checked.update(drawn)
    assert len(checked) > 4


def test_the_assignment_is_a_function_of_the_round_only() -> None:
    first, _ = duties_for(9, 40, 12345)
    again, _ = duties_for(9, 40, 12345)
    assert first == again  # anyone can recompute who verified whom
    # and the seed decides it: over several seeds, different verifiers get a given batch
    pairings = {
        tuple((d.batch_id, d.verifier) for d in sorted(duties_for(9, 40, seed)[0].verifiers))
        for seed in range(8)
    }
    assert len(pairings) > 1


def test_no_batches_no_duties() -> None:
    # the epoch's last rounds train nothing: nobody verifies either
    selection = CommitteeSelection(1, 0, 50, 4, 99)
    clients = [Client(i) for i in ids(4)]
    assert verification_duties(clients, selection, {}) == []
    assert round_duties(0, clients, selection, {}, run_id="r").tie_breakers == ()


# ---- config refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("min_clients", "percent", "refused"),
    [
        (4, 0, False),
        (4, 25, False),  # rounded up: 1 tie-breaker, 1 verifier, 2 trainers
        (5, 25, False),
        (4, 34, False),
        (2, 100, True),
        (3, 100, True),
        (3, 50, False),
        (2, 25, True),  # 1 tie-breaker, 1 verifier, no trainer
        (1, 25, True),  # no verifier
    ],
)
def test_a_run_without_a_verifier_or_trainer_is_refused(
    min_clients: int, percent: int, refused: bool
) -> None:
    coordinator = integration_test_coordinator(min_clients, 32, 0)
    coordinator.config.verification_percent = percent
    problem = verification_problem(coordinator.config)
    assert (problem is not None) is refused
    if problem is not None:
        assert problem[0] == "config.verification_percent"
    # loading stays upstream's (upstream's own configs include such a run); validate-config
    # and the server refuse it (tests/centralized/test_server_verification.py)
    assert not semantic_problems(coordinator.config, coordinator.model)


def test_tie_breakers_only_when_verifying() -> None:
    config = integration_test_coordinator(4, 8, 0).config
    assert tie_breaker_tasks_for(config, 4) == 0
    config.verification_percent = 30
    assert tie_breaker_tasks_for(config, 4) == 1
    assert tie_breaker_tasks_for(config, 0) == 0


# ---- reports -----------------------------------------------------------------------------------


def a_round() -> tuple[RoundDuties, NodeIdentity, NodeIdentity, list[BatchId]]:
    """A round of 5 clients at 25 %: its verifier, its tie-breaker, its batches."""
    duties, assignments = duties_for(5, 25, 7)
    (verifier,) = {d.verifier for d in duties.verifiers}
    (tie_breaker,) = {d.verifier for d in duties.tie_breakers}
    return duties, verifier, tie_breaker, list(assignments)


def test_a_report_round_trips_and_is_bounded() -> None:
    duties, verifier, _, _ = a_round()
    sent = report(duties, verifier, set())
    assert from_bytes(to_bytes(sent, VerificationReport), VerificationReport) == sent
    # the encoder's bound: a full report is smaller than a health check naming every client
    size = max_encoded_size(VerificationReport)
    assert size is not None
    assert size < 256 * 30
    with pytest.raises(PostcardError, match="FixedVec is full"):
        to_bytes(VerificationReport(0, [sent.findings[0]] * (MAX_FINDINGS + 1)), VerificationReport)


def test_reports_are_checked_against_the_senders_duties() -> None:
    duties, verifier, tie_breaker, batches = a_round()
    trainer = next(d.trainer for d in duties.verifiers)
    stranger = simulated_identity(99)
    record = RoundVerification(duties)
    assert record.add(trainer, VerificationReport(0, [])) is not None  # a trainer has no duty
    assert record.add(stranger, VerificationReport(0, [])) is not None
    assert record.add(verifier, VerificationReport(1, [])) is not None  # another round
    own = checked_by(duties, verifier)[0]
    draw = report(duties, verifier, set()).draw
    not_own = Finding(BatchId(10**6, 10**6), False, 1.0)  # no batch of the round
    assert record.add(verifier, VerificationReport(0, [not_own], draw)) is not None
    twice = Finding(own.batch_id, False, 1.0)
    assert "twice" in (record.add(verifier, VerificationReport(0, [twice, twice], draw)) or "")
    nan = Finding(own.batch_id, False, float("nan"))
    assert "finite" in (record.add(verifier, VerificationReport(0, [nan], draw)) or "")
    assert record.reports == {}  # nothing refused was kept
    assert record.add(verifier, report(duties, verifier, set())) is None
    # one report per sender and round: a flood of them costs one dict lookup each
    assert (
        record.add(verifier, report(duties, verifier, set(batches)))
        == "a second report for the round"
    )
    # the verifier disputed nothing: the tie-breaker is heard about nothing
    assert "no verifier disputed" in (
        record.add(tie_breaker, report(duties, tie_breaker, set())) or ""
    )
    assert record.add(tie_breaker, VerificationReport(0, [])) is None


def test_a_tie_breaker_is_heard_only_about_disputed_batches() -> None:
    duties, verifier, tie_breaker, _ = a_round()
    accused, honest = (d.batch_id for d in checked_by(duties, verifier))
    record = RoundVerification(duties)
    assert record.disputed() == []
    assert record.awaited() == [verifier]
    # before the accusation, nothing is disputed (the tie-breaker answers in the next round)
    early = report(duties, tie_breaker, set(), only={accused})
    assert "no verifier disputed" in (record.add(tie_breaker, early) or "")
    assert record.add(verifier, report(duties, verifier, {accused})) is None
    assert record.disputed() == [accused]
    assert record.awaited() == []
    # naming an undisputed batch beside the disputed one is refused whole
    both = report(duties, tie_breaker, set(), only={accused, honest})
    assert str(honest) in (record.add(tie_breaker, both) or "")
    assert record.add(tie_breaker, report(duties, tie_breaker, set(), only={accused})) is None


# ---- resolution --------------------------------------------------------------------------------


def test_a_trainer_that_lied_loses() -> None:
    duties, verifier, tie_breaker, _ = a_round()
    lie = checked_by(duties, verifier)[0]
    record = RoundVerification(duties)
    assert record.add(verifier, report(duties, verifier, {lie.batch_id})) is None
    assert record.resolve() == []  # one client's word decides nothing
    verdict = report(duties, tie_breaker, {lie.batch_id}, only={lie.batch_id})
    assert record.add(tie_breaker, verdict) is None
    (decided,) = record.resolve()
    assert (decided.loser, decided.role, decided.batch_id) == (lie.trainer, "trainer", lie.batch_id)
    assert record.resolve() == []  # decided once


def test_a_verifier_that_lied_loses() -> None:
    duties, verifier, tie_breaker, _ = a_round()
    honest = checked_by(duties, verifier)[0]
    record = RoundVerification(duties)
    assert record.add(verifier, report(duties, verifier, {honest.batch_id}, 3.0)) is None
    assert record.resolve() == []
    # the tie-breaker answers the dispute (in the next round, from the weights it saved)
    verdict = report(duties, tie_breaker, set(), only={honest.batch_id})
    assert record.add(tie_breaker, verdict) is None
    (decided,) = record.resolve()
    assert (decided.loser, decided.role) == (verifier, "verifier")
    assert str(honest.trainer) in decided.reason


def test_honest_reports_punish_nobody() -> None:
    duties, verifier, tie_breaker, _ = a_round()
    record = RoundVerification(duties)
    record.add(verifier, report(duties, verifier, set()))
    assert record.disputed() == []
    assert record.add(tie_breaker, report(duties, tie_breaker, set())) is not None
    assert record.resolve() == []


def test_tie_breakers_decide_by_majority() -> None:
    # three tie-breakers (a state could elect them): two against one convicts; a tie does not
    selection = CommitteeSelection(3, 0, 25, 8, 5)
    clients = [Client(i) for i in ids(8)]
    trainers = [
        c.id
        for i, c in enumerate(clients)
        if selection.get_committee(i).committee is Committee.Trainer
    ]
    assignments = {BatchId(k * 4, k * 4 + 3): t for k, t in enumerate(trainers)}
    duties = round_duties(3, clients, selection, assignments, run_id="r")
    ties = sorted({d.verifier for d in duties.tie_breakers}, key=lambda i: i.signer)
    assert len(ties) == 3
    target, accuser = duties.verifiers[0].batch_id, duties.verifiers[0].verifier
    accusation = VerificationReport(3, [Finding(target, False, 1.0)])
    for votes, convicted in [((False, False, True), True), ((False, True, True), False)]:
        record = RoundVerification(duties)
        assert record.add(accuser, accusation) is None
        for tie, vote in zip(ties, votes, strict=True):
            verdict = report(duties, tie, set() if vote else {target}, only={target})
            assert record.add(tie, verdict) is None
        losers = [r.loser for r in record.resolve()]
        assert (assignments[target] in losers) is convicted
        assert (accuser in losers) is not convicted
    # nothing is decided on honest votes without an accusation (none is heard)
    for votes in itertools.product([True], repeat=3):
        record = RoundVerification(duties)
        for tie, _ in zip(ties, votes, strict=True):
            record.add(tie, report(duties, tie, set()))
        assert record.resolve() == []


def test_verifiers_and_tie_breakers_are_healthy_in_a_verifying_run() -> None:
    # upstream's `todo!()` (a health check naming one crashed every witness of a verifying run)
    from psyche.coordinator.consensus import unhealthy_trainers

    coordinator = integration_test_coordinator(5, 8, 1)
    coordinator.config.verification_percent = 25
    coordinator.tick(ids(5), 100, 1)
    coordinator.tick(ids(5), 125, 3)
    assert coordinator.run_state is RunState.RoundTrain
    # round 0 as the attested round and, a copy of it at height 1, as the previous round
    rounds = coordinator.epoch_state.rounds
    rounds[1] = copy.deepcopy(rounds[0])
    rounds[1].height = 1
    coordinator.epoch_state.rounds_head = 2
    selection = CommitteeSelection.from_coordinator(coordinator, -1)
    checks = unhealthy_trainers(coordinator, selection)
    named = {selection.get_committee(p.index).committee for _, p in checks}
    assert Committee.Trainer in named  # nobody witnessed the trainers
    assert named == {Committee.Trainer}  # the verifier and the tie-breaker are healthy


def height(coordinator: Coordinator) -> int:
    round_ = coordinator.current_round()
    assert round_ is not None
    return round_.height


def test_health_checks_judge_the_trainers_of_the_round_the_witnesses_attest() -> None:
    """A round's witnesses attest the results of the round before it (`plan_apply` applies
    those), and a verifying run elects its committees afresh each round. Honest witnesses that
    attest exactly the trainers of the round before theirs must name nobody, though members
    change between trainer, verifier and tie-breaker (the Solana e2e's dropped honest trainer,
    a verifier or tie-breaker the round before); one such trainer whose result nobody saw is
    named."""
    from psyche.coordinator.testing import health_checks_for, round_witness_for

    n = 4
    coordinator = integration_test_coordinator(n, 8, 0)
    coordinator.config.verification_percent = 25
    coordinator.config.epoch_time = 60  # rounds of 2-3 "seconds": about twenty in the epoch
    now = 100
    coordinator.tick(ids(n), now, 1)
    now += 25
    coordinator.tick(ids(n), now, 2)
    trainers_before: set[NodeIdentity] = set()  # the trainers of the round before this one
    changed = named_lazy = 0
    for seed in range(3, 11):
        clients = coordinator.epoch_state.clients
        selection = CommitteeSelection.from_coordinator(coordinator, 0)
        committees = [selection.get_committee(i).committee for i in range(n)]
        trainers = {
            c.id for c, k in zip(clients, committees, strict=True) if k is Committee.Trainer
        }
        if height(coordinator) >= 2:
            changed += len(trainers - trainers_before) > 0
        # the witnesses of this round attest the previous round's trainers, one of them lazy
        # from the fourth round on (its result of the round before went unseen)
        lazy = min(trainers_before, key=lambda i: i.signer) if seed >= 6 else None
        for index in range(n):
            witness = round_witness_for(
                coordinator,
                index,
                participants=[t for t in trainers_before if t != lazy],
                bloom_keys=range(8),
            )
            assert witness is not None
            coordinator.witness(clients[index].id, witness, now)
        trainers_before = trainers
        now += 2
        coordinator.tick(None, now, seed)  # the witness phase ends, the next round starts
        if coordinator.run_state is not RunState.RoundTrain:
            now += 1
            coordinator.tick(None, now, seed)
        assert coordinator.run_state is RunState.RoundTrain
        if height(coordinator) < 2:
            continue
        named = {node for node, _ in health_checks_for(coordinator)}
        # the coordinator (the server's, the Solana program's) refuses to drop anyone else
        previous = CommitteeSelection.from_coordinator(coordinator, -1)
        for index, client in enumerate(clients):
            if client.id not in named:
                check = (client.id, previous.get_committee(index))
                with pytest.raises(CoordinatorError) as refused:
                    coordinator.health_check(clients[0].id, [check])
                assert refused.value.kind is CoordinatorErrorKind.InvalidHealthCheck
        if lazy is None:
            assert named == set()
        else:
            assert named == {lazy}
            named_lazy += 1
            judged = copy.deepcopy(coordinator)  # the lazy one is dropped (in a copy)
            assert judged.health_check(clients[0].id, health_checks_for(judged)) == 1
    assert changed  # the committees did change between rounds (else this proves nothing)
    assert named_lazy


# ---- the draw: unknowable to a trainer before it commits, checkable by all after ----------------


def old_rule_checked(selection: CommitteeSelection, batches: list[BatchId], verifiers: int) -> set:
    """The batches the committee seed alone drew before the fix (every client knew them at the
    round's start): the first two per verifier of the seed's shuffle."""
    order = list(batches)
    deterministic_shuffle(order, verification_seed(selection))
    return set(order[: VERIFIED_BATCHES_PER_VERIFIER * verifiers])


def accuse_drawn_lies(duties: RoundDuties, lied: set[BatchId]) -> int:
    """Every verifier of the round reports on its own draw, accusing the lies it drew (each
    report heard); how many lies were accused."""
    record = RoundVerification(duties)
    caught = 0
    for verifier in dict.fromkeys(d.verifier for d in duties.verifiers):
        accused = {d.batch_id for d in checked_by(duties, verifier)} & lied
        caught += len(accused)
        assert record.add(verifier, report(duties, verifier, accused)) is None
    assert set(record.disputed()) <= lied
    return caught


def test_a_trainer_that_lies_only_where_the_seed_does_not_draw_it_is_caught() -> None:
    # 21 clients at 10 %: 18 trainers, 2 verifiers, pools of 9. A "knowing liar" lies exactly
    # where the committee seed (public at the round's start) does not draw its batch: the old
    # rule checks none of its lies; the verifiers' own draws check some, and each such lie is
    # an accusation the round's record hears
    lies = caught = 0
    for seed in range(12):
        coordinator, selection, assignments = round_for(21, 10, seed, batch=36)
        duties = duties_of(coordinator, selection, assignments)
        verifiers = list(dict.fromkeys(d.verifier for d in duties.verifiers))
        lied = set(assignments) - old_rule_checked(selection, list(assignments), len(verifiers))
        lies += len(lied)
        caught += accuse_drawn_lies(duties, lied)
    assert lies > 100
    # each lie is drawn with chance 2 in 9; 12 rounds of 14 lies: far from none
    assert caught >= lies // 9


def test_a_forged_or_mismatched_draw_is_refused_alike_by_everyone() -> None:
    duties, _ = duties_for(21, 10, 3, batch=36)
    again, _ = duties_for(21, 10, 3, batch=36)  # another client's own derivation
    v, other = list(dict.fromkeys(d.verifier for d in duties.verifiers))
    pool = duties.pool(v)
    assert len(pool) > VERIFIED_BATCHES_PER_VERIFIER
    honest = report(duties, v, set())
    drawn = {f.batch_id for f in honest.findings}
    outside = next(d.batch_id for d in pool if d.batch_id not in drawn)

    def claim(draw: bytes, batches: list[BatchId]) -> VerificationReport:
        return VerificationReport(0, [Finding(b, False, 1.0) for b in batches], draw)

    message = duties.draw_message(v)
    another_step = draw_message(duties.run_id, duties.seed, 1, pool)
    forged = [
        claim(NO_DRAW, sorted(drawn)),  # no signature
        claim(key_of(other).sign(message), sorted(drawn)),  # another key's signature
        claim(key_of(v).sign(another_step), sorted(drawn)),  # another step's
        claim(key_of(v).sign(duties.draw_message(other)), sorted(drawn)),  # another pool's
        claim(honest.draw, [outside]),  # its own draw, a batch outside it
        claim(honest.draw, [*sorted(drawn)[:1], outside]),
    ]
    for bad in forged:
        verdicts = [RoundVerification(d).add(v, bad) for d in (duties, again)]
        assert verdicts[0] is not None
        assert verdicts[0] == verdicts[1]
    # a forged draw that names another batch of the pool is refused as a wrong draw
    swapped = claim(key_of(other).sign(message), [outside])
    assert "draw" in (RoundVerification(duties).add(v, swapped) or "")
    # the honest report is heard by every client alike, and its draw is its signature's
    for d in (duties, again):
        assert RoundVerification(d).add(v, honest) is None
    assert {x.batch_id for x in duties.drawn(v, honest.draw) or []} == drawn


def replayed_rounds(seed: int) -> list[tuple[RoundDuties, RoundDuties]]:
    """Pairs of rounds with the same members, step and pools: (this run's, another run's) and
    (this round's, the same round started again with another committee seed)."""
    here, _ = duties_for(21, 10, seed, batch=36, run_id="run-a")
    elsewhere, _ = duties_for(21, 10, seed, batch=36, run_id="run-b")
    reseeded = dataclasses.replace(here, seed=bytes(31) + bytes([seed + 1]))
    assert elsewhere.verifiers == here.verifiers == reseeded.verifiers  # the same pools
    assert here.seed not in (reseeded.seed, bytes(32))
    return [(here, elsewhere), (here, reseeded)]


def test_a_draw_replayed_from_another_run_or_round_is_refused() -> None:
    for seen, replayed_in in replayed_rounds(3):
        verifiers = list(dict.fromkeys(d.verifier for d in seen.verifiers))
        for v in verifiers:
            assert len(seen.pool(v)) > VERIFIED_BATCHES_PER_VERIFIER
            old = report(seen, v, set())  # its report there, draw and findings
            replay = dataclasses.replace(old, step=replayed_in.step)
            assert "draw" in (RoundVerification(replayed_in).add(v, replay) or "")
            # its own draw here is another signature, and is heard
            fresh = report(replayed_in, v, set())
            assert fresh.draw != old.draw
            assert RoundVerification(replayed_in).add(v, fresh) is None


def test_a_trainer_that_lies_outside_a_draw_seen_in_another_run_or_round_is_caught() -> None:
    # 21 clients at 10 %: 18 trainers, 2 verifiers, pools of 9. A hostile trainer that saw the
    # verifiers' draws revealed in another run of the same members (or in the round before it
    # was started again) lies exactly where those draws did not look. Were the draw message the
    # same there and here (step and pool only), here's draws would be the same and check none
    # of its lies; bound to the run and the seed, they are fresh: some lies are checked and
    # accused, beside the honest trainers' results.
    lies = caught = 0
    for seed in range(12):
        for seen, here in replayed_rounds(seed):
            verifiers = list(dict.fromkeys(d.verifier for d in seen.verifiers))
            revealed = {d.batch_id for v in verifiers for d in checked_by(seen, v)}
            lied = {d.batch_id for d in here.verifiers} - revealed
            lies += len(lied)
            caught += accuse_drawn_lies(here, lied)
    assert lies > 300
    # each drawn batch is a lie with chance 7 in 9: 4 drawn a round, 24 rounds
    assert caught >= 24


def test_a_reader_hears_only_the_reports_it_can_check_itself() -> None:
    # What a tie-breaker reads back (from the server or the Solana account) is heard under the
    # coordinator's own rule: a relayed report whose draw is missing or forged is left out, the
    # honest verifier's dispute and the tie-breaker's verdict (listed first) are heard.
    duties, _ = duties_for(21, 10, 3, batch=36, run_id="run-a")
    honest_v, hostile_v = list(dict.fromkeys(d.verifier for d in duties.verifiers))
    (tie_breaker,) = {d.verifier for d in duties.tie_breakers}
    accused = checked_by(duties, honest_v)[0].batch_id
    honest = report(duties, honest_v, {accused})
    stripped = report(duties, hostile_v, {d.batch_id for d in checked_by(duties, hostile_v)})
    stripped = dataclasses.replace(stripped, draw=NO_DRAW)
    verdict = report(duties, tie_breaker, {accused}, only={accused})
    relayed = {tie_breaker: verdict, hostile_v: stripped, honest_v: honest}
    record, refused = RoundVerification.heard(duties, relayed)
    assert record.disputed() == [accused]
    assert set(record.reports) == {honest_v, tie_breaker}
    assert [(sender, "draw" in why) for sender, why in refused] == [(hostile_v, True)]
    assert [(r.loser, r.role) for r in record.resolve()] == [
        (duties.trainers()[accused], "trainer")
    ]
    # taken on trust, the stripped report would have disputed batches no draw of it covers
    trusted = RoundVerification(duties, dict(relayed))
    assert set(trusted.disputed()) > {accused}
