"""What every node reads off a coordinator state, and so agrees on (upstream's `&self` methods of
`Coordinator`): which stored round is which, who held which index in an earlier round, batch sizes,
who was a healthy trainer, how many witnesses make a quorum and which commitment they chose.

`CoordinatorQueries` is mixed into `Coordinator` (so the queries stay its methods, as upstream's);
none of them changes the state.
"""

from __future__ import annotations

from collections.abc import Sequence

from psyche.coordinator.commitment import Commitment
from psyche.coordinator.committee_selection import Committee, CommitteeProof, CommitteeSelection
from psyche.coordinator.config import CoordinatorConfig
from psyche.coordinator.errors import (
    CoordinatorError,
    CoordinatorErrorKind,
    CoordinatorPanic,
    CoordinatorUnimplemented,
)
from psyche.coordinator.model import LLM, Model
from psyche.coordinator.run_state import (
    NUM_STORED_ROUNDS,
    Client,
    CoordinatorEpochState,
    CoordinatorProgress,
    HealthChecks,
    Round,
    RunState,
    Witness,
)
from psyche.core.node_identity import NodeIdentity
from psyche.core.numeric import truncating_cast_unsigned, wrapping_u32, wrapping_u64
from psyche.core.sha256 import sha256

__all__ = [
    "WITNESS_QUORUM_RAIO",
    "CoordinatorQueries",
    "unhealthy_trainers",
    "witness_quorum_for",
]

# (sic) upstream's spelling
WITNESS_QUORUM_RAIO = 2.0 / 3.0

_HALTED = frozenset((RunState.Uninitialized, RunState.Finished, RunState.Paused))
_ACTIVE = frozenset((RunState.RoundTrain, RunState.RoundWitness, RunState.Cooldown))


def witness_quorum_for(witness_nodes: int, num_witnesses: int) -> int:
    """Upstream `Coordinator::witness_quorum` for a run configured with `witness_nodes` (0:
    every client witnesses, and the quorum depends on how many reported)."""
    witness_nodes = witness_nodes or truncating_cast_unsigned(num_witnesses, 16)
    if witness_nodes == 0:
        raise CoordinatorPanic(
            "internal error: entered unreachable code (witness quorum of zero witnesses)"
        )
    if witness_nodes == 1:
        return 1
    if witness_nodes in (2, 3):
        return 2
    # f64 product truncated by `as u16`, at least 1
    return max(int(witness_nodes * WITNESS_QUORUM_RAIO), 1)


