"""Exact verification's pure rules (`psyche.coordinator.following`): who follows whom, what a
follower's report may say, and who loses (a trainer: on all three of its followers' words)."""

from __future__ import annotations

import random

import pytest

from psyche.coordinator import ClientState, RunState
from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.following import (
    FOLLOW_DRAW,
    FOLLOWERS_PER_TRAINER,
    RoundFollowing,
    check_follow_report,
    follow_duties,
    followers,
    followers_for_state,
    resolve_following,
)
from psyche.coordinator.run_config import semantic_problems
from psyche.coordinator.run_state import Client
from psyche.coordinator.server_core import ServerCore
from psyche.coordinator.testing import (
    integration_test_coordinator,
    quick_coordinator,
    warmup_witness_for,
)
from psyche.coordinator.verification import NO_DRAW, Finding, VerificationReport
from psyche.core import BatchId, NodeIdentity

from .verifying_nodes import ids


def test_followers_are_three_others_each_and_each_follows_three() -> None:
    for n in range(3, 12):
        members = ids(n)
        following = followers("run", 3, members)
        assert set(following) == set(members)
        count = min(FOLLOWERS_PER_TRAINER, n - 1)
        for trainer, mine in following.items():
            assert len(mine) == len(set(mine)) == count
            assert trainer not in mine
        follows = [f for mine in following.values() for f in mine]
        assert all(follows.count(m) == count for m in members)


def test_two_independent_derivations_agree_and_depend_on_run_and_epoch_only() -> None:
    members = ids(8)
    shuffled = list(members)
    random.Random(5).shuffle(shuffled)
    # two parties, members listed in another order (the clients now, then those that left)
    assert followers("run", 2, members) == followers("run", 2, shuffled)
    assert followers("run", 2, members) == followers("run", 2, members + members[:3])
    # another epoch or run deals another ring (for 8 members, almost surely)
    assert followers("run", 2, members) != followers("run", 3, members)
    assert followers("run", 2, members) != followers("other", 2, members)


def test_a_client_hearing_the_state_derives_the_servers_followers() -> None:
    """The server's state and a client's copy decoded from its postcard bytes (the setting put
    back from `RunExtras`, as the centralized client does), after a member left in the epoch:
    the same followers and the same duties (two independent derivations, one state)."""
    from psyche.coordinator import Coordinator
    from psyche.core.serde import from_bytes

    coordinator = integration_test_coordinator(4, 8, 0)
    coordinator.config.verification_percent = 25
    coordinator.config.exact_verification_threads = 1
    coordinator.epoch_state.clients = [Client(i) for i in ids(6)]
    coordinator.epoch_state.exited_clients.append(coordinator.epoch_state.clients.pop(2))
    heard = from_bytes(coordinator.to_bytes(), Coordinator)
    assert followers_for_state(heard) == {}  # the setting is not in upstream's bytes
    heard.config.exact_verification_threads = 1
    expected = followers_for_state(coordinator)
    assert len(expected) == 6
    assert followers_for_state(heard) == expected
    assignments = {BatchId(0, 3): ids(6)[0], BatchId(4, 7): ids(6)[1]}
    assert follow_duties(followers_for_state(heard), assignments) == follow_duties(
        expected, assignments
    )


def test_small_epochs() -> None:
    a, b = ids(2)
    assert followers("run", 0, [a, b]) == {a: (b,), b: (a,)}
    assert followers("run", 0, [a]) == {a: ()}


def test_the_epochs_followers_stay_while_members_leave() -> None:
    coordinator = integration_test_coordinator(4, 8, 0)
    coordinator.config.verification_percent = 25
    assert followers_for_state(coordinator) == {}  # off unless the run asks for it
    coordinator.config.exact_verification_threads = 1
    coordinator.epoch_state.clients = [Client(i) for i in ids(4)]
    before = followers_for_state(coordinator)
    assert len(before) == len(coordinator.epoch_state.clients) == 4
    leaving = coordinator.epoch_state.clients.pop(1)
    coordinator.epoch_state.exited_clients.append(leaving)
    assert followers_for_state(coordinator) == before
    coordinator.config.verification_percent = 0  # upstream's semantics at 0: nobody follows
    assert followers_for_state(coordinator) == {}


