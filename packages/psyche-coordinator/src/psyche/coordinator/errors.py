"""How the coordinator says no.

Two kinds of failure, kept apart on purpose:

* `CoordinatorError` is upstream's `CoordinatorError` result: an expected rejection of a message
  or tick (a duplicate witness, a halted run, ...). Its `kind` is the upstream variant (the index
  is upstream's `repr(u8)` value) and `str()` is upstream's display text. The coordinator is left
  unchanged, exactly as upstream leaves it.
* `CoordinatorPanic` is raised where upstream panics (an `assert!`, an out-of-range index, an
  `unreachable!()`, a full `FixedVec`, a division by zero). Upstream crashes the centralized
  server or reverts the Solana transaction; here the exception is raised *before* the
  coordinator is changed, so a backend can reject the input and carry on.
  `CoordinatorUnimplemented` is the subset that comes from upstream's `todo!()` or from asserts
  that guard unimplemented features (verifier and tie-breaker committees).
"""

from __future__ import annotations

from psyche.core.serde import RustEnum


class CoordinatorErrorKind(RustEnum):
    NoActiveRound = 0
    InvalidWitness = 1
    InvalidRunState = 2
    DuplicateWitness = 3
    InvalidHealthCheck = 4
    Halted = 5
    WitnessesFull = 6
    CannotResume = 7
    InvalidWithdraw = 8
    InvalidCommitteeSelection = 9
    InvalidCommitteeProof = 10

    def __str__(self) -> str:
        return _DISPLAY[self]


_DISPLAY = {
    CoordinatorErrorKind.NoActiveRound: "No active round",
    CoordinatorErrorKind.InvalidWitness: "Invalid witness",
    CoordinatorErrorKind.InvalidRunState: "Invalid run state",
    CoordinatorErrorKind.DuplicateWitness: "Duplicate witness",
    CoordinatorErrorKind.InvalidHealthCheck: "Invalid health check",
    CoordinatorErrorKind.Halted: "Halted",
    CoordinatorErrorKind.WitnessesFull: "Witnesses full",
    CoordinatorErrorKind.CannotResume: "Cannot resume",
    CoordinatorErrorKind.InvalidWithdraw: "Invalid withdraw",
    CoordinatorErrorKind.InvalidCommitteeSelection: "Invalid committee selection",
    CoordinatorErrorKind.InvalidCommitteeProof: "Invalid committee proof",
}


class CoordinatorError(Exception):
    """An upstream `CoordinatorError`; `kind` says which one."""

    def __init__(self, kind: CoordinatorErrorKind) -> None:
        super().__init__(str(kind))
        self.kind = kind

    def __repr__(self) -> str:
        return f"CoordinatorError({self.kind.name})"

    def __reduce__(self) -> tuple[type[CoordinatorError], tuple[CoordinatorErrorKind]]:
        return (type(self), (self.kind,))


class CoordinatorPanic(RuntimeError):
    """Upstream panics here; the message names the upstream check. The state is unchanged."""


class CoordinatorUnimplemented(CoordinatorPanic, NotImplementedError):
    """Upstream's `todo!()` (and asserts that stand in for one): a feature upstream lacks."""
