"""The trackers with their real libraries, offline or on loopback, read back with readers
independent of the writers: W&B's offline run file parsed record by record (its LevelDB-log
framing checked, each record decoded with W&B's own protobufs), TensorBoard event files read
with TensorBoard's `EventAccumulator` (written by tensorboardX), the JSONL file, and OTLP/HTTP
metrics, traces and logs posted to a collector the test runs on 127.0.0.1 and decoded with
`opentelemetry-proto`. Several trackers at once get the same values; one that fails stops
alone."""

from __future__ import annotations

import gzip
import json
import logging
import struct
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from psyche.metrics import ServiceInfo, TrackerConfig, build_tracker, names

pytestmark = pytest.mark.timeout(180)

SERVICE = ServiceInfo(
    name="psyche-centralized-client", instance_id="node-1", run_id="run-1", scope="psyche_client"
)
FINISH = 60.0  # finish's bound: generous for a busy machine, never reached when all is well

# What a client logs over a few steps: upstream's keys, an eval, a running byte total, a string.
STEPS = [
    {
        names.TRAIN_LOSS: 3.0 - 0.25 * i,
        names.TRAIN_LR: 1e-4 * (i + 1),
        names.TRAIN_TOKENS_PER_SEC: 1000.0 + i,
        names.COORDINATOR_EPOCH: 0,
        names.eval_key("ARC-Easy"): 0.25 + 0.125 * i,
        names.P2P_DOWNLOAD_BYTES: 1000 * (i + 1),
        names.COORDINATOR_RUN_STATE: "RoundTrain",
    }
    for i in range(4)
]
NUMERIC_KEYS = [k for k, v in STEPS[0].items() if not isinstance(v, str)]
SUMMARY = {names.TRAIN_LOSS: 2.0, "train/steps": 4}


@pytest.fixture(autouse=True)
def _wandb_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B keeps settings and caches under the home directory: keep them in the test's."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(var, raising=False)


def log_steps(tracker: Any) -> None:
    for step, values in enumerate(STEPS, start=1):
        tracker.log(values, step=step)
    tracker.log_summary(SUMMARY)


# ---- W&B's offline run file ------------------------------------------------------------------

_WANDB_BLOCK = 32 * 1024
_WANDB_HEADER = struct.Struct("<IHB")  # crc32, length, record type (LevelDB log framing)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterator[Any]:
    """Every record of a `.wandb` transaction log: a 7-byte file header (`:W&B`, magic 0xBEE1,
    version 0), then LevelDB-log framed protobuf `Record`s in 32 KiB blocks, each chunk's CRC
    (zlib's crc32 seeded with its type byte) checked."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    pos, pending = 7, b""
    while pos + _WANDB_HEADER.size <= len(data):
        left = _WANDB_BLOCK - pos % _WANDB_BLOCK
        if left < _WANDB_HEADER.size:  # block trailer: zero padding
            pos += left
            continue
        crc, length, kind = _WANDB_HEADER.unpack_from(data, pos)
        if kind == 0 and length == 0:
            break
        chunk = data[pos + _WANDB_HEADER.size : pos + _WANDB_HEADER.size + length]
        assert crc == zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF
        pos += _WANDB_HEADER.size + length
        if kind == _FULL:
            whole = chunk
        elif kind == _FIRST:
            pending = chunk
            continue
        elif kind == _MIDDLE:
            pending += chunk
            continue
        else:
            assert kind == _LAST
            whole, pending = pending + chunk, b""
        record = wandb_internal_pb2.Record()
        record.ParseFromString(whole)
        yield record


def wandb_offline_run(wandb_dir: Path) -> dict[str, Any]:
    """History rows by step, the run record, config and summary of the one offline run."""
    files = list(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    history: dict[int, dict[str, Any]] = {}
    run: Any = None
    summary: dict[str, Any] = {}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history[row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "run":
            run = record.run
        elif kind == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    assert run is not None
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    return {"history": history, "run": run, "config": config, "summary": summary}


# ---- TensorBoard -----------------------------------------------------------------------------


def tensorboard_scalars(logdir: Path) -> tuple[dict[str, dict[int, float]], dict[str, str]]:
    """Scalars by tag and step, and the text summaries' last values, read by TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    scalars = {
        tag: {event.step: event.value for event in accumulator.Scalars(tag)}
        for tag in accumulator.Tags()["scalars"]
    }
    texts = {}
    for tag in accumulator.Tags()["tensors"]:
        events = accumulator.Tensors(tag)
        texts[tag.removesuffix("/text_summary")] = events[-1].tensor_proto.string_val[0].decode()
    return scalars, texts


