"""What the chaos tests with a hostile member check of its work (test_chaos_short.py,
test_hostile_peer.py)."""

from __future__ import annotations

from typing import Any


def offenders_batches_refused(events: list[dict[str, Any]], offender: str) -> int:
    """How many batches `offender` (a short id) was assigned in rounds an honest client applied,
    by that client's `events`; asserts that none of those batches was applied."""
    from metrics import of

    applied = {e["step"]: set(e["batches"]) for e in of(events, "applied_results")}
    offered = 0
    for e in of(events, "round_start"):
        for assignment in e["assignments"]:
            batch, _, owner = assignment.rpartition("=")
            if owner == offender and e["step"] + 2 in applied:
                offered += 1
                assert batch not in applied[e["step"] + 2], (e["step"], batch)
    return offered
