"""Who does what in a round: committee (trainer / verifier / tie-breaker) and witness duty.

Every node derives the same answer from the round's random seed: `sha256(seed as LE u64)`, salted
with "committee" or "witness", seeds a swap-or-not permutation of the client indices; an index's
position in that permutation decides its duty. A node proves its duty by quoting its position,
which anyone can recompute.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Protocol

from psyche.coordinator.config import SOLANA_MAX_NUM_WITNESSES, CoordinatorConfig
from psyche.coordinator.errors import CoordinatorError, CoordinatorErrorKind, CoordinatorPanic
from psyche.coordinator.shuffle_cache import shuffle_rounds, shuffled_index
from psyche.core.node_identity import NodeIdentity
from psyche.core.numeric import U64_MAX
from psyche.core.serde import U64, RustEnum, SmallBool, struct
from psyche.core.sha256 import sha256, sha256v

COMMITTEE_SALT = "committee"
WITNESS_SALT = "witness"
_COMMITTEE_SALT_BYTES = COMMITTEE_SALT.encode()
_WITNESS_SALT_BYTES = WITNESS_SALT.encode()


class Committee(RustEnum):
    TieBreaker = 0
    Verifier = 1
    Trainer = 2

    def __str__(self) -> str:
        return _COMMITTEE_DISPLAY[self.value]


_COMMITTEE_DISPLAY = ("Tie breaker", "Verifier", "Trainer")


@struct(frozen=True)
class CommitteeProof:
    committee: Committee = Committee.TieBreaker
    # Position in the committee shuffle of the round.
    position: U64 = 0
    # Index of the node in the round's clients.
    index: U64 = 0


@struct(frozen=True)
class WitnessProof:
    # Position in the witness shuffle of the round.
    position: U64 = 0
    # Index of the sender in epoch_state.clients.
    index: U64 = 0
    # Whether the sender claims to be a witness this round.
    witness: SmallBool = False


class Member(Protocol):
    """What a selection reads of a client of the round (a `run_state.Client`)."""

    @property
    def id(self) -> NodeIdentity: ...


class SelectionRound(Protocol):
    """What a selection reads of a stored round (a `run_state.Round`)."""

    @property
    def tie_breaker_tasks(self) -> int: ...
    @property
    def clients_len(self) -> int: ...
    @property
    def random_seed(self) -> int: ...


class RoundHistory(Protocol):
    """What `CommitteeSelection.from_coordinator` reads of a coordinator (a `Coordinator`): its
    config and its stored rounds. The rounds' types refer to this module's proofs, so this module
    names only what it reads."""

    @property
    def config(self) -> CoordinatorConfig: ...
    def current_round(self) -> SelectionRound | None: ...
    def previous_round(self) -> SelectionRound | None: ...
    def previous_previous_round(self) -> SelectionRound | None: ...


def verifier_nodes_for(free_nodes: int, verification_percent: int) -> int:
    """How many of a round's `free_nodes` (its clients less its tie-breakers) are verifiers:
    `verification_percent` of them, rounded up. Upstream rounds down; the two agree wherever
    upstream can run (`verification_percent = 0`: its data selection asserts it) and wherever
    the percentage of the free nodes is whole (every upstream test vector). Rounding up is what
    lets a small run verify at all: 4 clients at 25 % are one tie-breaker, one verifier and two
    trainers (rounding down, `3 x 25 // 100` elects no verifier)."""
    return -(-(free_nodes * verification_percent) // 100)


def _invalid() -> CoordinatorError:
    return CoordinatorError(CoordinatorErrorKind.InvalidCommitteeSelection)


class CommitteeSelection:
    """Upstream `CommitteeSelection`; the constructor is upstream's `CommitteeSelection::new`.

    Raises `CoordinatorError(InvalidCommitteeSelection)` for impossible parameters, in upstream's
    order of checks.
    """

    tie_breaker_nodes: int
    verifier_nodes: int
    total_nodes: int
    witness_nodes: int
    seed: bytes
    _committee_seed: bytes | None
    _witness_seed: bytes | None

    __slots__ = (
        "_committee_seed",
        "_witness_seed",
        "seed",
        "tie_breaker_nodes",
        "total_nodes",
        "verifier_nodes",
        "witness_nodes",
    )

    def __init__(
        self,
        tie_breaker_nodes: int,
        witness_nodes: int,
        verification_percent: int,
        total_nodes: int,
        seed: int,
    ) -> None:
        if not (
            0 <= tie_breaker_nodes <= U64_MAX
            and 0 <= witness_nodes <= U64_MAX
            and 0 <= total_nodes <= U64_MAX
            and 0 <= verification_percent <= 0xFF
            and 0 <= seed <= U64_MAX
        ):
            raise ValueError(
                "CommitteeSelection takes usize node counts, a u8 percentage and a u64 seed: "
                f"{(tie_breaker_nodes, witness_nodes, verification_percent, total_nodes, seed)}"
            )
        if total_nodes >= U64_MAX:
            raise _invalid()
        if total_nodes < tie_breaker_nodes:
            raise _invalid()
        if witness_nodes != 0 and total_nodes < witness_nodes:
            raise _invalid()
        if verification_percent > 100:
            raise _invalid()
        free_nodes = total_nodes - tie_breaker_nodes
        init = object.__setattr__  # immutable once built: selections are shared per round
        init(self, "tie_breaker_nodes", tie_breaker_nodes)
        init(self, "verifier_nodes", verifier_nodes_for(free_nodes, verification_percent))
        init(self, "total_nodes", total_nodes)
        init(self, "witness_nodes", witness_nodes)
        init(self, "seed", sha256(seed.to_bytes(8, "little")))
        # the salted seeds are derived on first use
        init(self, "_committee_seed", None)
        init(self, "_witness_seed", None)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("CommitteeSelection is immutable")

    @classmethod
    def from_coordinator(cls, coordinator: RoundHistory, offset: int) -> CommitteeSelection:
        """The selection of the current round (offset 0), the previous (-1) or the one before (-2).

        Raises `CoordinatorError(NoActiveRound)` when that round does not exist or the offset is
        anything else.
        """
        if offset == -2:
            round_ = coordinator.previous_previous_round()
        elif offset == -1:
            round_ = coordinator.previous_round()
        elif offset == 0:
            round_ = coordinator.current_round()
        else:
            round_ = None
        if round_ is None:
            raise CoordinatorError(CoordinatorErrorKind.NoActiveRound)
        return _cached_selection(
            round_.tie_breaker_tasks,
            coordinator.config.witness_nodes,
            coordinator.config.verification_percent,
            round_.clients_len,
            round_.random_seed,
        )

    # ---- positions ---------------------------------------------------------------------------

    def _position(self, index: int, salted_seed: bytes) -> int:
        if not 0 <= index < self.total_nodes:
            # upstream: `assert!(index < index_count)` inside compute_shuffled_index
            raise CoordinatorPanic(
                f"assertion failed: index < index_count ({index} >= {self.total_nodes})"
            )
        return shuffled_index(index, self.total_nodes, salted_seed)

    def _salted_seed(self, slot: str, salt: bytes) -> bytes:
        """`sha256(seed, salt)`, computed once and kept in `slot`."""
        seed: bytes | None = getattr(self, slot)
        if seed is None:
            seed = sha256v((self.seed, salt))
            object.__setattr__(self, slot, seed)
        return seed

    def committee_position(self, index: int) -> int:
        return self._position(index, self._salted_seed("_committee_seed", _COMMITTEE_SALT_BYTES))

    def witness_position(self, index: int) -> int:
        return self._position(index, self._salted_seed("_witness_seed", _WITNESS_SALT_BYTES))

    def get_witness(self, index: int) -> WitnessProof:
        position = self.witness_position(index)
        return WitnessProof(position, index, self.get_witness_from_position(position))

    def get_committee(self, index: int) -> CommitteeProof:
        position = self.committee_position(index)
        return CommitteeProof(self.get_committee_from_position(position), position, index)

    def get_committee_from_position(self, committee_position: int) -> Committee:
        if committee_position < self.tie_breaker_nodes:
            return Committee.TieBreaker
        if committee_position < self.tie_breaker_nodes + self.verifier_nodes:
            return Committee.Verifier
        return Committee.Trainer

    def get_witness_from_position(self, witness_position: int) -> bool:
        if self.witness_nodes == 0:
            return witness_position < SOLANA_MAX_NUM_WITNESSES
        return witness_position < self.witness_nodes

    def everyone_trains(self) -> bool:
        """True when every position is a Trainer's (no tie-breakers or verifiers), so a node's
        committee is known without computing its position."""
        return self.tie_breaker_nodes + self.verifier_nodes == 0

    # ---- verification ------------------------------------------------------------------------

    def verify_committee_for_client(
        self, client_id: NodeIdentity, proof: CommitteeProof, clients: Sequence[Member]
    ) -> bool:
        return _verify_client(client_id, proof.index, clients) and self.verify_committee(proof)

    def verify_witness_for_client(
        self, client_id: NodeIdentity, proof: WitnessProof, clients: Sequence[Member]
    ) -> bool:
        return _verify_client(client_id, proof.index, clients) and self.verify_witness(proof)

    def verify_committee(self, proof: CommitteeProof) -> bool:
        position = self.committee_position(proof.index)
        return proof.position == position and proof.committee is self.get_committee_from_position(
            position
        )

    def verify_witness(self, proof: WitnessProof) -> bool:
        position = self.witness_position(proof.index)
        return proof.position == position and bool(proof.witness) == (
            self.get_witness_from_position(position)
        )

    # ---- accessors ---------------------------------------------------------------------------

    def get_seed(self) -> bytes:
        return self.seed

    def get_num_tie_breaker_nodes(self) -> int:
        return self.tie_breaker_nodes

    def get_num_verifier_nodes(self) -> int:
        return self.verifier_nodes

    def get_num_trainer_nodes(self) -> int:
        return self.total_nodes - self.tie_breaker_nodes - self.verifier_nodes

    def __repr__(self) -> str:
        return (
            f"CommitteeSelection(tie_breaker_nodes={self.tie_breaker_nodes}, "
            f"verifier_nodes={self.verifier_nodes}, witness_nodes={self.witness_nodes}, "
            f"total_nodes={self.total_nodes}, seed={self.seed.hex()})"
        )


@lru_cache(maxsize=64)
def _cached_selection(
    tie_breaker_nodes: int,
    witness_nodes: int,
    verification_percent: int,
    total_nodes: int,
    seed: int,
) -> CommitteeSelection:
    # A selection never changes once built (its salted seeds are memos), so every message of a
    # round can share one.
    return CommitteeSelection(
        tie_breaker_nodes, witness_nodes, verification_percent, total_nodes, seed
    )


def _verify_client(client_id: NodeIdentity, index: int, clients: Sequence[Member]) -> bool:
    # Checked before the position, so an index past the clients never reaches the shuffle.
    return 0 <= index < len(clients) and clients[index].id.signer == client_id.signer


def clear_caches() -> None:
    """Forget every memoized selection and permutation (for benchmarks measuring cold rounds)."""
    _cached_selection.cache_clear()
    shuffle_rounds.cache_clear()