# ---- a local OTLP/HTTP collector -------------------------------------------------------------


class Collector:
    """An OTLP/HTTP receiver on 127.0.0.1: keeps each decoded request with its headers, answers
    `status` (200 with an empty response message by default). Bodies are capped and idle
    connections time out, as any listening socket of the project."""

    MAX_BODY = 8 << 20

    def __init__(self, status: int = 200) -> None:
        from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.status = status
        self.requests: dict[str, list[Any]] = {"metrics": [], "traces": [], "logs": []}
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()
        kinds = {
            "/v1/metrics": ("metrics", metrics_service_pb2.ExportMetricsServiceRequest),
            "/v1/traces": ("traces", trace_service_pb2.ExportTraceServiceRequest),
            "/v1/logs": ("logs", logs_service_pb2.ExportLogsServiceRequest),
        }
        responses = {
            "metrics": metrics_service_pb2.ExportMetricsServiceResponse(),
            "traces": trace_service_pb2.ExportTraceServiceResponse(),
            "logs": logs_service_pb2.ExportLogsServiceResponse(),
        }
        collector = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 10

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                if length > Collector.MAX_BODY or self.path not in kinds:
                    self.send_error(413 if length > Collector.MAX_BODY else 404)
                    return
                body = self.rfile.read(length)
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                kind, message_type = kinds[self.path]
                message = message_type()
                message.ParseFromString(body)
                with collector._lock:
                    collector.requests[kind].append(message)
                    collector.headers.append({k.lower(): v for k, v in self.headers.items()})
                payload = responses[kind].SerializeToString()
                self.send_response(collector.status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def config(self, **overrides: Any) -> TrackerConfig:
        values: dict[str, Any] = {
            "oltp_metrics_url": f"{self.url}/v1/metrics",
            "oltp_tracing_url": f"{self.url}/v1/traces",
            "oltp_logs_url": f"{self.url}/v1/logs",
            "oltp_auth_header": "Bearer test-token",
            "oltp_report_interval": 3600.0,  # only the export at finish
        }
        values.update(overrides)
        return TrackerConfig(**values)

    # decoded views

    def resources(self, kind: str) -> list[dict[str, str]]:
        field = {"metrics": "resource_metrics", "traces": "resource_spans", "logs": "resource_logs"}
        return [
            {a.key: a.value.string_value for a in rs.resource.attributes}
            for request in self.requests[kind]
            for rs in getattr(request, field[kind])
        ]

    def metric_points(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]:
        """Every data point's value by (metric name, attributes), in export order."""
        out: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = {}
        for request in self.requests["metrics"]:
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    assert sm.scope.name == SERVICE.scope
                    for metric in sm.metrics:
                        data = metric.WhichOneof("data")
                        points = getattr(metric, data).data_points
                        for p in points:
                            attrs = tuple(
                                sorted((a.key, a.value.string_value) for a in p.attributes)
                            )
                            value = (
                                p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
                            )
                            out.setdefault((metric.name, attrs), []).append(value)
        return out

    def spans(self) -> list[Any]:
        return [
            span
            for request in self.requests["traces"]
            for rs in request.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]

    def log_records(self) -> list[Any]:
        return [
            record
            for request in self.requests["logs"]
            for rl in request.resource_logs
            for sl in rl.scope_logs
            for record in sl.log_records
        ]


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.close()


def attribute_values(attributes: Any) -> dict[str, Any]:
    out = {}
    for a in attributes:
        kind = a.value.WhichOneof("value")
        out[a.key] = getattr(a.value, kind)
    return out


# ---- each tracker ----------------------------------------------------------------------------


def test_wandb_offline_run_directory_reads_back(tmp_path: Path) -> None:
    tracker = build_tracker(
        TrackerConfig(wandb_project="psyche-test", wandb_group="group-1", wandb_dir=tmp_path),
        service=SERVICE,
        run_name="run-1-node-1",
        run_config={"total_steps": 4, "run_id": "run-1"},
        env={"WANDB_MODE": "offline"},  # no key, no network
    )
    log_steps(tracker)
    tracker.finish(FINISH)
    run = wandb_offline_run(tmp_path)
    assert (run["run"].project, run["run"].run_group, run["run"].display_name) == (
        "psyche-test",
        "group-1",
        "run-1-node-1",
    )
    assert run["config"]["total_steps"] == 4
    assert run["config"]["run_id"] == "run-1"
    assert run["history"] == {step: values for step, values in enumerate(STEPS, start=1)}
    assert run["summary"]["train/loss"] == 2.0
    assert run["summary"]["train/steps"] == 4


def test_tensorboard_event_files_read_back(tmp_path: Path) -> None:
    logdir = tmp_path / "tb"
    tracker = build_tracker(
        TrackerConfig(tensorboard_dir=logdir),
        service=SERVICE,
        run_name="r",
        run_config={"total_steps": 4},
        env={},
    )
    log_steps(tracker)
    tracker.finish(FINISH)
    scalars, texts = tensorboard_scalars(logdir)
    for key in NUMERIC_KEYS:
        expected = {step: float(values[key]) for step, values in enumerate(STEPS, start=1)}
        assert scalars[key] == pytest.approx(expected, rel=1e-6)  # stored as float32
    assert scalars["summary/train/loss"] == {4: 2.0}
    assert texts[names.COORDINATOR_RUN_STATE] == "RoundTrain"
    assert json.loads(texts["config"]) == {"total_steps": 4}


def test_otel_metrics_traces_and_logs_reach_a_collector(collector: Collector) -> None:
    tracker = build_tracker(collector.config(), service=SERVICE, run_name="r", env={})
    log_steps(tracker)
    logging.getLogger("psyche.test_metrics").warning("hello %s", "collector")
    logging.getLogger("elsewhere").warning("not a psyche logger")
    tracker.finish(FINISH)

    # every post carries the auth header and upstream's resource attributes
    assert collector.headers
    assert all(h.get("authorization") == "Bearer test-token" for h in collector.headers)
    for kind in ("metrics", "traces", "logs"):
        assert collector.resources(kind), kind
        assert all(r == SERVICE.attributes() for r in collector.resources(kind)), kind

    # metrics: upstream's instruments, the last value of each gauge, the counter's total
    points = collector.metric_points()
    last = {key: values[-1] for key, values in points.items()}
    assert last[("psyche_training_loss", ())] == STEPS[-1][names.TRAIN_LOSS] == 2.25
    assert last[("psyche_learning_rate", ())] == pytest.approx(4e-4)
    assert last[("psyche_tokens_per_second", ())] == 1003.0
    assert last[("psyche_coordinator_epoch", ())] == 0
    assert last[("psyche_eval_metrics", (("metric", "arc_easy"),))] == 0.625
    assert last[("psyche_download_bytes", ())] == 4000  # cumulative sum of the increments
    assert last[("psyche_round_step", ())] == 4  # the step of the last log call
    assert all(not name.endswith("run_state") for name, _ in points)  # strings are not metrics

    # traces: one span per step, from one log call to the next, values as attributes
    spans = [s for s in collector.spans() if s.name == "step"]
    assert [attribute_values(s.attributes)["step"] for s in spans] == [1, 2, 3, 4]
    for span, values in zip(spans, STEPS, strict=True):
        attributes = attribute_values(span.attributes)
        assert attributes[names.TRAIN_LOSS] == values[names.TRAIN_LOSS]
        assert attributes[names.COORDINATOR_RUN_STATE] == "RoundTrain"
        assert span.start_time_unix_nano <= span.end_time_unix_nano
    assert [s.name for s in collector.spans()].count("summary") == 1

    # logs: the psyche loggers' records, not other loggers'
    bodies = {r.body.string_value: r for r in collector.log_records()}
    assert "hello collector" in bodies
    assert "not a psyche logger" not in bodies
    assert bodies["hello collector"].severity_text == "WARN"
    assert bodies["hello collector"].severity_number == 13


def test_otel_export_failure_switches_that_export_off_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="psyche.metrics")
    refusing = Collector(status=400)  # not retried by the exporter
    try:
        config = refusing.config(
            oltp_tracing_url=None, oltp_logs_url=None, oltp_report_interval=0.05
        )
        tracker = build_tracker(config, service=SERVICE, run_name="r", env={})
        for step in range(1, 50):
            tracker.log({names.TRAIN_LOSS: 1.0}, step=step)
        tracker.finish(FINISH)
        warnings = [
            r.getMessage()
            for r in caplog.records
            if r.name.startswith("psyche.metrics") and "OpenTelemetry" in r.getMessage()
        ]
        assert warnings == [
            f"OpenTelemetry metrics export to {refusing.url}/v1/metrics failed; "
            "metrics export is off for the rest of the run"
        ]
        assert len(refusing.requests["metrics"]) == 1  # nothing sent after the failure
    finally:
        refusing.close()


