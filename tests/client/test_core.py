"""The client's plain decisions, step by step: message validation and payload bookkeeping
(`payloads`), blooms, apply order and consensus (`apply`), round plans (`train`), health checks
and witness decisions (`witness`, `warmup`) (upstream `state/steps.rs`, `train.rs`,
`witness.rs`), checked against a coordinator driven by `psyche.coordinator.testing`."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from psyche.client.round import apply, payloads, warmup, witness
from psyche.client.round.broadcast import Broadcast, BroadcastType, Finished, TrainingResult
from psyche.client.round.state import (
    DeserializedPayload,
    Downloading,
    PayloadHandle,
    ResultEntry,
    RoundState,
)
from psyche.coordinator import Committee, CommitteeProof, Coordinator, RunState, Witness
from psyche.coordinator.commitment import Commitment
from psyche.coordinator.testing import (
    Simulation,
    bloom_of,
    integration_test_coordinator,
    simulated_identity,
)
from psyche.core.batch_id import BatchId
from psyche.core.identity import SecretKey
from psyche.core.merkle_tree import MerkleRoot, MerkleTree
from psyche.core.node_identity import NodeIdentity
from psyche.core.sha256 import sha256

from .round_sim import KEYS, index_of, next_round, plan_for, ticket, training_sim


def result_broadcast(step: int, proof: CommitteeProof, batch: BatchId, tag: int) -> Broadcast:
    data_hash = sha256(b"commitment" + bytes([tag]))
    return Broadcast(
        step=step,
        proof=proof,
        commitment=Commitment(data_hash, bytes(64)),
        nonce=0,
        data=BroadcastType.TrainingResult(TrainingResult(batch, ticket(tag))),
    )


def finished_broadcast(step: int, proof: CommitteeProof, warmup: bool) -> Broadcast:
    return Broadcast(
        step, proof, Commitment(bytes(32), bytes(64)), 0,
        BroadcastType.Finished(Finished(MerkleRoot(), warmup)),
    )  # fmt: skip


@pytest.fixture
def sim() -> Simulation:
    return training_sim()


# --------------------------------------------------------------------------------------------
# starting a round


def test_round_plan_matches_the_coordinators_assignment(sim: Simulation) -> None:
    coordinator = sim.coordinator
    plans = {str(c.id): plan_for(coordinator, c.id) for c in coordinator.epoch_state.clients}
    first = next(iter(plans.values())).state
    # every client computes the same assignment; together they cover the round's batch once
    assert all(p.state.data_assignments == first.data_assignments for p in plans.values())
    assigned = sorted(b for p in plans.values() for b in p.assigned_batches)
    assert assigned == sorted(first.data_assignments)
    indices = sorted(i for b in assigned for i in range(b.start, b.end + 1))
    round_ = coordinator.current_round()
    assert indices == list(range(round_.data_index, round_.data_index + 6))
    assert first.batch_ids_not_yet_trained_on == set(first.data_assignments)
    assert first.step == coordinator.progress.step
    assert first.height == 0
    assert all(p.have_training and not p.zero_optim for p in plans.values())
    witnesses = [p for p in plans.values() if p.state.committee_info.witness_proof.witness]
    assert len(witnesses) == 1  # witness_nodes = 1


def test_no_training_in_the_epochs_last_two_rounds(sim: Simulation) -> None:
    sim.coordinator.epoch_state.last_step = sim.coordinator.progress.step + 1
    plan = plan_for(sim.coordinator, simulated_identity(0))
    assert not plan.have_training
    assert plan.assigned_batches == []
    assert plan.state.batch_ids_not_yet_trained_on is None
    assert plan.state.data_assignments == {}


# --------------------------------------------------------------------------------------------
# gossip


class Round:
    """One client's view of the current round, with its previous round default."""

    def __init__(self, sim: Simulation, me: int = 0) -> None:
        self.coordinator = sim.coordinator
        self.me = simulated_identity(me)
        self.current = plan_for(self.coordinator, self.me).state
        self.previous = RoundState()

    def proof(self, identity: NodeIdentity) -> CommitteeProof:
        return self.current.committee_info.selection.get_committee(
            index_of(self.coordinator, identity)
        )

    def batch_of(self, identity: NodeIdentity) -> BatchId:
        return next(b for b, n in self.current.data_assignments.items() if n == identity)

    def apply(self, sender: NodeIdentity, broadcast: Broadcast):
        return payloads.apply_message(
            self.current,
            self.previous,
            identity=self.me,
            clients=self.coordinator.epoch_state.clients,
            from_id=sender,
            broadcast=broadcast,
        )


