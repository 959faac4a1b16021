"""Witnessing a round (upstream `state/witness.rs`, the opportunistic check of `steps.rs` and the
health checks of `train.rs`).

A witness of round N reports, for round N - 1, which clients' payloads it checked (participant
bloom), which commitment it voted for per batch (broadcast bloom) and the merkle root of the
broadcasts it saw. During training every client says when it holds everything (`Finished`);
once all have, a witness sends its witness without waiting for the round's timeout. At the start
of a round, a witness of the round just finished names the trainers too few witnesses saw.
Everything here is plain: it reads the round states and returns what to send (and marks it sent).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from psyche.client.round import payloads
from psyche.client.round.broadcast import Broadcast, BroadcastType, Finished
from psyche.client.round.state import PayloadHandle, RoundState
from psyche.coordinator import Client, Coordinator, Witness
from psyche.coordinator.commitment import Commitment
from psyche.coordinator.committee_selection import CommitteeProof
from psyche.coordinator.consensus import unhealthy_trainers
from psyche.coordinator.errors import CoordinatorError, CoordinatorErrorKind
from psyche.coordinator.model import Checkpoint
from psyche.core.bloom import WitnessBloom
from psyche.core.merkle_tree import MerkleRoot, MerkleTree
from psyche.core.node_identity import NodeIdentity
from psyche.core.sha256 import sha256


def merkle_root(broadcasts: Sequence[bytes]) -> MerkleRoot:
    return MerkleTree(broadcasts).get_root() or MerkleRoot()


def witness_due(previous: RoundState, current: RoundState) -> bool:
    """Whether this client is a witness of the current round that has not sent its witness of
    the previous one yet."""
    info = current.committee_info
    return not previous.sent_witness and info is not None and info.witness_proof.witness


def witness_to_send(previous: RoundState, current: RoundState) -> Witness | None:
    """The witness for the previous round, once, if this client is a witness of the current one
    (upstream `WitnessStep::get_witness_to_send`); marks it sent."""
    if not witness_due(previous, current):
        return None
    info = current.committee_info
    assert info is not None  # `witness_due` says so
    payloads.settle_blind_votes(previous)  # votes held back until the whole round is known
    if previous.blooms is not None:
        participant_bloom, broadcast_bloom = (b.copy() for b in previous.blooms)
    else:
        participant_bloom, broadcast_bloom = WitnessBloom(), WitnessBloom()
    previous.sent_witness = True
    return Witness(
        info.witness_proof, participant_bloom, broadcast_bloom, merkle_root(previous.broadcasts)
    )


def health_checks(
    round_state: RoundState, coordinator: Coordinator
) -> list[tuple[NodeIdentity, CommitteeProof]]:
    """The trainers of the round just finished that too few witnesses saw (upstream
    `start_sending_health_checks`); only a witness of that round sends them."""
    if round_state.height == 0:
        return []
    info = round_state.committee_info
    if info is None:
        raise CoordinatorError(CoordinatorErrorKind.NoActiveRound)
    if coordinator.epoch_state.first_round or not info.witness_proof.witness:
        return []
    return unhealthy_trainers(coordinator, info.selection)


YOUNG_WITNESS_ROUNDS = 4
"""Rounds a client that joined a trained model trains before its witness checks' refusals
accuse their senders (`refusals_accuse`)."""


def refusals_accuse(joined_trained_model: bool | None, momentum_rounds: int) -> bool:
    """Whether a result this client's witness checks refuse also names its sender as not
    delivering: it stays out of the participant bloom, and the health checks drop the sender
    (`payloads.check_payload`'s `accuse`).

    The checks read a result along this client's own update, plus the results it accepted in
    rounds it has closed. A client whose DisTrO momentum started on a model the run had already
    trained (`joined_trained_model`: it joined, or came back, with a P2P checkpoint) has, for
    the rounds it checks before its first round closes, only its fresh update, unlike the
    continuing members' momenta, which remember every earlier round. Measured in the
    end-to-end run (tests/e2e/test_training.py, 4 runs): the joiner read the honest results of
    its first two rounds at t = -8.3 to 23 (1 of 24 below the -6 floor; a fifth run refused
    one at -7.50), where the continuing members read every epoch-1 result at 16 to 28; from its third
    round on it read 13 to 30. As a round's only witness, such a refusal had the next health
    check drop an honest member. Until it has trained more than `YOUNG_WITNESS_ROUNDS` rounds
    (`momentum_rounds`), such a witness withholds its vote from what it refuses, so nothing is
    applied on its word, but attests the delivery. A run's first members start their momenta
    together and agree from the first round: their refusals accuse at once. None (not known)
    counts as young. The trade-off: while every witness of a round is young, a hostile
    trainer's refused result counts as delivered (it is not applied).
    """
    return joined_trained_model is False or momentum_rounds > YOUNG_WITNESS_ROUNDS


def loaded_trained_model(state: Coordinator) -> bool:
    """Whether a client starting at `state` loaded a model the run had trained (a P2P
    checkpoint: it joined a running run, or came back to it), so its momentum starts fresh
    against its peers' (`refusals_accuse`)."""
    return isinstance(state.model.value.checkpoint, Checkpoint.P2P | Checkpoint.P2PGcs)


# --------------------------------------------------------------------------------------------
# The opportunistic check (every 500 ms, upstream's interval)


@dataclass(frozen=True)
class SendFinished:
    step: int
    merkle: MerkleRoot
    proof: CommitteeProof
    warmup: bool

    @property
    def commitment_data_hash(self) -> bytes:
        return sha256(self.merkle.inner)


@dataclass(frozen=True)
class SendWitness:
    witness: Witness


@dataclass(frozen=True)
class SendWarmupWitness:
    witness: Witness


OpportunisticAction = SendFinished | SendWitness | SendWarmupWitness | None


def unfinished_clients(round_state: RoundState, clients: Sequence[Client]) -> list[NodeIdentity]:
    return [c.id for c in clients if c.id not in round_state.clients_finished]


def previous_round_settled(previous: RoundState) -> bool:
    """Every batch of the previous round has a checked payload and all are deserialized."""
    if previous.batch_ids_not_yet_trained_on is not None:
        return False
    return all(isinstance(s, PayloadHandle) and s.done for s in previous.downloads.values())


def opportunistic_training_action(
    current: RoundState,
    previous: RoundState,
    *,
    training_finished: bool,
    clients: Sequence[Client],
    judged: bool = True,
) -> OpportunisticAction:
    """Upstream's 500 ms check during training: once this client has trained and has every
    payload of the previous round, it says so (`Finished`, once); once everyone has, a witness
    sends its witness without waiting for the round's timeout. Marks what it returns as sent.
    `judged` False: the previous round's held votes wait for their judgement
    (`payloads.judgement_due`, made off the loop), and so does the witness."""
    info = current.committee_info
    if info is None or not training_finished or not previous_round_settled(previous):
        return None
    if not current.sent_finished:
        current.sent_finished = True
        return SendFinished(
            current.step, merkle_root(previous.broadcasts), info.committee_proof, warmup=False
        )
    if unfinished_clients(current, clients) or not judged:
        return None
    witness = witness_to_send(previous, current)
    return SendWitness(witness) if witness is not None else None


def finished_broadcast(action: SendFinished, signature: bytes, nonce: int) -> Broadcast:
    """The signed gossip message for a `SendFinished`."""
    return Broadcast(
        step=action.step,
        proof=action.proof,
        commitment=Commitment(action.commitment_data_hash, signature),
        nonce=nonce,
        data=BroadcastType.Finished(Finished(action.merkle, action.warmup)),
    )