# ---- all at once -----------------------------------------------------------------------------


class BrokenSink:
    """A tracker that fails on its second write."""

    name = "broken"

    def __init__(self) -> None:
        self.writes = 0

    def open(self) -> None:
        pass

    def write(self, metrics: Any, step: int, timestamp: float) -> None:
        self.writes += 1
        if self.writes == 2:
            raise OSError("the tracker's disk is full")

    def write_summary(self, metrics: Any, timestamp: float) -> None:
        pass

    def close(self, timeout: float) -> None:
        pass


def test_every_tracker_at_once_gets_the_same_values_and_a_broken_one_stops_alone(
    tmp_path: Path, collector: Collector, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="psyche.metrics")
    config = collector.config(
        oltp_tracing_url=None,
        oltp_logs_url=None,
        wandb_project="psyche-test",
        wandb_dir=tmp_path,
        tensorboard_dir=tmp_path / "tb",
        metrics_jsonl=tmp_path / "metrics.jsonl",
    )
    broken = BrokenSink()
    tracker = build_tracker(
        config,
        service=SERVICE,
        run_name="all",
        env={"WANDB_MODE": "offline"},
        extra_sinks=[broken],
    )
    log_steps(tracker)
    tracker.finish(FINISH)

    expected = {step: values for step, values in enumerate(STEPS, start=1)}
    # W&B
    assert wandb_offline_run(tmp_path)["history"] == expected
    # TensorBoard
    scalars, texts = tensorboard_scalars(tmp_path / "tb")
    for key in NUMERIC_KEYS:
        assert scalars[key] == pytest.approx(
            {step: float(values[key]) for step, values in expected.items()}, rel=1e-6
        )
    assert texts[names.COORDINATOR_RUN_STATE] == "RoundTrain"
    # JSONL
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {line["step"]: line["values"] for line in lines if line["kind"] == "log"} == expected
    # OpenTelemetry: the last step's values
    last = {name: values[-1] for (name, _), values in collector.metric_points().items()}
    assert last["psyche_training_loss"] == STEPS[-1][names.TRAIN_LOSS]
    assert last["psyche_download_bytes"] == STEPS[-1][names.P2P_DOWNLOAD_BYTES]
    # the broken one: stopped at its failure, one warning
    assert broken.writes == 2
    assert [r.getMessage() for r in caplog.records if "tracker broken" in r.getMessage()] == [
        "tracker broken failed and is off for the rest of the run: "
        "OSError: the tracker's disk is full"
    ]
