"""Data selection: upstream's unit tests (data_selection.rs) with their values, the spec's derived
vectors, and the helpers around the assignment."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.coordinator import (
    Client,
    CommitteeSelection,
    Coordinator,
    CoordinatorConfig,
    CoordinatorPanic,
    assign_data_for_state,
    get_batch_ids_for_node,
    get_batch_ids_for_round,
    get_data_index_for_step,
)
from psyche.core import BatchId, NodeIdentity

from .examples import CONSILIENCE


def node(i: int) -> NodeIdentity:
    key = bytearray(32)
    key[0] = i
    return NodeIdentity.from_single_key(bytes(key))


def create_test_coordinator(
    num_nodes: int, global_batch_size: int, total_steps: int
) -> Coordinator:
    """Upstream's helper: a zeroed coordinator with `num_nodes` clients whose key starts with i."""
    coordinator = Coordinator.zeroed()
    coordinator.config.total_steps = total_steps
    coordinator.config.global_batch_size_start = global_batch_size
    coordinator.config.global_batch_size_end = global_batch_size
    coordinator.epoch_state.clients = [Client(node(i)) for i in range(num_nodes)]
    coordinator.epoch_state.rounds[0].clients_len = num_nodes
    return coordinator


def assignments_of(coordinator: Coordinator) -> dict[BatchId, NodeIdentity]:
    return assign_data_for_state(coordinator, CommitteeSelection.from_coordinator(coordinator, 0))


def sizes(assignments: dict[BatchId, NodeIdentity]) -> list[int]:
    return sorted(b.end - b.start + 1 for b in assignments)


# ---- upstream's tests --------------------------------------------------------------------------


def test_even_distribution() -> None:
    assignments = assignments_of(create_test_coordinator(4, 100, 10))
    assert len(assignments) == 4
    assert sizes(assignments) == [25] * 4
    assert sum(sizes(assignments)) == 100


def test_uneven_distribution_with_remainder() -> None:
    assignments = assignments_of(create_test_coordinator(23, 384, 10))
    assert len(assignments) == 23
    assert sizes(assignments) == [16] * 7 + [17] * 16
    assert sum(sizes(assignments)) == 384


def test_larger_remainder() -> None:
    assignments = assignments_of(create_test_coordinator(5, 13, 10))
    assert len(assignments) == 5
    assert sizes(assignments) == [2, 2, 3, 3, 3]
    assert sum(sizes(assignments)) == 13


# ---- derived vectors (spec §2.13): who gets what ---------------------------------------------------


def owners(assignments: dict[BatchId, NodeIdentity]) -> list[tuple[int, int, int]]:
    return [(b.start, b.end, n.signer[0]) for b, n in assignments.items()]


def test_known_assignments() -> None:
    assert owners(assignments_of(create_test_coordinator(4, 100, 10))) == [
        (0, 24, 0), (25, 49, 2), (50, 74, 1), (75, 99, 3),
    ]  # fmt: skip
    assert owners(assignments_of(create_test_coordinator(5, 13, 10))) == [
        (0, 2, 3), (3, 5, 0), (6, 8, 1), (9, 10, 4), (11, 12, 2),
    ]  # fmt: skip
    first = owners(assignments_of(create_test_coordinator(23, 384, 10)))[0]
    assert first == (0, 16, 18)


def test_assignment_is_ascending_contiguous_and_starts_at_the_round() -> None:
    coordinator = create_test_coordinator(7, 50, 10)
    coordinator.epoch_state.rounds[0].data_index = 1000
    coordinator.epoch_state.rounds[0].random_seed = 987654321
    assignments = assignments_of(coordinator)
    batches = list(assignments)
    assert batches == sorted(batches)
    assert batches[0].start == 1000
    assert batches[-1].end == 1049
    assert all(a.end + 1 == b.start for a, b in itertools.pairwise(batches))
    assert sorted(n.signer[0] for n in assignments.values()) == list(range(7))


def test_fewer_indices_than_trainers() -> None:
    assignments = assignments_of(create_test_coordinator(5, 3, 10))
    assert sizes(assignments) == [1, 1, 1]
    assert len(set(assignments.values())) == 3


def test_no_clients_no_data() -> None:
    assert assignments_of(create_test_coordinator(0, 8, 10)) == {}


def test_batch_ids_for_node() -> None:
    assignments = assignments_of(create_test_coordinator(4, 100, 10))
    assert get_batch_ids_for_node(assignments, node(2)) == [BatchId(25, 49)]
    assert get_batch_ids_for_node(assignments, node(9)) == []
    doubled = {BatchId(0, 1): "a", BatchId(2, 3): "b", BatchId(4, 5): "a"}
    assert get_batch_ids_for_node(doubled, "a") == [BatchId(0, 1), BatchId(4, 5)]