def test_a_trainers_result_is_recorded_and_downloaded_once(sim: Simulation) -> None:
    view = Round(sim)
    peer = simulated_identity(1)
    step = view.current.step
    broadcast = result_broadcast(step, view.proof(peer), view.batch_of(peer), 1)
    outcome, download = view.apply(peer, broadcast)
    assert outcome is payloads.ApplyMessageOutcome.Applied
    assert download is not None
    assert download.ticket == broadcast.data.value.ticket
    assert download.tag.endswith(f"_{step}")
    entry = view.current.results[view.batch_of(peer)]
    assert entry == [ResultEntry(peer, broadcast.commitment, broadcast.data.value)]
    assert isinstance(view.current.downloads[ticket(1).hash], Downloading)
    assert view.current.broadcasts == [broadcast.commitment.data_hash]
    # the same blob again (a rebroadcast): ignored, nothing new to fetch
    again = replace(broadcast, nonce=1)
    assert view.apply(peer, again) == (payloads.ApplyMessageOutcome.Ignored, None)
    assert view.current.broadcasts == [broadcast.commitment.data_hash]


def test_own_result_is_recorded_without_download(sim: Simulation) -> None:
    view = Round(sim)
    broadcast = result_broadcast(view.current.step, view.proof(view.me), view.batch_of(view.me), 9)
    outcome, download = view.apply(view.me, broadcast)
    assert outcome is payloads.ApplyMessageOutcome.Applied
    assert download is None


def test_result_for_a_batch_the_sender_was_not_assigned_is_invalid(sim: Simulation) -> None:
    view = Round(sim)
    peer, other = simulated_identity(1), simulated_identity(2)
    broadcast = result_broadcast(view.current.step, view.proof(peer), view.batch_of(other), 2)
    assert view.apply(peer, broadcast) == (payloads.ApplyMessageOutcome.Invalid, None)
    unknown = result_broadcast(view.current.step, view.proof(peer), BatchId(900, 901), 3)
    assert view.apply(peer, unknown) == (payloads.ApplyMessageOutcome.Invalid, None)
    assert view.current.results == {}
    assert view.current.downloads == {}


def test_replayed_step_is_invalid(sim: Simulation) -> None:
    view = Round(sim)
    peer = simulated_identity(1)
    old = result_broadcast(view.current.step - 5, view.proof(peer), view.batch_of(peer), 4)
    assert view.apply(peer, old) == (payloads.ApplyMessageOutcome.Invalid, None)


def test_forged_committee_proof_is_invalid(sim: Simulation) -> None:
    view = Round(sim)
    peer = simulated_identity(1)
    true_proof = view.proof(peer)
    batch = view.batch_of(peer)
    for forged in (
        replace(true_proof, position=true_proof.position + 1),
        replace(true_proof, index=(true_proof.index + 1) % 3),
        replace(true_proof, committee=Committee.Verifier),
    ):
        broadcast = result_broadcast(view.current.step, forged, batch, 5)
        assert view.apply(peer, broadcast) == (payloads.ApplyMessageOutcome.Invalid, None)


def test_forged_commitment_signature_is_detected() -> None:
    key, other = SecretKey.generate(), SecretKey.generate()
    data_hash = sha256(b"payload")
    broadcast = replace(
        result_broadcast(1, CommitteeProof(), BatchId(0, 0), 6),
        commitment=Commitment(data_hash, other.sign(data_hash)),
    )
    assert not payloads.verify_broadcast_signature(key.public_key, broadcast)
    signed = replace(broadcast, commitment=Commitment(data_hash, key.sign(data_hash)))
    assert payloads.verify_broadcast_signature(key.public_key, signed)
    # a tampered hash no longer matches its signature
    tampered = replace(signed, commitment=Commitment(sha256(b"other"), signed.commitment.signature))
    assert not payloads.verify_broadcast_signature(key.public_key, tampered)


def test_sender_must_be_a_client(sim: Simulation) -> None:
    clients = sim.coordinator.epoch_state.clients
    assert payloads.client_for_p2p_key(clients, clients[1].id.p2p_identity) == clients[1].id
    assert payloads.client_for_p2p_key(clients, bytes(32)) is None
    view = Round(sim)
    stranger = NodeIdentity.from_single_key(sha256(b"stranger"))
    warmup = finished_broadcast(0, CommitteeProof(), warmup=True)
    view.current = RoundState()  # warmup: default round state
    assert view.apply(stranger, warmup) == (payloads.ApplyMessageOutcome.Invalid, None)


