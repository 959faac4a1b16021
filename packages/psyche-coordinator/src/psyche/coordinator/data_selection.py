"""Which data each trainer trains on in a round.

A round trains on the contiguous data indices `[round.data_index, round.data_index + batch)`.
The trainers (in client-index order) are shuffled with the round's seed (LCG Fisher-Yates), and
each gets a contiguous slice in that order: `batch // n` indices, plus one for the first
`batch % n` of them. Every client computes the same map, so nobody needs to be told its share.

With `verification_percent > 0` the trainers are the Trainer committee; with the run's
`verifiers_train` on as well, every client of the round (verifiers and the tie-breaker too, in
client-index order, the same list a run without verification trains): the same shuffle and slices
as upstream's every-client assignment, so a verifying run's batch is split as finely as one
without. Off (the default), nothing changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from psyche.coordinator.committee_selection import Committee, CommitteeSelection
from psyche.coordinator.coordinator import Coordinator
from psyche.coordinator.errors import CoordinatorPanic, CoordinatorUnimplemented
from psyche.coordinator.run_state import Client, Round
from psyche.coordinator.verification import RoundDuties, round_duties
from psyche.core.batch_id import BatchId
from psyche.core.deterministic_shuffle import deterministic_shuffle
from psyche.core.node_identity import NodeIdentity
from psyche.core.numeric import U64_MAX, wrapping_u64

V = TypeVar("V")


def _trainers(coordinator: Coordinator, selection: CommitteeSelection) -> list[Client]:
    clients = coordinator.epoch_state.clients
    if selection.everyone_trains() or _verifiers_train(coordinator):
        # Every position is a trainer's, so the committee shuffle cannot change the answer;
        # only its assertion for an index past the round's node count remains to check.
        if len(clients) > selection.total_nodes:
            raise CoordinatorPanic(
                f"assertion failed: index < index_count ({selection.total_nodes} >= "
                f"{selection.total_nodes})"
            )
        return list(clients)
    round_ = coordinator.current_round()
    assert round_ is not None  # checked by the caller
    # Upstream asserts `verification_percent == 0` for a verifier; here verifiers and
    # tie-breakers of a verifying run train nothing.
    verifying = coordinator.config.verification_percent != 0
    trainers = []
    for index, client in enumerate(clients):
        committee = selection.get_committee(index).committee
        if committee is Committee.Trainer:
            trainers.append(client)
        elif verifying:
            continue  # it recomputes others' results instead (psyche.coordinator.verification)
        elif committee is Committee.TieBreaker and round_.tie_breaker_tasks != 0:
            raise CoordinatorUnimplemented(
                "assertion `left == right` failed: round.tie_breaker_tasks == 0 "
                "(tie-breaker data assignment is not implemented upstream)"
            )
    return trainers


def _verifiers_train(coordinator: Coordinator) -> bool:
    config = coordinator.config
    return config.verification_percent != 0 and config.verifiers_train


def training_nodes(coordinator: Coordinator, selection: CommitteeSelection) -> int:
    """How many clients the round's batch is split among (`get_batch_ids_for_round`'s count):
    the Trainer committee's size, or every client of the round when verifiers train too."""
    if _verifiers_train(coordinator):
        return selection.total_nodes
    return selection.get_num_trainer_nodes()


