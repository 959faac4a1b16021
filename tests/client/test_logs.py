"""What a person reads on the console and what tools read in JSON lines: an event's `text`
replaces its fields on the console only, `quiet` events reach the console only at DEBUG, and the
per-step progress line (step N of M, loss or "no batch this round", tokens/s, time left)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from psyche.client.observe.logs import ConsoleFormatter, JsonFormatter, QuietEventFilter, log_event
from psyche.client.observe.stats import RunProgress, format_duration, progress_text


@pytest.fixture
def streams() -> Iterator[tuple[logging.Logger, io.StringIO, io.StringIO]]:
    """A logger writing to a console-format stream (with the quiet filter) and a JSON one."""
    logger = logging.getLogger("psyche.test_logs")
    console, lines = io.StringIO(), io.StringIO()
    human = logging.StreamHandler(console)
    human.setFormatter(ConsoleFormatter())
    human.addFilter(QuietEventFilter())
    machine = logging.StreamHandler(lines)
    machine.setFormatter(JsonFormatter())
    logger.addHandler(human)
    logger.addHandler(machine)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield logger, console, lines
    finally:
        logger.removeHandler(human)
        logger.removeHandler(machine)
        logger.propagate = True
        logger.setLevel(logging.NOTSET)


def json_lines(stream: io.StringIO) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_text_replaces_the_fields_on_the_console_only(streams) -> None:  # type: ignore[no-untyped-def]
    logger, console, lines = streams
    log_event(logger, "client_loss", text="step 3/10 (epoch 0): loss 5.0000", step=3, loss=5.0)
    log_event(logger, "plain_event", step=4, ids=[1, 2])
    shown = console.getvalue().splitlines()
    assert shown[0].endswith("psyche.test_logs: step 3/10 (epoch 0): loss 5.0000")
    assert "step=3" not in shown[0]
    assert shown[1].endswith("psyche.test_logs: plain_event step=4 ids=[1,2]")
    first, second = json_lines(lines)
    assert first["message"] == "client_loss"
    assert first["step"] == 3
    assert first["loss"] == 5.0
    assert "text" not in first
    assert "psyche_text" not in first
    assert second["message"] == "plain_event"
    assert second["ids"] == [1, 2]


def test_quiet_events_reach_the_console_only_at_debug(streams) -> None:  # type: ignore[no-untyped-def]
    logger, console, lines = streams
    log_event(logger, "round_start", quiet=True, step=1)
    log_event(logger, "state_change", step=1)
    assert "round_start" not in console.getvalue()
    assert "state_change" in console.getvalue()
    assert [e["message"] for e in json_lines(lines)] == ["round_start", "state_change"]
    logger.setLevel(logging.DEBUG)
    log_event(logger, "round_start", quiet=True, step=2)
    assert "round_start step=2" in console.getvalue()


def test_progress_line_and_no_batch_rounds() -> None:
    assert progress_text(12, 200, 0, 5.65071, 1229.4, 500.0) == (
        "step 12/200 (epoch 0): loss 5.6507, 1,229 tok/s, about 8m20s left"
    )
    assert (
        progress_text(24, 200, 1, None, None, None) == "step 24/200 (epoch 1): no batch this round"
    )


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (59.4, "59s"), (59.6, "1m00s"), (60, "1m00s"), (3599, "59m59s"), (3600, "1h00m"),
     (7530, "2h05m")],
)  # fmt: skip
def test_durations(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_time_left_follows_the_recent_step_rate() -> None:
    progress = RunProgress(window=3)
    assert progress.seconds_left(1, 10) is None
    assert progress.tokens_per_second() is None
    progress.record(1, 100.0, 512)
    assert progress.seconds_left(1, 10) is None  # one step: no rate yet
    progress.record(2, 102.0, 512)
    assert progress.seconds_left(2, 10) == pytest.approx(16.0)  # 8 steps at 2 s
    progress.record(3, 104.0, 512)
    progress.record(4, 116.0, 512)  # an epoch boundary: the window (3 steps) now holds it
    assert progress.seconds_per_step() == pytest.approx(7.0)  # (116 - 102) / 2
    assert progress.seconds_left(4, 10) == pytest.approx(42.0)
    assert progress.seconds_left(12, 10) == 0.0  # past the end never goes negative
    # the run's tokens/s counts every step after the first over the whole time
    assert progress.tokens_per_second() == pytest.approx(3 * 512 / 16.0)