def test_without_round_info_non_warmup_messages_are_ignored(sim: Simulation) -> None:
    view = Round(sim)
    view.current = RoundState(step=view.coordinator.progress.step)
    peer = simulated_identity(1)
    broadcast = result_broadcast(
        view.current.step, CommitteeProof(Committee.Trainer), BatchId(0, 0), 7
    )
    assert view.apply(peer, broadcast) == (payloads.ApplyMessageOutcome.Ignored, None)


def test_finished_is_counted_once_per_client(sim: Simulation) -> None:
    view = Round(sim)
    peer = simulated_identity(2)
    message = finished_broadcast(view.current.step, view.proof(peer), warmup=False)
    assert view.apply(peer, message)[0] is payloads.ApplyMessageOutcome.Applied
    assert view.apply(peer, message)[0] is payloads.ApplyMessageOutcome.Ignored
    assert list(view.current.clients_finished) == [peer]


def test_messages_of_the_previous_round_go_there(sim: Simulation) -> None:
    view = Round(sim)
    view.previous, view.current = view.current, RoundState(step=view.current.step + 1)
    peer = simulated_identity(1)
    proof = view.previous.committee_info.selection.get_committee(index_of(view.coordinator, peer))
    batch = next(b for b, n in view.previous.data_assignments.items() if n == peer)
    broadcast = result_broadcast(view.previous.step, proof, batch, 8)
    assert view.apply(peer, broadcast)[0] is payloads.ApplyMessageOutcome.Applied
    assert batch in view.previous.results
    assert view.current.results == {}


# --------------------------------------------------------------------------------------------
# payloads and blooms


def _announced(sim: Simulation) -> tuple[Round, NodeIdentity, Broadcast]:
    view = Round(sim)
    peer = simulated_identity(1)
    broadcast = result_broadcast(view.current.step, view.proof(peer), view.batch_of(peer), 1)
    view.apply(peer, broadcast)
    return view, peer, broadcast


def test_payload_must_match_its_commitment(sim: Simulation) -> None:
    view, peer, broadcast = _announced(sim)
    blob = broadcast.data.value.ticket.hash
    pending = payloads.commitment_for_payload(view.current, blob)
    assert pending == payloads.PendingPayload(peer, view.batch_of(peer), broadcast.commitment)
    good = broadcast.commitment.data_hash
    step, batch = view.current.step, view.batch_of(peer)
    assert payloads.payload_problem(good, step, batch, pending, step) is None
    assert "hash" in payloads.payload_problem(sha256(b"forged"), step, batch, pending, step)
    assert "step" in payloads.payload_problem(good, step + 1, batch, pending, step)
    assert "batch" in payloads.payload_problem(good, step, BatchId(99, 99), pending, step)
    # a blob nobody announced, or one already checked, has no pending commitment
    assert payloads.commitment_for_payload(view.current, sha256(b"unknown")) is None
    view.current.downloads[blob] = PayloadHandle()
    assert payloads.commitment_for_payload(view.current, blob) is None


def test_blooms_vote_for_the_first_payload_of_each_batch(sim: Simulation) -> None:
    view = Round(sim)
    state = view.current
    batches = list(state.data_assignments)
    first_owner = state.data_assignments[batches[0]]
    payloads.record_verified_payload(state, first_owner, batches[0], b"h0" * 16)
    participant, broadcast = state.blooms
    assert participant.contains(sha256(first_owner.signer))
    assert broadcast.contains(b"h0" * 16)
    assert state.batch_ids_not_yet_trained_on == set(batches[1:])
    # a second payload for a batch already voted on: the sender counts as a participant only
    late = simulated_identity(2)
    payloads.record_verified_payload(state, late, batches[0], b"h1" * 16)
    assert participant.contains(sha256(late.signer))
    assert not broadcast.contains(b"h1" * 16)
    for batch in batches[1:]:
        payloads.record_verified_payload(
            state, state.data_assignments[batch], batch, batch_hash(batch)
        )
    assert state.batch_ids_not_yet_trained_on is None
    # after every batch arrived, nothing more is added
    before = (participant.copy(), broadcast.copy())
    payloads.record_verified_payload(state, simulated_identity(0), batches[0], b"h2" * 16)
    assert (participant, broadcast) == before


def batch_hash(batch: BatchId) -> bytes:
    return sha256(f"{batch}".encode())


# --------------------------------------------------------------------------------------------
# applying round N - 2


def _results_for(state: RoundState, hashes: dict[BatchId, list[bytes]]) -> None:
    for batch, hs in hashes.items():
        owner = state.data_assignments[batch]
        state.results[batch] = [
            ResultEntry(owner, Commitment(h, bytes(64)),
                        TrainingResult(batch, ticket(i, owner.p2p_identity)))
            for i, h in enumerate(hs)
        ]  # fmt: skip


