"""psyche.metrics without third-party trackers: the threaded sink's guarantees (never
blocks the caller, drops with a counted warning, a failing sink is switched off with one
warning, a bounded finish), the composite, the JSONL file read back, upstream's W&B rule and
the settings' checks, the missing-extra error and the OpenTelemetry names."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import threading
import time
from pathlib import Path

import pytest

from psyche.core.cli import UserError
from psyche.metrics import (
    CompositeTracker,
    JsonlSink,
    MissingExtraError,
    NoopTracker,
    ServiceInfo,
    ThreadedTracker,
    Tracker,
    TrackerConfig,
    TrackerConfigError,
    build_tracker,
    names,
    wandb_info,
)
from psyche.metrics.names import otel_instrument

pytestmark = pytest.mark.timeout(120)

SERVICE = ServiceInfo(name="psyche-test", instance_id="test-node", run_id="run")
WAIT = 30.0  # generous deadline for events on a busy machine; never a threshold


class RecordingSink:
    """Keeps what it is given; `gate` (when set up) holds each write until released."""

    def __init__(self, name: str = "recording", gate: threading.Event | None = None) -> None:
        self.name = name
        self.gate = gate
        self.writing = threading.Event()
        self.opened = False
        self.closed = False
        self.logs: list[tuple[dict, int]] = []
        self.summaries: list[dict] = []

    def open(self) -> None:
        self.opened = True

    def write(self, metrics, step, timestamp) -> None:
        self.writing.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT)
        self.logs.append((metrics, step))

    def write_summary(self, metrics, timestamp) -> None:
        self.summaries.append(metrics)

    def close(self, timeout) -> None:
        self.closed = True


class FailingSink(RecordingSink):
    def __init__(self, fail_at_write: int | None = None, fail_open: bool = False) -> None:
        super().__init__("failing")
        self.fail_at_write = fail_at_write
        self.fail_open = fail_open

    def open(self) -> None:
        if self.fail_open:
            raise ConnectionError("no route to the tracker's server")

    def write(self, metrics, step, timestamp) -> None:
        if len(self.logs) + 1 == self.fail_at_write:
            raise OSError("disk full")
        super().write(metrics, step, timestamp)


def warnings_with(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and text in r.getMessage()
    ]


def steps(n: int) -> list[dict]:
    return [{"train/loss": 3.0 - i / 10, "train/lr": 1e-3 * (i + 1)} for i in range(n)]


# ---- ThreadedTracker -----------------------------------------------------------------------


def test_threaded_tracker_writes_everything_in_order_and_closes() -> None:
    sink = RecordingSink()
    tracker = ThreadedTracker(sink)
    for i, values in enumerate(steps(20)):
        tracker.log(values, step=i)
    tracker.log_summary({"train/loss": 1.0})
    tracker.finish()
    assert sink.opened
    assert sink.closed
    assert sink.logs == [(values, i) for i, values in enumerate(steps(20))]
    assert sink.summaries == [{"train/loss": 1.0}]
    assert tracker.written == 21
    assert tracker.dropped == 0


def test_log_copies_the_callers_dictionary() -> None:
    sink = RecordingSink()
    tracker = ThreadedTracker(sink)
    values = {"train/loss": 1.0}
    tracker.log(values, step=0)
    values["train/loss"] = 99.0
    tracker.finish()
    assert sink.logs == [({"train/loss": 1.0}, 0)]


def test_full_queue_drops_with_one_counted_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="psyche.metrics")
    gate = threading.Event()
    sink = RecordingSink(gate=gate)
    tracker = ThreadedTracker(sink, queue_size=4, drop_warning_interval=3600)
    try:
        tracker.log({"x": 0}, step=0)
        assert sink.writing.wait(WAIT)  # the worker holds step 0; the queue is empty again
        for step in range(1, 11):
            tracker.log({"x": step}, step=step)  # returns at once although the sink is stuck
        assert tracker.dropped == 6  # steps 1-4 queued, 5-10 dropped
        assert len(warnings_with(caplog, "dropping what is logged")) == 1
        assert "first dropped: step 5" in warnings_with(caplog, "dropping")[0]
    finally:
        gate.set()
    tracker.finish(WAIT)
    assert [step for _, step in sink.logs] == [0, 1, 2, 3, 4]
    assert warnings_with(caplog, "dropped 6 entries in all")


def test_drops_are_reported_again_after_the_interval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="psyche.metrics")
    gate = threading.Event()
    sink = RecordingSink(gate=gate)
    tracker = ThreadedTracker(sink, queue_size=1, drop_warning_interval=0.0)
    try:
        tracker.log({"x": 0}, step=0)
        assert sink.writing.wait(WAIT)
        for step in range(1, 5):
            tracker.log({"x": step}, step=step)
    finally:
        gate.set()
    tracker.finish(WAIT)
    assert tracker.dropped == 3
    assert len(warnings_with(caplog, "dropping what is logged")) == 1
    assert warnings_with(caplog, "dropped 1 more entries (3 in all)")


def test_a_sink_that_fails_is_switched_off_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="psyche.metrics")
    sink = FailingSink(fail_at_write=3)
    tracker = ThreadedTracker(sink)
    for i, values in enumerate(steps(10)):
        tracker.log(values, step=i)
    tracker.finish(WAIT)
    assert tracker.failed
    assert [step for _, step in sink.logs] == [0, 1]
    messages = warnings_with(caplog, "tracker failing")
    assert len(messages) == 1
    assert "failed and is off for the rest of the run: OSError: disk full" in messages[0]
    assert sink.closed  # closed after the failure


def test_a_sink_that_cannot_start_is_switched_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="psyche.metrics")
    sink = FailingSink(fail_open=True)
    tracker = ThreadedTracker(sink)
    deadline = time.monotonic() + WAIT
    while not tracker.failed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tracker.failed
    for i, values in enumerate(steps(3)):
        tracker.log(values, step=i)  # ignored
    tracker.finish(WAIT)
    assert sink.logs == []
    messages = warnings_with(caplog, "tracker failing")
    assert messages == [
        "tracker failing could not start and is off for the rest of the run: "
        "ConnectionError: no route to the tracker's server"
    ]


def test_finish_returns_within_its_timeout_when_a_sink_hangs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="psyche.metrics")
    gate = threading.Event()  # never set before finish: the sink is stuck in write
    stuck = RecordingSink("stuck", gate=gate)
    healthy = RecordingSink("healthy")
    composite = CompositeTracker([ThreadedTracker(stuck), ThreadedTracker(healthy)])
    try:
        for i, values in enumerate(steps(5)):
            composite.log(values, step=i)
        start = time.monotonic()
        composite.finish(timeout=0.5)
        elapsed = time.monotonic() - start
        assert elapsed < WAIT  # returned: not stuck behind the hung sink
        assert [step for _, step in healthy.logs] == [0, 1, 2, 3, 4]
        assert healthy.closed
        # said by the stuck tracker's own finish, which ends with the composite's deadline
        deadline = time.monotonic() + WAIT
        while not warnings_with(caplog, "tracker stuck did not finish within 0.5 s"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        gate.set()


def test_log_after_finish_is_ignored_and_finish_twice_is_harmless() -> None:
    sink = RecordingSink()
    tracker = ThreadedTracker(sink)
    tracker.log({"x": 1}, step=1)
    tracker.finish()
    tracker.log({"x": 2}, step=2)
    tracker.log_summary({"x": 3})
    tracker.finish()
    assert sink.logs == [({"x": 1}, 1)]
    assert sink.summaries == []


# ---- CompositeTracker ------------------------------------------------------------------------


class RaisingTracker(Tracker):
    def __init__(self) -> None:
        self.calls = 0

    def log(self, metrics, step) -> None:
        self.calls += 1
        raise RuntimeError("bug in a third-party tracker")

    def log_summary(self, metrics) -> None:
        raise RuntimeError("bug in a third-party tracker")

    def finish(self, timeout=None) -> None:
        pass


def test_composite_gives_every_tracker_the_same_values_and_drops_a_raising_one(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.WARNING, logger="psyche.metrics")
    first, second = RecordingSink("first"), RecordingSink("second")
    raising = RaisingTracker()
    jsonl = tmp_path / "metrics.jsonl"
    composite = CompositeTracker(
        [
            ThreadedTracker(first),
            raising,
            ThreadedTracker(JsonlSink(jsonl)),
            ThreadedTracker(second),
        ]
    )
    with composite:
        for i, values in enumerate(steps(8)):
            composite.log(values, step=i)
        composite.log_summary({"train/loss": 2.2})
    expected = [(values, i) for i, values in enumerate(steps(8))]
    assert first.logs == expected
    assert second.logs == expected
    assert first.summaries == second.summaries == [{"train/loss": 2.2}]
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(line["values"], line["step"]) for line in lines if line["kind"] == "log"] == expected
    assert raising.calls == 1  # dropped at its first failure
    assert len(warnings_with(caplog, "tracker RaisingTracker failed")) == 1


# ---- JSONL, through build_tracker ------------------------------------------------------------


def test_jsonl_file_reads_back_with_config_steps_and_summary(tmp_path: Path) -> None:
    path = tmp_path / "out" / "metrics.jsonl"  # the directory is created
    tracker = build_tracker(
        TrackerConfig(metrics_jsonl=path),
        service=SERVICE,
        run_name="run",
        run_config={"total_steps": 3, "run_id": "run"},
        env={},
    )
    before = time.time()
    tracker.log({"train/loss": 2.5, "coordinator/run_state": "RoundTrain", "ok": True}, step=1)
    tracker.log({"train/loss": math.nan, "train/lr": math.inf, "x": -math.inf}, step=2)
    tracker.log_summary({"train/loss": 2.0})
    tracker.finish()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["config", "log", "log", "summary"]
    assert lines[0]["values"] == {"total_steps": 3, "run_id": "run"}
    assert lines[1]["step"] == 1
    assert lines[1]["values"] == {
        "train/loss": 2.5,
        "coordinator/run_state": "RoundTrain",
        "ok": True,
    }
    assert lines[2]["values"] == {"train/loss": "NaN", "train/lr": "Infinity", "x": "-Infinity"}
    assert math.isnan(float(lines[2]["values"]["train/loss"]))
    assert lines[3]["values"] == {"train/loss": 2.0}
    assert "step" not in lines[3]
    assert all(before - 1 <= line["time"] <= time.time() + 1 for line in lines)


def test_jsonl_appends_to_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    for step in (1, 2):
        tracker = build_tracker(
            TrackerConfig(metrics_jsonl=path), service=SERVICE, run_name="r", env={}
        )
        tracker.log({"x": step}, step=step)
        tracker.finish()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_nothing_configured_is_a_noop_tracker() -> None:
    tracker = build_tracker(TrackerConfig(), service=SERVICE, run_name="r", env={})
    assert isinstance(tracker, NoopTracker)
    tracker.log({"x": 1}, step=0)
    tracker.finish()


# ---- the settings ----------------------------------------------------------------------------


def test_wandb_follows_upstreams_rule() -> None:
    flags = TrackerConfig(wandb_project="proj", wandb_group="g")
    # no key, no flag: off
    assert wandb_info(TrackerConfig(), "run-abc", env={}) is None
    # a flag without a key: upstream's error, one line, a UserError
    with pytest.raises(TrackerConfigError) as error:
        wandb_info(flags, "run-abc", env={})
    assert isinstance(error.value, UserError)
    assert str(error.value).startswith(
        "WANDB_API_KEY environment variable must be set for wandb integration"
    )
    # the key alone turns W&B on, with upstream's defaults
    info = wandb_info(TrackerConfig(), "run-abc", env={"WANDB_API_KEY": "k"})
    assert info is not None
    assert (info.project, info.run, info.entity, info.group, info.api_key, info.mode) == (
        "psyche",
        "run-abc",
        None,
        None,
        "k",
        None,
    )
    info = wandb_info(
        TrackerConfig(wandb_project="p", wandb_run="r", wandb_entity="e", wandb_group="g"),
        "run-abc",
        env={"WANDB_API_KEY": "k"},
    )
    assert info is not None
    assert (info.project, info.run, info.entity, info.group) == (
        "p",
        "r",
        "e",
        "g",
    )
    # offline: the flags need no key
    info = wandb_info(flags, "run-abc", env={"WANDB_MODE": "offline"})
    assert info is not None
    assert info.mode == "offline"
    assert info.api_key is None
    info = wandb_info(flags, "run-abc", env={"WANDB_MODE": "dryrun"})
    assert info is not None
    assert info.mode == "offline"
    # disabled: off whatever else is set
    assert wandb_info(flags, "r", env={"WANDB_MODE": "disabled", "WANDB_API_KEY": "k"}) is None
    with pytest.raises(TrackerConfigError, match="WANDB_MODE='ofline' is not a W&B mode"):
        wandb_info(flags, "r", env={"WANDB_MODE": "ofline", "WANDB_API_KEY": "k"})


def test_settings_problems_are_one_user_error() -> None:
    assert TrackerConfig().problems() == []
    config = TrackerConfig(
        oltp_metrics_url="localhost:4318/v1/metrics", oltp_report_interval=0, queue_size=0
    )
    problems = config.problems()
    assert problems == [
        "--oltp-report-interval must be positive, got 0",
        "the tracker queue size must be at least 1, got 0",
        "--oltp-metrics-url must be an http:// or https:// URL, got 'localhost:4318/v1/metrics'",
    ]
    assert TrackerConfig(oltp_auth_header="Basic x").problems() == [
        "--oltp-auth-header was given without any --oltp-*-url"
    ]
    with pytest.raises(TrackerConfigError) as error:
        build_tracker(config, service=SERVICE, run_name="r", env={})
    assert str(error.value) == "; ".join(problems)


def test_config_from_parsed_options() -> None:
    args = argparse.Namespace(
        wandb_project="p",
        wandb_run=None,
        oltp_metrics_url="http://127.0.0.1:4318/v1/metrics",
        oltp_report_interval=5.0,
        run_id="unrelated",
    )
    config = TrackerConfig.from_options(args, metrics_jsonl=Path("m.jsonl"))
    assert config == TrackerConfig(
        wandb_project="p",
        oltp_metrics_url="http://127.0.0.1:4318/v1/metrics",
        oltp_report_interval=5.0,
        metrics_jsonl=Path("m.jsonl"),
    )


@pytest.mark.parametrize(
    ("extra", "module", "config", "env"),
    [
        ("wandb", "wandb", TrackerConfig(wandb_project="p"), {"WANDB_API_KEY": "k"}),
        ("tensorboard", "tensorboardX", TrackerConfig(tensorboard_dir=Path("tb")), {}),
        (
            "otel",
            "opentelemetry.sdk",
            TrackerConfig(oltp_logs_url="http://127.0.0.1:1/v1/logs"),
            {},
        ),
    ],
)
def test_a_missing_extra_is_one_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, extra: str, module: str, config: TrackerConfig, env: dict
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(MissingExtraError) as error:
        build_tracker(config, service=SERVICE, run_name="r", env=env)
    message = str(error.value)
    assert isinstance(error.value, UserError)
    assert "\n" not in message
    assert message.endswith(f"pip install 'psyche-metrics[{extra}]'")
    assert f"needs the '{extra}' extra" in message


def test_service_info_is_upstreams_resource() -> None:
    info = ServiceInfo.from_env(
        "psyche-centralized-client", "abc", run_id="r1", env={"DEPLOYMENT_ENV": "prod"}
    )
    assert info.attributes() == {
        "service.name": "psyche-centralized-client",
        "service.instance.id": "abc",
        "service.namespace": "psyche",
        "deployment.environment.name": "prod",
        "run.id": "r1",
    }
    assert ServiceInfo.from_env("s", "server", env={}).attributes()["run.id"] == ""
    assert ServiceInfo.from_env("s", "server", env={}).deployment_environment == "development"


# ---- names -----------------------------------------------------------------------------------


def test_otel_names_are_upstreams() -> None:
    assert otel_instrument(names.TRAIN_LOSS).name == "psyche_training_loss"
    assert otel_instrument(names.TRAIN_PERPLEXITY).name == "psyche_training_perplexity"
    assert otel_instrument(names.TRAIN_CONFIDENCE).name == "psyche_training_confidence"
    assert otel_instrument(names.TRAIN_LR).name == "psyche_learning_rate"
    assert otel_instrument(names.TRAIN_TOTAL_TOKENS).name == "psyche_total_tokens"
    assert otel_instrument(names.TRAIN_TOKENS_PER_SEC).name == "psyche_tokens_per_second"
    assert otel_instrument(names.TRAIN_GLOBAL_TOKEN_BATCH_SIZE).name == "psyche_token_batch_size"
    assert otel_instrument(names.TRAIN_EFFICIENCY).name == "psyche_training_efficiency"
    assert otel_instrument(names.ROUND_TRAIN_SECONDS).name == "psyche_last_train_time_seconds"
    peers = otel_instrument(names.P2P_PEERS)
    assert (peers.name, peers.attributes) == (
        "psyche_peer_connections",
        {"connection_type": "selected"},
    )
    downloaded = otel_instrument(names.P2P_DOWNLOAD_BYTES)
    assert (downloaded.name, downloaded.kind) == ("psyche_download_bytes", "counter")
    arc = otel_instrument(names.eval_key("ARC-Easy"))
    assert (arc.name, arc.attributes) == ("psyche_eval_metrics", {"metric": "arc_easy"})
    stat = otel_instrument("optim/grad_norm")
    assert (stat.name, stat.attributes) == ("psyche_optimizer_stats", {"stat": "grad_norm"})
    other = otel_instrument(names.COORDINATOR_NUM_CLIENTS)
    assert (other.name, other.kind) == ("psyche_coordinator_num_clients", "gauge")
    assert names.TRAIN_EFFICIENCY == "train/efficency"  # upstream's spelling, on purpose
    assert names.eval_key("MMLU Pro (5-shot)") == "eval/mmlu_pro__5_shot_"