def test_batch_ids_for_round_match_the_assignment() -> None:
    coordinator = create_test_coordinator(23, 384, 10)
    round_ = coordinator.current_round()
    assert round_ is not None
    ids = get_batch_ids_for_round(round_, coordinator, 23)
    assert ids == list(assignments_of(coordinator))
    assert get_batch_ids_for_round(round_, coordinator, 1000)[-1] == BatchId(383, 383)
    assert len(get_batch_ids_for_round(round_, coordinator, 1000)) == 384
    with pytest.raises(CoordinatorPanic, match="divide by zero"):
        get_batch_ids_for_round(round_, coordinator, 0)


def test_verifiers_train_nothing() -> None:
    # upstream asserts verification_percent == 0 here; the port's verifiers recompute instead
    coordinator = create_test_coordinator(10, 20, 10)
    coordinator.config.verification_percent = 50
    selection = CommitteeSelection.from_coordinator(coordinator, 0)
    trainers = {
        c.id
        for i, c in enumerate(coordinator.epoch_state.clients)
        if selection.get_committee(i).committee.name == "Trainer"
    }
    assert len(trainers) == 5
    assignments = assignments_of(coordinator)
    assert set(assignments.values()) == trainers
    assert sum(sizes(assignments)) == 20
    # a percentage under one client's share still elects one verifier (rounded up; upstream
    # rounds down, so everyone would train): nine trainers
    coordinator.config.verification_percent = 9
    assert len(set(assignments_of(coordinator).values())) == 9


def test_clients_beyond_the_round_trip_upstreams_assertion() -> None:
    coordinator = create_test_coordinator(4, 8, 10)
    coordinator.epoch_state.rounds[0].clients_len = 3
    with pytest.raises(CoordinatorPanic, match="index < index_count"):
        assignments_of(coordinator)


def test_batch_size_warmup_follows_the_round() -> None:
    coordinator = create_test_coordinator(2, 0, 10)
    coordinator.config.global_batch_size_start = 4
    coordinator.config.global_batch_size_end = 8
    coordinator.config.global_batch_size_warmup_tokens = 1000
    coordinator.model.value.max_seq_len = 10
    assert sum(sizes(assignments_of(coordinator))) == 4
    coordinator.epoch_state.rounds[0].data_index = 50  # 500 tokens: halfway
    assert sum(sizes(assignments_of(coordinator))) == 6
    coordinator.epoch_state.rounds[0].data_index = 100
    assert sum(sizes(assignments_of(coordinator))) == 8


# ---- get_data_index_for_step -------------------------------------------------------------------


def with_config(config: CoordinatorConfig, max_seq_len: int) -> Coordinator:
    coordinator = Coordinator.zeroed()
    coordinator.config = config
    coordinator.model.value.max_seq_len = max_seq_len
    return coordinator


def naive_data_index_for_step(coordinator: Coordinator, target_step: int) -> int:
    """Upstream's loop, step by step."""
    if target_step <= 1 or target_step > coordinator.config.total_steps:
        return 0
    current = 0
    for _ in range(1, target_step):
        tokens = (current * coordinator.get_sequence_length()) % 2**64
        current = (current + coordinator.config.get_batch_size(tokens)) % 2**64
    return current


def test_data_index_for_step_consilience() -> None:
    coordinator = with_config(CONSILIENCE, 2048)
    assert [get_data_index_for_step(coordinator, s) for s in (1, 2, 3, 10)] == [
        0, 12288, 24577, 110628,
    ]  # fmt: skip
    assert get_data_index_for_step(coordinator, 0) == 0
    assert get_data_index_for_step(coordinator, 325001) == 0
    for step in (30000, 325000):
        assert get_data_index_for_step(coordinator, step) == naive_data_index_for_step(
            coordinator, step
        )


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 64),
    st.integers(0, 64),
    st.integers(0, 40000),
    st.integers(0, 16),
    st.integers(0, 3000),
)
def test_data_index_for_step_matches_the_loop(
    start: int, extra: int, warmup_tokens: int, seq_len: int, step: int
) -> None:
    config = dataclasses.replace(
        CONSILIENCE,
        global_batch_size_start=start,
        global_batch_size_end=start + extra,
        global_batch_size_warmup_tokens=warmup_tokens,
        total_steps=2000,
    )
    coordinator = with_config(config, seq_len)
    assert get_data_index_for_step(coordinator, step) == naive_data_index_for_step(
        coordinator, step
    )
