"""Committee selection: upstream's unit tests (committee_selection.rs) with their values, the
spec's derived vectors, and the cached shuffle against psyche.core's reference."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.coordinator import (
    Committee,
    CommitteeProof,
    CommitteeSelection,
    Coordinator,
    CoordinatorError,
    CoordinatorErrorKind,
    CoordinatorPanic,
    WitnessProof,
)
from psyche.coordinator.shuffle_cache import MAX_PRECOMPUTED_COUNT, shuffled_index
from psyche.core import compute_shuffled_index, sha256, sha256v
from psyche.core.numeric import U64_MAX

# ---- upstream's tests --------------------------------------------------------------------------


def test_new_committee_selection() -> None:
    cs = CommitteeSelection(10, 20, 30, 100, 12345)
    assert cs.tie_breaker_nodes == 10
    assert cs.witness_nodes == 20
    assert cs.verifier_nodes == 27  # (100 - 10) * 30%
    assert cs.total_nodes == 100


def test_get_committee() -> None:
    cs = CommitteeSelection(10, 20, 30, 100, 12345)
    for i in range(100):
        proof = cs.get_committee(i)
        assert proof.position < 100
        match proof.committee:
            case Committee.TieBreaker:
                assert proof.position < 10
            case Committee.Verifier:
                assert 10 <= proof.position < 37
            case Committee.Trainer:
                assert proof.position >= 37


def test_get_witness() -> None:
    cs = CommitteeSelection(10, 20, 30, 100, 12345)
    for i in range(100):
        proof = cs.get_witness(i)
        assert proof.position < 100
        assert proof.witness == (proof.position < 20)


def test_verify_committee() -> None:
    cs = CommitteeSelection(10, 20, 30, 100, 12345)
    for i in range(100):
        assert cs.verify_committee(cs.get_committee(i))
        assert not cs.verify_committee(CommitteeProof(Committee.Verifier, 99, i))


def test_verify_witness() -> None:
    cs = CommitteeSelection(10, 20, 30, 100, 12345)
    for i in range(100):
        proof = cs.get_witness(i)
        assert cs.verify_witness(proof)
        assert not cs.verify_witness(WitnessProof(99, i, not proof.witness))


def test_committee_distribution() -> None:
    cs = CommitteeSelection(10, 20, 30, 100, 12345)
    counts = {c: 0 for c in Committee}
    for i in range(100):
        counts[cs.get_committee(i).committee] += 1
    assert counts == {Committee.TieBreaker: 10, Committee.Verifier: 27, Committee.Trainer: 63}


def test_witness_distribution() -> None:
    cs = CommitteeSelection(10, 20, 30, 100, 12345)
    assert sum(cs.get_witness(i).witness for i in range(100)) == 20


def test_get_num_nodes() -> None:
    cs = CommitteeSelection(10, 5, 20, 100, 12345)
    assert cs.get_num_tie_breaker_nodes() == 10
    assert cs.get_num_verifier_nodes() == 18
    assert cs.get_num_trainer_nodes() == 72


def test_seed_consistency() -> None:
    cs1 = CommitteeSelection(10, 5, 20, 100, 12345)
    cs2 = CommitteeSelection(10, 5, 20, 100, 12345)
    assert cs1.get_seed() == cs2.get_seed()


def _rejected(*args: int) -> None:
    with pytest.raises(CoordinatorError) as info:
        CommitteeSelection(*args)
    assert info.value.kind is CoordinatorErrorKind.InvalidCommitteeSelection
    assert str(info.value) == "Invalid committee selection"


def test_invalid_total_nodes() -> None:
    _rejected(10, 5, 20, 9, 12345)


def test_invalid_committee_selections() -> None:
    _rejected(10, 5, 101, 100, 12345)  # verification_percent > 100
    _rejected(10, 5, 101, 5, 12345)  # total_nodes < tie_breaker_nodes
    _rejected(10, 50, 101, 11, 12345)  # total_nodes < witness_nodes
    _rejected(10, 50, 101, U64_MAX, 12345)  # total_nodes >= u64::MAX


def test_edge_case_all_tie_breakers() -> None:
    cs = CommitteeSelection(100, 5, 20, 100, 12345)
    assert all(cs.get_committee(i).committee is Committee.TieBreaker for i in range(100))


def test_edge_case_no_verifiers() -> None:
    cs = CommitteeSelection(10, 5, 0, 100, 12345)
    committees = [cs.get_committee(i).committee for i in range(100)]
    assert committees.count(Committee.TieBreaker) == 10
    assert committees.count(Committee.Trainer) == 90
    assert Committee.Verifier not in committees


# ---- derived vectors (spec §2.12) ----------------------------------------------------------------


def test_seed_is_sha256_of_little_endian_u64() -> None:
    cs = CommitteeSelection(10, 20, 30, 100, 12345)
    assert cs.get_seed().hex() == (
        "e1543551249113046932741cc28f36b4bbcc542233eb5094874072d3167f160a"
    )
    assert cs.get_seed() == sha256((12345).to_bytes(8, "little"))


def test_known_positions() -> None:
    cs = CommitteeSelection(10, 20, 30, 100, 12345)
    committee = [cs.get_committee(i) for i in range(10)]
    assert [p.position for p in committee] == [83, 58, 32, 29, 76, 82, 21, 88, 14, 56]
    assert [p.committee for p in committee] == [
        Committee.Trainer, Committee.Trainer, Committee.Verifier, Committee.Verifier,
        Committee.Trainer, Committee.Trainer, Committee.Verifier, Committee.Trainer,
        Committee.Verifier, Committee.Trainer,
    ]  # fmt: skip
    witnesses = [cs.get_witness(i) for i in range(10)]
    assert [p.position for p in witnesses] == [58, 86, 21, 7, 69, 31, 63, 29, 11, 88]
    assert [i for i, p in enumerate(witnesses) if p.witness] == [3, 8]


def test_salted_seeds_feed_the_reference_shuffle() -> None:
    cs = CommitteeSelection(0, 0, 0, 37, 99)
    for salt, get in ((b"committee", cs.get_committee), (b"witness", cs.get_witness)):
        seed = sha256v((cs.get_seed(), salt))
        assert [get(i).position for i in range(37)] == [
            compute_shuffled_index(i, 37, seed) for i in range(37)
        ]


@pytest.mark.parametrize(("total", "witness"), [(2, 0), (3, 1), (4, 2), (5, 3)])
def test_single_witness_with_seed_zero(total: int, witness: int) -> None:
    cs = CommitteeSelection(0, 1, 0, total, 0)
    assert [i for i in range(total) if cs.get_witness(i).witness] == [witness]


def test_witness_nodes_zero_means_up_to_32() -> None:
    cs = CommitteeSelection(0, 0, 0, 100, 7)
    proofs = [cs.get_witness(i) for i in range(100)]
    assert sum(p.witness for p in proofs) == 32
    assert all(p.witness == (p.position < 32) for p in proofs)
    small = CommitteeSelection(0, 0, 0, 5, 7)
    assert all(small.get_witness(i).witness for i in range(5))


# ---- verification against clients -------------------------------------------------------------


def test_verify_for_client_checks_the_index_first() -> None:
    from psyche.coordinator import Client
    from psyche.core import NodeIdentity

    ids = [NodeIdentity.from_single_key(bytes([i]) * 32) for i in range(4)]
    clients = [Client(i) for i in ids]
    cs = CommitteeSelection(0, 1, 0, 4, 5)
    for i, node in enumerate(ids):
        proof = cs.get_witness(i)
        assert cs.verify_witness_for_client(node, proof, clients)
        assert not cs.verify_witness_for_client(ids[(i + 1) % 4], proof, clients)
        committee = cs.get_committee(i)
        assert cs.verify_committee_for_client(node, committee, clients)
    # an index past the clients is rejected before it reaches the shuffle's assertion
    assert not cs.verify_witness_for_client(ids[0], WitnessProof(0, 10, True), clients)
    assert not cs.verify_committee_for_client(ids[0], CommitteeProof(Committee.Trainer, 0, 4), [])


def test_index_past_the_nodes_is_upstreams_assertion() -> None:
    cs = CommitteeSelection(0, 1, 0, 4, 5)
    with pytest.raises(CoordinatorPanic, match="index < index_count"):
        cs.get_committee(4)
    with pytest.raises(CoordinatorPanic, match="index < index_count"):
        cs.verify_witness(WitnessProof(0, 7, False))


def test_from_coordinator_offsets() -> None:
    coordinator = Coordinator.zeroed()
    coordinator.epoch_state.rounds[0].clients_len = 3
    coordinator.epoch_state.rounds[0].random_seed = 42
    current = CommitteeSelection.from_coordinator(coordinator, 0)
    assert current.total_nodes == 3
    assert current.get_seed() == sha256((42).to_bytes(8, "little"))
    for offset in (-1, -2, 1, 5):
        with pytest.raises(CoordinatorError) as info:
            CommitteeSelection.from_coordinator(coordinator, offset)
        assert info.value.kind is CoordinatorErrorKind.NoActiveRound
    coordinator.epoch_state.rounds_head = 2
    coordinator.epoch_state.rounds[2].height = 2
    coordinator.epoch_state.rounds[1].clients_len = 9
    coordinator.epoch_state.rounds[0].clients_len = 8
    assert CommitteeSelection.from_coordinator(coordinator, -1).total_nodes == 9
    assert CommitteeSelection.from_coordinator(coordinator, -2).total_nodes == 8


# ---- the cached shuffle ------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 255, 256, 257, 600, MAX_PRECOMPUTED_COUNT])
def test_cached_shuffle_matches_reference_across_blocks(count: int) -> None:
    seed = hashlib.sha256(b"blocks" + count.to_bytes(4, "little")).digest()
    indices = sorted({0, 1, count // 2, count - 2, count - 1} & set(range(count)))
    for i in indices:
        assert shuffled_index(i, count, seed) == compute_shuffled_index(i, count, seed)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.binary(min_size=32, max_size=32), st.data())
def test_cached_shuffle_matches_reference(count: int, seed: bytes, data: st.DataObject) -> None:
    index = data.draw(st.integers(0, count - 1))
    assert shuffled_index(index, count, seed) == compute_shuffled_index(index, count, seed)


def test_large_counts_use_the_reference() -> None:
    seed = bytes(range(32))
    count = MAX_PRECOMPUTED_COUNT + 1
    assert shuffled_index(count - 1, count, seed) == compute_shuffled_index(count - 1, count, seed)


def test_whole_permutations_match_the_reference() -> None:
    from psyche.coordinator.shuffle_cache import ShuffleRounds
    from psyche.core import compute_shuffled_indices

    for count in [*range(1, 40), 100, 127, 128, 129, 200, 255, 256, 257, 700]:
        seed = hashlib.sha256(b"whole" + count.to_bytes(4, "little")).digest()
        assert ShuffleRounds(seed, count).positions() == compute_shuffled_indices(count, seed)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 256), st.binary(min_size=32, max_size=32))
def test_switching_to_the_whole_permutation_changes_nothing(count: int, seed: bytes) -> None:
    from psyche.coordinator.shuffle_cache import TABLE_AFTER_LOOKUPS, ShuffleRounds
    from psyche.core import compute_shuffled_indices

    rounds = ShuffleRounds(seed, count)
    expected = compute_shuffled_indices(count, seed)
    lookups = [i % count for i in range(TABLE_AFTER_LOOKUPS + 5)]
    assert [rounds.position(i) for i in lookups] == [expected[i] for i in lookups]
    assert rounds.positions() == expected