def test_apply_plan_orders_batches_and_follows_the_witnesses() -> None:
    sim = training_sim(clients=3, batch=6, witness_nodes=3)
    me = simulated_identity(0)
    round0 = plan_for(sim.coordinator, me).state
    a, b, c = sorted(round0.data_assignments)
    # round 0's results in the order this client received them: batch a has two competing
    # commitments, b one, c none at all
    _results_for(round0, {a: [b"A1" * 16, b"A2" * 16], b: [b"B1" * 16]})
    next_round(sim)
    # round 1's three witnesses vote on round 0 through their broadcast blooms; each votes for
    # the first commitment (in receive order) its bloom holds: A2, A1, A1 -> A1 has 2 >= quorum
    clients = sim.coordinator.epoch_state.clients
    seen = [[b"A2" * 16], [b"A1" * 16, b"A2" * 16], [b"A1" * 16]]
    for index, client in enumerate(clients):
        witness = Witness(
            CommitteeSelection_for(sim).get_witness(index),
            bloom_of([sha256(x.id.signer) for x in clients], KEYS),
            bloom_of(seen[index], KEYS),
            MerkleRoot(),
        )
        sim.coordinator.witness(client.id, witness, sim.now)
    step = sim.coordinator.progress.step
    sim.run_until(
        lambda co: co.run_state is RunState.RoundTrain and co.progress.step == step + 1, 30
    )
    assert sim.coordinator.witness_quorum(3) == 2
    plan = apply.plan_apply(round0, sim.coordinator)
    assert plan.batch_ids == [a, b, c]
    assert plan.step == step + 1
    assert [(x.batch_id, x.commitment.data_hash) for x in plan.chosen] == [(a, b"A1" * 16)]
    assert plan.chosen[0].blob_hash == round0.results[a][0].result.ticket.hash
    assert plan.no_consensus == [b]  # no witness saw B1
    assert plan.untrained == [c]


def CommitteeSelection_for(sim: Simulation):
    from psyche.coordinator import CommitteeSelection

    return CommitteeSelection.from_coordinator(sim.coordinator, 0)


def test_consensus_takes_the_first_matching_commitment_and_ties_go_last() -> None:
    hashes = [b"X" * 32, b"Y" * 32]
    commitments = [Commitment(h, bytes(64)) for h in hashes]

    def witness(*seen: bytes) -> Witness:
        return Witness(broadcast_bloom=bloom_of(seen, KEYS))

    # a witness that saw both votes for the first one in receive order
    assert (
        Coordinator.select_consensus_commitment_by_witnesses(
            commitments, [witness(*hashes), witness(hashes[1])], 1
        )
        == 1
    )  # 1 vote each: the tie goes to the last index
    assert (
        Coordinator.select_consensus_commitment_by_witnesses(
            commitments, [witness(*hashes), witness(*hashes), witness(hashes[1])], 2
        )
        == 0
    )
    assert (
        Coordinator.select_consensus_commitment_by_witnesses(commitments, [witness(hashes[0])], 2)
        is None
    )


def test_apply_is_skipped_in_an_epochs_first_two_rounds() -> None:
    assert not apply.needs_apply(RoundState())
    assert not apply.needs_apply(RoundState(height=0, step=4))
    assert apply.needs_apply(RoundState(height=1, step=5))


def test_cold_start_filter_only_for_p2p_checkpoints(sim: Simulation) -> None:
    from psyche.coordinator import Checkpoint, HubRepo

    llm = sim.coordinator.model.value
    llm.cold_start_warmup_steps = 3
    llm.checkpoint = Checkpoint.Hub(HubRepo("repo"))
    assert not apply.skip_for_cold_start(sim.coordinator, 0)
    llm.checkpoint = Checkpoint.P2P(HubRepo("repo"))
    assert apply.skip_for_cold_start(sim.coordinator, 2)
    assert not apply.skip_for_cold_start(sim.coordinator, 3)


# --------------------------------------------------------------------------------------------
# health checks and witnesses


def test_health_checks_name_trainers_the_witnesses_missed() -> None:
    sim = training_sim(clients=3, batch=6, witness_nodes=1)
    dead = simulated_identity(2)
    next_round(sim)  # round 1
    views = {i: plan_for(sim.coordinator, simulated_identity(i)).state for i in range(3)}
    step = sim.coordinator.progress.step
    assert sim.send_round_witnesses(missing=[dead]) == []
    sim.run_until(lambda c: c.run_state is RunState.RoundTrain and c.progress.step == step + 1, 30)
    for i, state in views.items():
        checks = witness.health_checks(state, sim.coordinator)
        if state.committee_info.witness_proof.witness:
            assert [node for node, _ in checks] == [dead]
            assert sim.coordinator.health_check(simulated_identity(i), checks) == 1
        else:
            assert checks == []
    # the epoch's first round (height 0) has nothing to check
    assert witness.health_checks(RoundState(), sim.coordinator) == []


