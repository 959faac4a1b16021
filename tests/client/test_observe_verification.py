"""What a person and a tracker see of verification (issue 27): the findings a verifier logs
(`psyche.client.round.verify`'s own logging) and a punishment reach a real tracker (the
`--metrics-jsonl` file, read back) with the round they are reported in, and the progress line
says them compactly; a round without verification logs no verification keys."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from psyche.client.observe.logs import log_event
from psyche.client.observe.stats import progress_text
from psyche.client.observe.telemetry import TrackerObserver, client_tracker
from psyche.client.observe.verification import (
    MISMATCHES_KEY,
    PUNISHED_KEY,
    VERIFIED_KEY,
    VerificationEvents,
    VerificationTally,
    punished_fields,
)
from psyche.client.round.verify import VerifyJob, _log_finding
from psyche.coordinator.verification import VerificationDuty
from psyche.core.batch_id import BatchId
from psyche.core.node_identity import NodeIdentity
from psyche.metrics import TrackerConfig

from .support import round_report

HONEST = NodeIdentity(bytes([1]) * 32, bytes(32))
HOSTILE = NodeIdentity(bytes([2]) * 32, bytes(32))
ME = NodeIdentity(bytes([3]) * 32, bytes(32))


def _job(step: int, duties: list[VerificationDuty]) -> VerifyJob:
    return VerifyJob(step, tuple(duties), {d.batch_id: d.batch_id for d in duties}, False, None)


def test_findings_and_a_punishment_reach_the_tracker_and_the_progress_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)  # the client's level (`setup_logging`)
    path = tmp_path / "metrics.jsonl"
    tracker = client_tracker(TrackerConfig(metrics_jsonl=path), ME, "psyche-client", run_id="r")
    observer = TrackerObserver(tracker)
    honest = VerificationDuty(BatchId(0, 3), HONEST, ME)
    hostile = VerificationDuty(BatchId(4, 7), HOSTILE, ME)
    try:
        # Round 2: nothing verified yet.
        observer.on_round(round_report(step=2))
        # What the verifier logs of round 2 (the real logging of round/verify.py), and the
        # punishment a backend logs.
        job = _job(2, [honest, hostile])
        _log_finding(job, honest, True, 2.5, "t 2.5")
        _log_finding(job, hostile, False, 48.0, "t 48")
        log_event(
            logging.getLogger("psyche.solana.app"),
            "verification_punished",
            logging.WARNING,
            **punished_fields(2, HOSTILE, "trainer", 10),
        )
        # A finding about a later round waits for that round's report.
        _log_finding(_job(4, [honest]), honest, True, 1.0, "t 1")
        observer.on_round(round_report(step=3))
        observer.on_round(round_report(step=4))
    finally:
        observer.on_finished({})
        tracker.finish()
    docs = [doc for doc in map(json.loads, path.read_text().splitlines()) if doc["kind"] == "log"]
    lines = {doc["step"]: doc["values"] for doc in docs}
    assert VERIFIED_KEY not in str(lines[2])
    third = lines[3]
    assert third[VERIFIED_KEY] == 2
    assert third[MISMATCHES_KEY] == 1
    assert third[PUNISHED_KEY] == 1
    fourth = lines[4]
    assert fourth[VERIFIED_KEY] == 1
    assert fourth[MISMATCHES_KEY] == 0
    assert fourth[PUNISHED_KEY] == 0

    # The observer stopped listening at the run's end.
    assert not any(isinstance(h, VerificationEvents) for h in logging.getLogger().handlers)


def test_the_progress_line_says_who_was_verified_found_and_punished(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    tally = VerificationTally()
    events = VerificationEvents(tally).attach()
    try:
        duty = VerificationDuty(BatchId(4, 7), HOSTILE, ME)
        _log_finding(_job(5, [duty]), duty, False, 48.0, "t 48")
        log_event(
            logging.getLogger("psyche.solana.app"),
            "verification_punished",
            **punished_fields(5, HOSTILE, "trainer", 10),
        )
    finally:
        events.detach()
    summary = tally.take(5)
    line = progress_text(5, 10, 0, 2.5, None, None, verification=summary.text())
    assert line == (
        f"step 5/10 (epoch 0): loss 2.5000; verified 1 (1 mismatch: {HOSTILE} B[4, 7]), "
        f"punished {HOSTILE} (trainer, slashed 10)"
    )
    # Taken once: the next round's line says nothing of it.
    assert not tally.take(6)
    assert progress_text(6, 10, 0, 2.5, None, None, verification=tally.take(6).text()) == (
        "step 6/10 (epoch 0): loss 2.5000"
    )


def test_the_tally_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    tally = VerificationTally(limit=8)
    events = VerificationEvents(tally).attach()
    try:
        duty = VerificationDuty(BatchId(0, 0), HONEST, ME)
        for step in range(100):
            _log_finding(_job(step, [duty]), duty, True, 1.0, "")
    finally:
        events.detach()
    assert len(tally.verified) == 8
    assert tally.take(1000).metrics()[VERIFIED_KEY] == 8


def test_a_verifiers_own_report_reaches_its_progress_line() -> None:
    """What `StepStateMachine` keeps of the report it sent (`VerificationTally.add_report`): each
    finding with the trainer its duty names, said by the progress line of a later step."""
    from psyche.coordinator.verification import Finding, VerificationReport

    tally = VerificationTally()
    honest = VerificationDuty(BatchId(0, 3), HONEST, ME)
    hostile = VerificationDuty(BatchId(4, 7), HOSTILE, ME)
    report = VerificationReport(
        5, [Finding(honest.batch_id, True, 30.0), Finding(hostile.batch_id, False, -40.0)]
    )
    tally.add_report(_job(5, [honest, hostile]), report)
    assert tally.take(4).text() == ""  # a line of an earlier step says nothing of round 5
    line = progress_text(6, 100, 0, 2.5, None, None, verification=tally.take(6).text())
    assert line.endswith(f"; verified 2 (1 mismatch: {HOSTILE} B[4, 7])"), line
    assert not tally.take(6)  # said once