def test_the_config_is_checked() -> None:
    coordinator = integration_test_coordinator(4, 8, 0)
    coordinator.config.exact_verification_threads = 1
    problems = dict(semantic_problems(coordinator.config, coordinator.model))
    assert "needs verification_percent" in problems["config.exact_verification_threads"]
    coordinator.config.verification_percent = 25
    assert not semantic_problems(coordinator.config, coordinator.model)
    coordinator.config.init_min_clients = 3  # two followers a trainer: nobody convicted ever
    problems = dict(semantic_problems(coordinator.config, coordinator.model))
    assert "init_min_clients >= 4" in problems["config.exact_verification_threads"]
    coordinator.config.init_min_clients = 4
    coordinator.config.exact_verification_threads = 5000
    problems = dict(semantic_problems(coordinator.config, coordinator.model))
    assert "must be 0 to 1024" in problems["config.exact_verification_threads"]


def a_followed_round() -> tuple[
    list[NodeIdentity], dict[NodeIdentity, tuple[NodeIdentity, ...]], dict[BatchId, NodeIdentity]
]:
    members = ids(5)
    following = followers("run", 0, members)
    assignments = {BatchId(0, 3): members[0], BatchId(4, 7): members[1]}
    return members, following, assignments


def follow_report(step: int, findings: list[tuple[BatchId, bool]]) -> VerificationReport:
    return VerificationReport(
        step, [Finding(b, ok, 0.0 if ok else 17.0) for b, ok in findings], FOLLOW_DRAW
    )


def test_a_follower_reports_only_on_trainers_it_follows() -> None:
    members, following, assignments = a_followed_round()
    duties = follow_duties(following, assignments)
    assert len(duties) == 6  # two batches, three followers each
    trainer = members[0]
    follower = following[trainer][0]
    stranger = next(m for m in members if m != trainer and m not in following[trainer])
    batch = BatchId(0, 3)
    assert check_follow_report(5, duties, follower, follow_report(5, [(batch, True)])) is None
    assert "not a follower's report" in str(
        check_follow_report(5, duties, follower, VerificationReport(5, [], NO_DRAW))
    )
    assert "step" in str(check_follow_report(5, duties, follower, follow_report(4, [])))
    refused = check_follow_report(5, duties, stranger, follow_report(5, [(batch, False)]))
    assert refused is not None
    twice = follow_report(5, [(batch, True), (batch, True)])
    assert "twice" in str(check_follow_report(5, duties, follower, twice))
    nan = VerificationReport(5, [Finding(batch, False, float("nan"))], FOLLOW_DRAW)
    assert "non-finite" in str(check_follow_report(5, duties, follower, nan))


@pytest.mark.parametrize("last_wrong", [True, False])
def test_all_three_followers_words_convict_a_trainer_fewer_nobody(last_wrong: bool) -> None:
    members, following, assignments = a_followed_round()
    batch, trainer = BatchId(0, 3), members[0]
    one, two, three = following[trainer]
    record = RoundFollowing(5, follow_duties(following, assignments))
    assert record.add(one, follow_report(5, [(batch, False)])) is None
    assert record.resolve() == []  # one word decides nothing
    assert record.add(one, follow_report(5, [(batch, False)])) is not None  # once a round
    assert record.add(two, follow_report(5, [(batch, False)])) is None
    assert record.resolve() == []  # two words convict nobody either
    assert record.add(three, follow_report(5, [(batch, not last_wrong)])) is None
    decided = record.resolve()
    if last_wrong:  # all three found the commitment is not their rebuild: the trainer loses
        assert [(r.loser, r.role) for r in decided] == [(trainer, "trainer")]
        assert record.resolve() == []  # decided once
    else:  # one follower vouches for it: no conviction, and one voucher punishes nobody
        assert decided == []


def test_a_majority_of_vouchers_punishes_a_lone_accuser_but_convicts_no_trainer() -> None:
    members = ids(6)
    following = followers("run", 0, members)
    trainer = members[0]
    batch = BatchId(0, 3)
    duties = follow_duties(following, {batch: trainer})
    a, b, c = following[trainer]
    honest = [(a, follow_report(1, [(batch, True)])), (b, follow_report(1, [(batch, True)]))]
    liar = (c, follow_report(1, [(batch, False)]))
    assert [(r.loser, r.role) for r in resolve_following(1, duties, [*honest, liar])] == [
        (c, "follower")
    ]
    # a lying trainer with one colluding follower: not convicted by followers (the statistical
    # verifiers still check it), and the colluder not punished either
    colluder = (c, follow_report(1, [(batch, True)]))
    lied = [(a, follow_report(1, [(batch, False)])), (b, follow_report(1, [(batch, False)]))]
    assert resolve_following(1, duties, [*lied, colluder]) == []
    everyone = [*lied, (c, follow_report(1, [(batch, False)]))]
    assert [(r.loser, r.role) for r in resolve_following(1, duties, everyone)] == [
        (trainer, "trainer")
    ]