class CoordinatorQueries:
    """The read-only half of `Coordinator` (the fields are declared there, in wire order)."""

    run_state: RunState
    model: Model
    config: CoordinatorConfig
    progress: CoordinatorProgress
    epoch_state: CoordinatorEpochState

    def _llm(self) -> LLM:
        llm: LLM = self.model.value
        return llm

    # ---- health and consensus ------------------------------------------------------------------

    def healthy(self, node_id: NodeIdentity, proof: CommitteeProof) -> bool:
        """Whether `node_id` did its duty in the previous round, given its committee proof.

        Raises `CoordinatorError(InvalidCommitteeProof)` for a proof that does not belong to
        `node_id`, and `CoordinatorUnimplemented` for tie-breakers and verifiers (upstream's
        `todo!()`). A verifying run judges by the committee of the round the witnesses attest
        (`_trained_attested_round_healthy`).
        """
        round_ = self.previous_round()
        if round_ is None:
            raise CoordinatorError(CoordinatorErrorKind.NoActiveRound)
        index = proof.index
        if not 0 <= index < round_.clients_len:
            raise CoordinatorError(CoordinatorErrorKind.InvalidCommitteeProof)
        client = self.get_client_at_historical_index(index, round_.clients_len)
        if client is None:
            raise CoordinatorError(CoordinatorErrorKind.InvalidCommitteeProof)
        selection = CommitteeSelection.from_coordinator(self, -1)
        if client.id.signer != node_id.signer or not selection.verify_committee_for_client(
            client.id, proof, self.epoch_state.clients
        ):
            raise CoordinatorError(CoordinatorErrorKind.InvalidCommitteeProof)
        if self.config.verification_percent != 0:
            return self._trained_attested_round_healthy(client.id, index, round_)
        if proof.committee is Committee.Trainer:
            return self.trainer_healthy(client.id)
        raise CoordinatorUnimplemented(
            f"not yet implemented: health of a {proof.committee.name} (upstream `todo!()`)"
        )

    def _trained_attested_round_healthy(
        self, node_id: NodeIdentity, index: int, previous: Round
    ) -> bool:
        """Health in a verifying run: judged by the committee of the round the witnesses attest.

        The previous round's witnesses attest the results of the round before it (the one
        `plan_apply` applies from their blooms), so only a trainer of *that* round owed them a
        result. Upstream judges the previous round's trainers, which is the same thing only
        while every client trains every round; a verifying run elects its committees afresh
        each round, and a member that trains now but verified then was named for a result it
        never owed. Verifiers and tie-breakers train nothing the witnesses could attest: they
        answer to the tie-breakers' decisions (`psyche.coordinator.verification`); where they
        train too (`verifiers_train`), every member of the attested round is judged.

        Guaranteed: nobody is judged without an attested round in this epoch, nor when a client
        has left since that round (indices are then those of a different client list, and a
        health check names a client only on proof).
        """
        attested = self.previous_previous_round()
        if (
            attested is None
            or previous.height == 0
            or attested.clients_len != len(self.epoch_state.clients)
        ):
            return True
        selection = CommitteeSelection.from_coordinator(self, -2)
        trained = self.config.verifiers_train  # every member trained (`data_selection`)
        if not trained and selection.get_committee(index).committee is not Committee.Trainer:
            return True
        return self.trainer_healthy(node_id)

    def witness_quorum(self, num_witnesses: int) -> int:
        """Witnesses needed to agree; with `witness_nodes` 0 it depends on who showed up."""
        return witness_quorum_for(self.config.witness_nodes, num_witnesses)

    def trainer_healthy(self, node_id: NodeIdentity) -> bool:
        round_ = self.previous_round()
        if round_ is None:
            raise CoordinatorError(CoordinatorErrorKind.NoActiveRound)
        score = self.trainer_healthy_score_by_witnesses(node_id, round_.witnesses)
        return score >= self.witness_quorum(len(round_.witnesses))

    @staticmethod
    def trainer_healthy_score_by_witnesses(
        node_id: NodeIdentity, witnesses: Sequence[Witness]
    ) -> int:
        """How many witnesses list `node_id` (its signer's sha256) in their participant bloom."""
        item = sha256(node_id.signer)
        return sum(1 for w in witnesses if w.participant_bloom.contains(item))

    @staticmethod
    def select_consensus_commitment_by_witnesses(
        commitments: Sequence[Commitment], witnesses: Sequence[Witness], witness_quorum: int
    ) -> int | None:
        """Index of the commitment most witnesses saw (at least `witness_quorum`), or None.

        Each witness votes for the first commitment found in its broadcast bloom. Ties go to
        the *last* index, as Rust's `max_by_key` does.
        """
        scores = [0] * len(commitments)
        for witness in witnesses:
            for index, commitment in enumerate(commitments):
                if witness.broadcast_bloom.contains(commitment.data_hash):
                    scores[index] += 1
                    break
        best: int | None = None
        for index, score in enumerate(scores):
            if score >= witness_quorum and (best is None or score >= scores[best]):
                best = index
        return best

    def current_round(self) -> Round | None:
        head = self.epoch_state.rounds_head
        return self.epoch_state.rounds[head] if head < NUM_STORED_ROUNDS else None

    def _current_round_unchecked(self) -> Round:
        round_ = self.current_round()
        if round_ is None:
            raise CoordinatorPanic(
                f"index out of bounds: the len is {NUM_STORED_ROUNDS} but the index is "
                f"{self.epoch_state.rounds_head} (rounds_head)"
            )
        return round_

    def _current_round_unwrap(self) -> Round:
        round_ = self.current_round()
        if round_ is None:
            raise CoordinatorPanic("called `Option::unwrap()` on a `None` value (current round)")
        return round_

    def previous_round(self) -> Round | None:
        current = self.current_round()
        if current is None:
            return None
        head = self.epoch_state.rounds_head
        if head == 0 and current.height == 0:
            return None
        return self.epoch_state.rounds[NUM_STORED_ROUNDS - 1 if head == 0 else head - 1]

    def previous_previous_round(self) -> Round | None:
        current = self.current_round()
        if current is None:
            return None
        head = self.epoch_state.rounds_head
        if head == 0 and current.height <= 1:
            return None
        # Upstream quirk kept: at head 1 this is slot 3 even in an epoch's second round, when
        # slot 3 still holds a zeroed (or stale) round.
        rounds = self.epoch_state.rounds
        if head == 0:
            return rounds[NUM_STORED_ROUNDS - 2]
        if head == 1:
            return rounds[NUM_STORED_ROUNDS - 1]
        return rounds[head - 2]

    def active(self) -> bool:
        return self.run_state in _ACTIVE

    def halted(self) -> bool:
        return self.run_state in _HALTED

    def get_client_at_historical_index(self, n: int, prev_clients_len: int) -> Client | None:
        """The client that had index `n` in a round of `prev_clients_len` clients.

        Clients only leave during an epoch, each appended to `exited_clients`; this walks that
        list from its end (upstream's rule, exact only while the order of exits matches).
        """
        clients = self.epoch_state.clients
        if n < 0:
            return None  # (a u64 upstream)
        if n < len(clients):
            return clients[n]
        if n < prev_clients_len:
            offset = prev_clients_len - n - 1
            exited = self.epoch_state.exited_clients
            return exited[len(exited) - 1 - offset] if offset < len(exited) else None
        return None

    def get_historical_clients(self, clients_len: int) -> list[Client]:
        found = (self.get_client_at_historical_index(i, clients_len) for i in range(clients_len))
        return [c for c in found if c is not None]

    def get_sequence_length(self) -> int:
        return self._llm().max_seq_len

    def total_tokens_processed(self, round_: Round | None) -> int:
        """Tokens trained before `round_` (before the epoch when None)."""
        start = round_.data_index if round_ is not None else self.progress.epoch_start_data_index
        return wrapping_u64(start * self.get_sequence_length())

    def get_target_global_batch_size(self, round_: Round | None) -> int:
        return self.config.get_batch_size(self.total_tokens_processed(round_))

    def get_cold_start_warmup_bounds(self) -> tuple[int, int] | None:
        steps = self._llm().cold_start_warmup_steps
        if not self.epoch_state.cold_start_epoch or steps == 0:
            return None
        start = self.epoch_state.start_step
        return (start, wrapping_u32(start + steps))

    def check_cold_start_warmup_steps(self) -> bool:
        """Whether the cold-start warmup fits in one epoch's rounds (an estimate)."""
        steps = self._llm().cold_start_warmup_steps
        if steps == 0:
            return True
        config = self.config
        if config.max_round_train_time == 0:
            raise CoordinatorPanic("attempt to divide by zero (max_round_train_time)")
        training_time = wrapping_u64(config.epoch_time - config.warmup_time)
        return steps <= training_time // config.max_round_train_time

    def is_warmup_just_starting(self) -> bool:
        return bool(self.epoch_state.first_round) and self.run_state is RunState.Warmup

    def is_training_just_starting(self) -> bool:
        return bool(self.epoch_state.first_round) and self.run_state is RunState.RoundTrain


def unhealthy_trainers(
    coordinator: CoordinatorQueries, selection: CommitteeSelection
) -> HealthChecks:
    """The health checks an honest witness sends: every current client, with its committee proof
    under `selection` (the previous round's), that was not a healthy trainer of that round (an
    error counts as unhealthy; upstream's `start_sending_health_checks`)."""
    checks: HealthChecks = []
    for index, client in enumerate(coordinator.epoch_state.clients):
        proof = selection.get_committee(index)
        try:
            healthy = coordinator.healthy(client.id, proof)
        except CoordinatorError:
            healthy = False
        if not healthy:
            checks.append((client.id, proof))
    return checks
