"""Verifying clients with real keys, as the coordinator's verification tests drive them: their
identities and keys, what each checks in a round (its draw, signed with its own key), and a report
of its findings (`report`)."""

from __future__ import annotations

from psyche.coordinator.testing import keyed_identity, simulated_key
from psyche.coordinator.verification import (
    Finding,
    RoundDuties,
    VerificationDuty,
    VerificationReport,
)
from psyche.core import BatchId, NodeIdentity
from psyche.core.identity import SecretKey

KEYS = {keyed_identity(i).signer: simulated_key(i) for i in range(64)}


def ids(n: int) -> list[NodeIdentity]:
    """Identities with real keys (a verifier signs its draw)."""
    return [keyed_identity(i) for i in range(n)]


def key_of(node: NodeIdentity) -> SecretKey:
    return KEYS[node.signer]


def checked_by(duties: RoundDuties, node: NodeIdentity) -> list[VerificationDuty]:
    """What `node` checks in the round (a verifier: its draw, signed with its own key)."""
    checks = duties.checks(node, key_of(node).sign)
    assert checks is not None
    return checks[0]


def report(
    duties: RoundDuties,
    sender: NodeIdentity,
    wrong: set[BatchId],
    score: float = 0.5,
    only: set[BatchId] | None = None,
) -> VerificationReport:
    """`sender`'s findings on what it checks (`only` those batches: a tie-breaker's disputed),
    with its draw."""
    checks = duties.checks(sender, key_of(sender).sign)
    assert checks is not None
    return VerificationReport(
        duties.step,
        [
            Finding(d.batch_id, d.batch_id not in wrong, score if d.batch_id in wrong else 0.0)
            for d in checks[0]
            if only is None or d.batch_id in only
        ],
        checks[1],
    )
