"""Issue 27's cost goal, the rule (`CoordinatorConfig.verifiers_train`): with it on, a verifying
run's verifiers and tie-breaker train a share of the round's batch too, split exactly as a run
without verification splits it; no verifier pools its own batch and the tie-breaker's is in no
pool. Off (the default) nothing changes (the upstream-agreement tests of test_data_selection.py
and the verifying rules of test_verification.py run unchanged)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from psyche.coordinator import Committee, CommitteeSelection, Coordinator, RunState, TickResult
from psyche.coordinator.consensus import unhealthy_trainers
from psyche.coordinator.data_selection import (
    assign_data_for_state,
    get_batch_ids_for_round,
    training_nodes,
    verification_duties_for_state,
)
from psyche.coordinator.run_config import dumps_toml, load_state_toml, state_to_toml_obj
from psyche.coordinator.testing import integration_test_coordinator
from psyche.coordinator.verification import RoundVerification, verification_problem
from psyche.core import BatchId, NodeIdentity
from psyche.core.serde import from_bytes, to_bytes

from .verifying_nodes import checked_by, ids, report


def started(
    n: int, percent: int, seed: int, *, train: bool, batch: int = 32, run_id: str = "test-run"
) -> Coordinator:
    """A round of `n` clients with `percent` % verifiers, started by the coordinator itself."""
    coordinator = integration_test_coordinator(n, batch, 0, run_id)
    coordinator.config.min_clients = coordinator.config.init_min_clients = n
    coordinator.config.verification_percent = percent
    coordinator.config.verifiers_train = train
    assert coordinator.tick(ids(n), 100, 1) == TickResult.Ticked()
    assert coordinator.tick(ids(n), 125, seed) == TickResult.Ticked()
    assert coordinator.run_state is RunState.RoundTrain
    return coordinator


def assignment(coordinator: Coordinator) -> dict[BatchId, NodeIdentity]:
    return assign_data_for_state(coordinator, CommitteeSelection.from_coordinator(coordinator, 0))


def committees(coordinator: Coordinator) -> dict[NodeIdentity, Committee]:
    selection = CommitteeSelection.from_coordinator(coordinator, 0)
    return {
        c.id: selection.get_committee(i).committee
        for i, c in enumerate(coordinator.epoch_state.clients)
    }


@settings(max_examples=40, deadline=None)
@given(n=st.integers(3, 40), percent=st.integers(1, 60), seed=st.integers(0, 2**64 - 1))
def test_with_verifiers_training_the_batch_is_split_as_without_verification(
    n: int, percent: int, seed: int
) -> None:
    batch = max(n, 8) + seed % 7
    verifying = started(n, percent, seed, train=True, batch=batch)
    assume(verification_problem(verifying.config) is None)  # a run validate-config accepts
    upstream = started(n, 0, seed, train=False, batch=batch)
    assigned = assignment(verifying)
    assert assigned == assignment(upstream)  # every client trains, same shuffle, same slices
    assert set(assigned.values()) == {c.id for c in verifying.epoch_state.clients}
    # the batches a client applies are the same split (`get_batch_ids_for_round`)
    selection = CommitteeSelection.from_coordinator(verifying, 0)
    round_ = verifying.current_round()
    assert round_ is not None
    count = training_nodes(verifying, selection)
    assert get_batch_ids_for_round(round_, verifying, count) == list(assigned)
    # off, only the Trainer committee trains (the rule before the option)
    off = started(n, percent, seed, train=False, batch=batch)
    roles = committees(off)
    assert {roles[t] for t in assignment(off).values()} == {Committee.Trainer}
    assert training_nodes(off, selection) == selection.get_num_trainer_nodes()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(3, 40), percent=st.integers(1, 60), seed=st.integers(0, 2**64 - 1))
def test_with_verifiers_training_nobody_checks_its_own_batch(
    n: int, percent: int, seed: int
) -> None:
    coordinator = started(n, percent, seed, train=True, batch=max(n, 8))
    assume(verification_problem(coordinator.config) is None)  # a run validate-config accepts
    assigned = assignment(coordinator)
    roles = committees(coordinator)
    duties = verification_duties_for_state(coordinator)
    verifiers = [v for v, k in roles.items() if k is Committee.Verifier]
    (tie_breaker,) = [v for v, k in roles.items() if k is Committee.TieBreaker]
    pooled = sorted(d.batch_id for d in duties.verifiers)
    assert len(pooled) == len(set(pooled))
    for d in duties.verifiers:
        assert assigned[d.batch_id] == d.trainer != d.verifier
        assert roles[d.verifier] is Committee.Verifier
    # every batch is pooled once but the tie-breaker's (it arbitrates) and, with one verifier,
    # that verifier's own
    unpooled = {b for b in assigned if b not in pooled}
    owners = {assigned[b] for b in unpooled}
    assert tie_breaker in owners
    assert owners <= {tie_breaker, *(verifiers if len(verifiers) == 1 else [])}
    # the tie-breaker may be asked about exactly the pooled batches
    assert sorted(d.batch_id for d in duties.tie_breakers) == pooled
    assert all(d.verifier == tie_breaker for d in duties.tie_breakers)


def test_every_client_derives_the_same_duties_from_the_state_it_holds(tmp_path: Path) -> None:
    # the server, the Solana program's rule and each client: the same function of the state.
    # A client reads the state from postcard (which has no room for the option: the server
    # sends it beside, `RunExtras.verifiers_train`) or from a saved TOML state
    for seed in range(6):
        coordinator = started(21, 10, seed, train=True, batch=168)
        expected = (assignment(coordinator), verification_duties_for_state(coordinator))
        heard = from_bytes(coordinator.to_bytes(), Coordinator)
        assert heard.config.verifiers_train is False  # not in upstream's bytes
        heard.config.verifiers_train = True  # what the centralized client sets from RunExtras
        assert (assignment(heard), verification_duties_for_state(heard)) == expected
        saved = saved_and_loaded(coordinator, tmp_path)
        assert saved.config.verifiers_train is True
        assert (assignment(saved), verification_duties_for_state(saved)) == expected


def saved_and_loaded(coordinator: Coordinator, directory: Path) -> Coordinator:
    """`coordinator` through a saved TOML state (the server's `save_state`, a resume)."""
    path = directory / "state.toml"
    path.write_text(dumps_toml(state_to_toml_obj(coordinator)))
    return load_state_toml(path)


def test_a_hostile_trainer_is_still_caught_and_a_verifier_that_trains_and_lies_too() -> None:
    # 4 clients at 25 % (the goal): 1 tie-breaker, 1 verifier, 2 trainers, all four
    # training; the verifier's pool is the two trainers' batches, checked whole every round, so
    # a trainer lying every round is accused in each and the tie-breaker's verdict convicts it
    convicted = 0
    for seed in range(8):
        coordinator = started(4, 25, seed, train=True, batch=8)
        roles = committees(coordinator)
        duties = verification_duties_for_state(coordinator)
        (verifier,) = [v for v, k in roles.items() if k is Committee.Verifier]
        (tie_breaker,) = [v for v, k in roles.items() if k is Committee.TieBreaker]
        hostile = min((v for v, k in roles.items() if k is Committee.Trainer), key=str)
        lies = {b for b, t in assignment(coordinator).items() if t == hostile}
        assert {d.batch_id for d in checked_by(duties, verifier)} >= lies  # checked whole
        record = RoundVerification(duties)
        assert record.add(verifier, report(duties, verifier, lies)) is None
        assert set(record.disputed()) == lies
        verdict = report(duties, tie_breaker, lies, only=lies)
        assert record.add(tie_breaker, verdict) is None
        assert {(r.loser, r.role) for r in record.resolve()} == {(hostile, "trainer")}
        convicted += 1
    assert convicted == 8
    # 21 clients at 10 %: 2 verifiers check each other's batches, so a verifier that lies in
    # its own training is drawn by the other like any trainer
    drawn_verifier_batches = 0
    for seed in range(24):
        coordinator = started(21, 10, seed, train=True, batch=168)
        roles = committees(coordinator)
        duties = verification_duties_for_state(coordinator)
        for v in (v for v, k in roles.items() if k is Committee.Verifier):
            drawn_verifier_batches += sum(
                roles[d.trainer] is Committee.Verifier for d in checked_by(duties, v)
            )
    assert drawn_verifier_batches > 0


def test_with_verifiers_training_every_member_of_the_attested_round_owes_a_result() -> None:
    # the health rule judges the trainers of the attested round: where everyone trained, a
    # verifier or tie-breaker that published nothing is named too
    import copy

    everyone = {Committee.Trainer, Committee.Verifier, Committee.TieBreaker}
    for train, expected in ((False, {Committee.Trainer}), (True, everyone)):
        coordinator = integration_test_coordinator(5, 8, 1)
        coordinator.config.verification_percent = 25
        coordinator.config.verifiers_train = train
        coordinator.tick(ids(5), 100, 1)
        coordinator.tick(ids(5), 125, 3)
        rounds = coordinator.epoch_state.rounds
        rounds[1] = copy.deepcopy(rounds[0])
        rounds[1].height = 1
        coordinator.epoch_state.rounds_head = 2
        selection = CommitteeSelection.from_coordinator(coordinator, -1)
        named = {
            selection.get_committee(p.index).committee
            for _, p in unhealthy_trainers(coordinator, selection)
        }
        assert named == expected


def test_the_option_without_verification_is_refused_with_its_field_named() -> None:
    from psyche.coordinator.run_config import semantic_problems

    coordinator = integration_test_coordinator(4, 8, 0)
    coordinator.config.verifiers_train = True
    problems = semantic_problems(coordinator.config, coordinator.model)
    assert [field for field, _ in problems] == ["config.verifiers_train"]
    coordinator.config.verification_percent = 25
    assert semantic_problems(coordinator.config, coordinator.model) == []


def test_upstreams_bytes_and_the_solana_account_keep_every_byte_and_a_solana_config_carries_it(
    tmp_path: Path,
) -> None:
    import tomllib

    import tomli_w

    from psyche.coordinator.config import CoordinatorConfig
    from psyche.solana.admin import load_config_file
    from psyche.solana.borsh import to_borsh
    from psyche.solana.state import REPR_C

    coordinator = started(4, 25, 3, train=True)
    on = coordinator.config
    off = dataclasses.replace(on, verifiers_train=False)
    for encode in (
        lambda c: to_bytes(c, CoordinatorConfig),
        lambda c: to_borsh(c, CoordinatorConfig),
        lambda c: REPR_C.encode(c, CoordinatorConfig),
    ):
        assert encode(on) == encode(off)
    # the coordinator account's copy reads it as off: a Solana run keeps it in its verification
    # account (tests/solana/test_verifiers_train.py), so its config file may set it
    repo = Path(__file__).resolve().parents[2]
    doc = tomllib.loads((repo / "configs/tiny-cpu/state.toml").read_text())
    doc["config"]["verification_percent"] = 25
    doc["config"]["min_clients"] = doc["config"]["init_min_clients"] = 4
    doc["config"]["verifiers_train"] = True
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps({"config": doc["config"], "model": doc["model"]}))
    assert load_config_file(path)[0].verifiers_train is True
    del doc["config"]["verifiers_train"]
    path.write_text(tomli_w.dumps({"config": doc["config"], "model": doc["model"]}))
    config, _model = load_config_file(path)
    assert config.verifiers_train is False
