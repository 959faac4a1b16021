"""What a person and a tracker see of verification (issue 27): who this client verified, what it
found, and who was punished, one round at a time.

A `VerificationTally` collects the `verification` events this client's verifier and
tie-breaker log (`psyche.client.round.verify`: one per finding) and the `verification_punished`
events a backend logs when the coordinator punished a member (the Solana backend reads them
from the run's verification account: `psyche.solana.verification`). `take(step)` hands the
rounds up to `step` over as one `VerificationSummary`: its `text()` is the compact clause the
progress line appends, its `metrics()` the tracker values.

`VerificationEvents` is the logging handler that feeds a tally from those events; a client
process has one (a second client in the same process would hear the first's events too).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from psyche.coordinator.verification import VerificationDuty, VerificationReport

VERIFIED_KEY = "verification/verified"
MISMATCHES_KEY = "verification/mismatches"
PUNISHED_KEY = "verification/punished"
_NAMES_SHOWN = 3


@dataclass(frozen=True)
class Verified:
    """One finding: `trainer`'s result for `batch` at `step` matched the recompute or not."""

    step: int
    role: str
    trainer: str
    batch: str
    matches: bool
    score: float


@dataclass(frozen=True)
class Punished:
    """`loser` was removed (and banned) as `role`; `slashed` points when the backend slashes."""

    step: int
    loser: str
    role: str
    slashed: int | None = None


@dataclass(frozen=True)
class VerificationSummary:
    """What verification did since the last summary."""

    verified: tuple[Verified, ...] = ()
    punished: tuple[Punished, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.verified or self.punished)

    def text(self) -> str:
        """`verified 2 (1 mismatch: fd50b8e3 B[4, 7]), punished fd50b8e3 (trainer, slashed
        10)`; empty when nothing happened."""
        parts = []
        if self.verified:
            wrong = [v for v in self.verified if not v.matches]
            clause = f"verified {len(self.verified)}"
            if wrong:
                shown = ", ".join(f"{v.trainer} {v.batch}" for v in wrong[:_NAMES_SHOWN])
                more = "" if len(wrong) <= _NAMES_SHOWN else f" +{len(wrong) - _NAMES_SHOWN}"
                clause += f" ({len(wrong)} mismatch{'es' if len(wrong) > 1 else ''}: {shown}{more})"
            parts.append(clause)
        if self.punished:
            shown = ", ".join(
                f"{p.loser} ({p.role}"
                + ("" if p.slashed is None else f", slashed {p.slashed}")
                + ")"
                for p in self.punished[:_NAMES_SHOWN]
            )
            more = (
                ""
                if len(self.punished) <= _NAMES_SHOWN
                else f" +{len(self.punished) - _NAMES_SHOWN}"
            )
            parts.append(f"punished {shown}{more}")
        return ", ".join(parts)

    def metrics(self) -> dict[str, int]:
        """Tracker values (absent when nothing happened: a round without verification logs
        no zeros)."""
        if not self:
            return {}
        return {
            VERIFIED_KEY: len(self.verified),
            MISMATCHES_KEY: sum(1 for v in self.verified if not v.matches),
            PUNISHED_KEY: len(self.punished),
        }


class VerifyJobLike(Protocol):
    """A round's duties as this client planned them (`psyche.client.round.verify.VerifyJob`)."""

    @property
    def duties(self) -> Sequence[VerificationDuty]: ...

    @property
    def tie_breaker(self) -> bool: ...


@dataclass
class VerificationTally:
    """Findings and punishments not yet summed up, bounded (`limit` of each: the oldest go)."""

    limit: int = 256
    verified: list[Verified] = field(default_factory=list)
    punished: list[Punished] = field(default_factory=list)

    def add_verified(self, finding: Verified) -> None:
        self.verified = [*self.verified, finding][-self.limit :]

    def add_punished(self, punished: Punished) -> None:
        self.punished = [*self.punished, punished][-self.limit :]

    def add_report(self, job: VerifyJobLike, report: VerificationReport) -> None:
        """Every finding of this client's own `report` for the round `job` (its duties name
        the trainers)."""
        trainers = {duty.batch_id: duty.trainer for duty in job.duties}
        role = "tie-breaker" if job.tie_breaker else "verifier"
        for finding in report.findings:
            self.add_verified(
                Verified(
                    int(report.step),
                    role,
                    str(trainers.get(finding.batch_id, "?")),
                    str(finding.batch_id),
                    bool(finding.matches),
                    float(finding.score),
                )
            )

    def take(self, step: int) -> VerificationSummary:
        """Everything about rounds up to `step`, removed from the tally (a finding arrives a
        round or two after the round it is about, so a report takes what arrived by then)."""
        verified = tuple(v for v in self.verified if v.step <= step)
        punished = tuple(p for p in self.punished if p.step <= step)
        self.verified = [v for v in self.verified if v.step > step]
        self.punished = [p for p in self.punished if p.step > step]
        return VerificationSummary(verified, punished)


class VerificationEvents(logging.Handler):
    """Feeds `tally` from `verification` and `verification_punished` events (`log_event`)."""

    def __init__(self, tally: VerificationTally) -> None:
        super().__init__(logging.DEBUG)
        self.tally = tally

    def emit(self, record: logging.LogRecord) -> None:
        from psyche.client.observe.logs import event_fields

        message = record.msg
        if message not in ("verification", "verification_punished"):
            return
        fields = event_fields(record)
        try:
            if message == "verification":
                self.tally.add_verified(
                    Verified(
                        int(fields["step"]),
                        str(fields["role"]),
                        str(fields["trainer"]),
                        str(fields["batch_id"]),
                        bool(fields["matches"]),
                        float(fields["score"]),
                    )
                )
            else:
                slashed = fields.get("slashed")
                self.tally.add_punished(
                    Punished(
                        int(fields["step"]),
                        str(fields["loser"]),
                        str(fields["role"]),
                        None if slashed is None else int(slashed),
                    )
                )
        except (KeyError, TypeError, ValueError):
            return  # not one of ours: nothing to count

    def attach(self, logger: logging.Logger | None = None) -> VerificationEvents:
        (logger or logging.getLogger()).addHandler(self)
        return self

    def detach(self, logger: logging.Logger | None = None) -> None:
        (logger or logging.getLogger()).removeHandler(self)


def punished_fields(step: int, loser: Any, role: str, slashed: int | None) -> dict[str, Any]:
    """The fields of a `verification_punished` event (what `VerificationEvents` reads)."""
    return {"step": step, "loser": str(loser), "role": role, "slashed": slashed}


__all__ = [
    "MISMATCHES_KEY",
    "PUNISHED_KEY",
    "VERIFIED_KEY",
    "Punished",
    "VerificationEvents",
    "VerificationSummary",
    "VerificationTally",
    "Verified",
    "punished_fields",
]