def test_witness_is_sent_once_with_the_previous_rounds_blooms(sim: Simulation) -> None:
    coordinator = sim.coordinator
    witness_index = next(i for i in range(3) if CommitteeSelection_for(sim).get_witness(i).witness)
    me = simulated_identity(witness_index)
    previous = plan_for(coordinator, me).state
    previous.broadcasts = [b"a" * 32, b"b" * 32]
    previous.blooms[0].add(b"participant")
    current = plan_for(coordinator, me).state
    sent = witness.witness_to_send(previous, current)
    assert sent is not None
    assert sent.proof == current.committee_info.witness_proof
    assert sent.participant_bloom.contains(b"participant")
    assert sent.broadcast_merkle == MerkleTree([b"a" * 32, b"b" * 32]).get_root()
    assert sent.participant_bloom is not previous.blooms[0]  # a copy
    assert witness.witness_to_send(previous, current) is None
    # a non-witness never sends
    other = simulated_identity((witness_index + 1) % 3)
    assert witness.witness_to_send(RoundState(), plan_for(coordinator, other).state) is None


def test_opportunistic_witness_waits_for_everyone(sim: Simulation) -> None:
    coordinator = sim.coordinator
    clients = coordinator.epoch_state.clients
    witness_index = next(i for i in range(3) if CommitteeSelection_for(sim).get_witness(i).witness)
    me = simulated_identity(witness_index)
    current = plan_for(coordinator, me).state
    previous = RoundState(batch_ids_not_yet_trained_on={BatchId(0, 0)})

    def act(finished: bool) -> witness.OpportunisticAction:
        return witness.opportunistic_training_action(
            current, previous, training_finished=finished, clients=clients
        )

    assert act(False) is None
    assert act(True) is None  # a previous-round batch is still missing
    previous.batch_ids_not_yet_trained_on = None
    handle = PayloadHandle()
    previous.downloads[b"x" * 32] = handle
    assert act(True) is None  # still deserializing
    handle.set_result(DeserializedPayload([], 0))
    action = act(True)
    assert isinstance(action, witness.SendFinished)
    assert not action.warmup
    assert action.step == current.step
    assert action.commitment_data_hash == sha256(bytes(32))
    assert act(True) is None  # sent once; the others have not finished
    for client in clients:
        current.clients_finished[client.id] = Finished(MerkleRoot(), False)
    sent = act(True)
    assert isinstance(sent, witness.SendWitness)
    assert act(True) is None


def test_warmup_sends_finished_then_one_witness() -> None:
    coordinator = integration_test_coordinator(2, 4, 1)
    sim = Simulation(coordinator, now=1_000, rng=random.Random(1))
    for i in range(2):
        sim.join(simulated_identity(i))
    sim.run_until(lambda c: c.run_state is RunState.Warmup, 10)
    clients = sim.coordinator.epoch_state.clients
    me = simulated_identity(1)
    state, progress = RoundState(), warmup.WarmupProgress()

    def act() -> witness.OpportunisticAction:
        return warmup.opportunistic_warmup_action(state, progress, identity=me, clients=clients)

    first = act()
    assert isinstance(first, witness.SendFinished)
    assert first.warmup
    assert first.step == 0
    assert act() is None
    for client in clients:
        state.clients_finished[client.id] = Finished(MerkleRoot(), True)
    sent = act()
    assert isinstance(sent, witness.SendWarmupWitness)
    index = index_of(sim.coordinator, me)
    assert (sent.witness.proof.index, sent.witness.proof.position) == (index, index)
    assert not sent.witness.proof.witness
    assert act() is None
    sim.coordinator.warmup_witness(me, sent.witness, sim.now, 5)


def test_finished_broadcast_commits_to_the_merkle_root() -> None:
    key = SecretKey.generate()
    action = witness.SendFinished(7, MerkleRoot(sha256(b"root")), CommitteeProof(), warmup=False)
    message = witness.finished_broadcast(action, key.sign(action.commitment_data_hash), 5)
    assert message.commitment.data_hash == sha256(sha256(b"root"))
    assert payloads.verify_broadcast_signature(key.public_key, message)
    assert message.data == BroadcastType.Finished(Finished(action.merkle, False))