def assign_data_for_state(
    coordinator: Coordinator, committee_selection: CommitteeSelection
) -> dict[BatchId, NodeIdentity]:
    """The current round's batches and who trains each, ascending by batch (upstream's
    `BTreeMap`).

    With `verification_percent > 0` the verifiers and tie-breakers get none (they recompute the
    trainers' results: `psyche.coordinator.verification`), unless `verifiers_train` is on: then
    every client gets a share, as without verification. Otherwise raises
    `CoordinatorUnimplemented` if a tie-breaker would need data (upstream asserts that none does)
    and `CoordinatorPanic` where upstream panics.
    """
    round_ = coordinator.current_round()
    if round_ is None:
        raise CoordinatorPanic("called `Option::unwrap()` on a `None` value (current round)")
    trainers = _trainers(coordinator, committee_selection)
    if not trainers:
        return {}
    deterministic_shuffle(trainers, round_.random_seed)

    total_size = coordinator.get_target_global_batch_size(round_)
    base_size, remainder = divmod(total_size, len(trainers))
    assignments: dict[BatchId, NodeIdentity] = {}
    current_index = round_.data_index
    # Slices are built in increasing order, so the dict's order is the BTreeMap's.
    for i, node in enumerate(trainers):
        size = base_size + 1 if i < remainder else base_size
        if size == 0:
            break  # so is every later size
        end_index = wrapping_u64(current_index + size - 1)
        assignments[BatchId(current_index, end_index)] = node.id
        current_index = wrapping_u64(end_index + 1)
    return assignments


def get_batch_ids_for_round(
    round_: Round, coordinator: Coordinator, num_trainer_nodes: int
) -> list[BatchId]:
    """The batches of `round_` split among `num_trainer_nodes` trainers (without their owners)."""
    if num_trainer_nodes == 0:
        raise CoordinatorPanic("attempt to divide by zero (num_trainer_nodes)")
    start = round_.data_index
    total_size = coordinator.get_target_global_batch_size(round_)
    end = wrapping_u64(start + total_size)
    base_size, remainder = divmod(total_size, num_trainer_nodes)
    batch_ids = []
    current = start
    for i in range(num_trainer_nodes):
        size = base_size + 1 if i < remainder else base_size
        if size == 0:
            break  # so is every later size
        batch_end = wrapping_u64(current + size - 1)
        batch_ids.append(BatchId(current, batch_end))
        current = wrapping_u64(batch_end + 1)
        if current >= end:
            break
    return batch_ids


def get_batch_ids_for_node(tree: Mapping[BatchId, V], node_identity: V) -> list[BatchId]:
    """The batches assigned to `node_identity`, in the map's (ascending) order."""
    return [batch for batch, node in tree.items() if node == node_identity]


def get_data_index_for_step(coordinator: Coordinator, target_step: int) -> int:
    """The first data index of `target_step`, assuming every step trained a full batch from 0.

    Loops over the steps as upstream does, but once the batch size stops changing (warmup over,
    or no tokens counted) the remaining steps are added in one multiplication: same result.
    """
    if target_step <= 1 or target_step > coordinator.config.total_steps:
        return 0
    config = coordinator.config
    max_seq_len = coordinator.get_sequence_length()
    current = 0
    remaining = target_step - 1
    while remaining > 0:
        tokens = wrapping_u64(current * max_seq_len)
        batch_size = config.get_batch_size(tokens)
        constant = max_seq_len == 0 or batch_size == 0
        if not constant and tokens >= config.global_batch_size_warmup_tokens:
            # Past warmup the size stays the end size as long as the token count does not
            # wrap (upstream's u64 arithmetic) back below the warmup threshold.
            last = current + (remaining - 1) * batch_size
            constant = last * max_seq_len <= U64_MAX
        if constant:
            # get_batch_size's input (or the size itself) no longer changes
            return wrapping_u64(current + remaining * batch_size)
        current = wrapping_u64(current + batch_size)
        remaining -= 1
    return current


def verification_duties_for_state(coordinator: Coordinator) -> RoundDuties:
    """Who recomputes what in the current round (`psyche.coordinator.verification`): none when
    verification is off or the round trains nothing (the epoch's last two rounds)."""
    round_ = coordinator.current_round()
    if round_ is None:
        raise CoordinatorPanic("called `Option::unwrap()` on a `None` value (current round)")
    step = coordinator.progress.step
    if coordinator.config.verification_percent == 0 or coordinator.epoch_state.last_step_set():
        return RoundDuties(step, (), ())
    selection = CommitteeSelection.from_coordinator(coordinator, 0)
    assignments = assign_data_for_state(coordinator, selection)
    clients = coordinator.epoch_state.clients[: round_.clients_len]
    return round_duties(step, clients, selection, assignments, run_id=coordinator.run_id)