@pytest.mark.parametrize("n", [4, 5, 8])
def test_two_colluders_never_convict_an_honest_member(n: int) -> None:
    """Every epoch of `n` members, every pair of hostile members (so also a pair that ground
    its keys to sit where it likes in the ring): the hostile pair accuses every honest trainer
    it follows and vouches for every accusation... of nothing; honest followers say what is
    true, or are absent (dropped their shadow, late). No honest member ever loses. Under the
    rule first merged (two followers, two words convict), a pair that are neighbours in the
    ring convicted the honest member before them: 2/(n-1) of epochs."""
    members = ids(n)
    convictions = 0
    for epoch in range(6):
        following = followers("run", epoch, members)
        assignments = {BatchId(8 * i, 8 * i + 7): t for i, t in enumerate(members)}
        duties = follow_duties(following, assignments)
        for i in range(n):
            for j in range(i + 1, n):
                hostile = {members[i], members[j]}
                for honest_present in (True, False):
                    reports = []
                    for follower in members:
                        mine = [d for d in duties if d.verifier == follower]
                        if follower in hostile:
                            findings = [(d.batch_id, d.trainer in hostile) for d in mine]
                        elif honest_present:
                            findings = [(d.batch_id, True) for d in mine]
                        else:
                            continue
                        reports.append((follower, follow_report(1, findings)))
                    losers = {r.loser for r in resolve_following(1, duties, reports)}
                    convictions += len(losers - hostile)
    assert convictions == 0


def test_honest_followers_never_accuse_over_many_rounds() -> None:
    """Rounds of 4 to 9 members with random trainers: honest followers (every finding a match)
    give no decision against anybody, and every one of their reports is accepted."""
    rng = random.Random(11)
    decisions = accepted = 0
    for step in range(600):
        members = ids(rng.randint(4, 9))
        following = followers("run", step // 20, members)
        trainers = rng.sample(members, rng.randint(1, len(members) - 1))
        assignments = {BatchId(8 * i, 8 * i + 7): t for i, t in enumerate(trainers)}
        record = RoundFollowing(step, follow_duties(following, assignments))
        for follower in members:
            mine = [d.batch_id for d in record.duties if d.verifier == follower]
            if mine:
                report = follow_report(step, [(b, True) for b in mine])
                assert record.add(follower, report) is None
                accepted += 1
            decisions += len(record.resolve())
    assert accepted > 1000
    assert decisions == 0


# ---- on a ServerCore ---------------------------------------------------------------------------


def test_a_server_bans_the_trainer_its_followers_convict_and_relays_nothing() -> None:
    now = 1_000_000
    coordinator = quick_coordinator(init_min_clients=5, global_batch_size=8, epoch_time=60)
    coordinator.config.verification_percent = 25
    coordinator.config.exact_verification_threads = 1
    core = ServerCore.start(coordinator, now=now)
    for client in ids(5):
        core.on_join(client, core.run_id)
    core.on_tick(now + 2, 1)
    assert core.coordinator.run_state is RunState.Warmup
    for index, client in enumerate(core.coordinator.epoch_state.clients):
        core.on_witness(
            client.id, OpportunisticData.WarmupStep(warmup_witness_for(index)), now + 2, 7
        )
    core.on_tick(now + 3, 9)  # the round's duties (and its followers') recorded
    step = core.coordinator.progress.step
    record = core.following[step]
    # the same duties every client derives from the state
    assigned = dict(core.verification[step].duties.assigned)
    assert record.duties == follow_duties(followers_for_state(core.coordinator), assigned)
    duty = record.duties[0]
    trainer, batch = duty.trainer, duty.batch_id
    one, two, three = (d.verifier for d in record.duties if d.batch_id == batch)
    outsider = next(
        c.id for c in core.coordinator.epoch_state.clients if c.id not in (trainer, one, two, three)
    )
    wrong = follow_report(step, [(batch, False)])
    assert not core.on_verification(outsider, wrong)  # follows nobody on that batch: refused
    assert core.accepted_verification is None
    assert not core.on_verification(one, wrong)  # one word: heard, nothing decided
    assert not core.on_verification(two, wrong)  # two: nothing decided either
    assert core.accepted_verification is None  # a follower report is never relayed
    assert core.on_verification(three, wrong)  # all three: the trainer is dropped and banned
    assert core.accepted_verification is None
    states = {c.id: c.state for c in core.coordinator.epoch_state.clients}
    assert states[trainer] is ClientState.Dropped
    assert all(s is ClientState.Healthy for node, s in states.items() if node != trainer)
    assert trainer in core.banned
    assert [e.kind for e in core.verification_log] == ["followed"] * 3 + ["punished"]
