"""OpenTelemetry over OTLP/HTTP (the `otel` extra): metrics, traces and logs, each to its own
URL, as upstream's `--oltp-metrics-url`, `--oltp-tracing-url` and `--oltp-logs-url`.

* **Metrics**: every number logged is recorded on upstream's instrument for its key
  (`psyche.metrics.names.otel_instrument`: `train/loss` -> gauge `psyche_training_loss`),
  and the step on `psyche_round_step`; a periodic reader exports them every
  `--oltp-report-interval` seconds (cumulative temporality, upstream's default).
* **Traces**: one span `step` per logged step, from the previous `log` call to this one, with
  the step and every value logged as attributes (upstream's spans come from its `tracing`
  instrumentation; this is the port's equivalent at the granularity it logs), and one span
  `summary` per `log_summary`, its values as attributes (not recorded on the gauges).
* **Logs**: the command's log records (the `psyche` loggers, at their configured level) are
  sent as OTLP log records while the tracker is open.

Every request carries `--oltp-auth-header` as its `authorization` header, and every signal
carries upstream's resource attributes (`ServiceInfo`). The OpenTelemetry SDK exports from its
own threads (a periodic reader, batch processors with bounded queues), so nothing here waits on
the network on the caller's thread. An export that fails (after the exporter's own retries,
bounded by `EXPORT_TIMEOUT`) switches that signal's export off for the rest of the run, with one
warning naming the URL: a collector that is not there costs nothing more.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from enum import Enum
from typing import Any, ClassVar, TypeVar, cast

from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, LogRecordExportResult
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExportResult, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

from .config import ServiceInfo, TrackerConfig
from .names import ROUND_STEP, Instrument, otel_instrument
from .tracker import MetricValue, split_values

log = logging.getLogger(__name__)

EXPORT_TIMEOUT = 10.0
"""Seconds one export may take, the exporter's retries included."""

LOGS_LOGGER = "psyche"
"""The logger whose records (its own and its children's) are sent to `--oltp-logs-url`."""


# ---- exporters that say once that they failed, then stop -------------------------------------


class _Switch:
    """One signal's export: on until an export fails, then off, with one warning."""

    def __init__(self, signal: str, url: str) -> None:
        self.signal = signal
        self.url = url
        self.on = True
        self._lock = threading.Lock()

    def failed(self) -> None:
        with self._lock:
            if not self.on:
                return
            self.on = False
        log.warning(
            "OpenTelemetry %s export to %s failed; %s export is off for the rest of the run",
            self.signal,
            self.url,
            self.signal,
        )


class _ExportsUntilItFails:
    """Mixed in before an OTLP exporter (with its result enum's `SUCCESS` and `FAILURE`): an
    export fails at once while `switch` is off, and the first failed export turns it off."""

    SUCCESS: ClassVar[Enum]
    FAILURE: ClassVar[Enum]

    def __init__(self, switch: _Switch, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.switch = switch

    def export(self, *args: Any, **kwargs: Any) -> Any:
        if not self.switch.on:
            return self.FAILURE
        # The exporter this is mixed into (next in the MRO) does the export.
        result = cast(Any, super()).export(*args, **kwargs)
        if result is not self.SUCCESS:
            self.switch.failed()
        return result


class _MetricExporter(_ExportsUntilItFails, OTLPMetricExporter):
    SUCCESS, FAILURE = MetricExportResult.SUCCESS, MetricExportResult.FAILURE


class _SpanExporter(_ExportsUntilItFails, OTLPSpanExporter):
    SUCCESS, FAILURE = SpanExportResult.SUCCESS, SpanExportResult.FAILURE


class _LogExporter(_ExportsUntilItFails, OTLPLogExporter):
    SUCCESS, FAILURE = LogRecordExportResult.SUCCESS, LogRecordExportResult.FAILURE


_E = TypeVar("_E", bound=_ExportsUntilItFails)


# ---- log records -----------------------------------------------------------------------------


def _severity(levelno: int) -> SeverityNumber:
    if levelno >= logging.CRITICAL:
        return SeverityNumber.FATAL
    if levelno >= logging.ERROR:
        return SeverityNumber.ERROR
    if levelno >= logging.WARNING:
        return SeverityNumber.WARN
    if levelno >= logging.INFO:
        return SeverityNumber.INFO
    if levelno >= logging.DEBUG:
        return SeverityNumber.DEBUG
    return SeverityNumber.TRACE


_SEVERITY_TEXT = {"WARNING": "WARN", "CRITICAL": "FATAL"}


class OtelLogHandler(logging.Handler):
    """Python log records as OTLP log records (the batch processor queues them, bounded, and
    exports from its own thread): message as body, logger name as instrumentation scope, the
    code location and any exception as attributes."""

    def __init__(self, provider: LoggerProvider) -> None:
        super().__init__()
        self._provider = provider
        self._loggers: dict[str, Any] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            logger = self._loggers.get(record.name)
            if logger is None:
                logger = self._loggers[record.name] = self._provider.get_logger(record.name)
            attributes: dict[str, Any] = {
                "code.file.path": record.pathname,
                "code.function.name": record.funcName,
                "code.line.number": record.lineno,
            }
            if record.exc_info and record.exc_info[0] is not None:
                exc_type, exc, tb = record.exc_info
                attributes["exception.type"] = exc_type.__name__
                attributes["exception.message"] = str(exc)
                attributes["exception.stacktrace"] = "".join(
                    traceback.format_exception(exc_type, exc, tb)
                )
            logger.emit(
                LogRecord(
                    timestamp=int(record.created * 1e9),
                    observed_timestamp=time.time_ns(),
                    severity_text=_SEVERITY_TEXT.get(record.levelname, record.levelname),
                    severity_number=_severity(record.levelno),
                    body=record.getMessage(),
                    attributes=attributes,
                )
            )
        except Exception:
            self.handleError(record)


# ---- the sink --------------------------------------------------------------------------------


class OtelSink:
    name = "otel"

    def __init__(
        self, config: TrackerConfig, service: ServiceInfo, *, logs_logger: str = LOGS_LOGGER
    ) -> None:
        self.config = config
        self.service = service
        self.logs_logger = logs_logger
        self._meter_provider: MeterProvider | None = None
        self._tracer_provider: TracerProvider | None = None
        self._logger_provider: LoggerProvider | None = None
        self._log_handler: OtelLogHandler | None = None
        self._meter: Any = None
        self._tracer: Any = None
        self._instruments: dict[str, Any] = {}
        self._counter_totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._last_time_ns: int | None = None
        self._start()

    def _exporter(self, cls: type[_E], signal: str, url: str) -> _E:
        """`signal`'s exporter to `url`, with the run's auth header and `EXPORT_TIMEOUT`, off
        after its first failed export."""
        kwargs: dict[str, Any] = {"endpoint": url, "timeout": EXPORT_TIMEOUT}
        if self.config.oltp_auth_header is not None:
            kwargs["headers"] = {"authorization": self.config.oltp_auth_header}
        return cls(_Switch(signal, url), **kwargs)

    def _start(self) -> None:
        """Providers, exporters and the log handler, made when the sink is: no network (the
        exports run later, on the SDK's threads), and the log handler is in place before the
        command logs anything else."""
        config = self.config
        resource = Resource(self.service.attributes())
        scope = self.service.scope
        if config.oltp_metrics_url is not None:
            url = config.oltp_metrics_url
            exporter = self._exporter(_MetricExporter, "metrics", url)
            reader = PeriodicExportingMetricReader(
                exporter,
                export_interval_millis=config.oltp_report_interval * 1000,
                export_timeout_millis=EXPORT_TIMEOUT * 1000,
            )
            self._meter_provider = MeterProvider(
                resource=resource, metric_readers=[reader], shutdown_on_exit=False
            )
            self._meter = self._meter_provider.get_meter(scope)
        if config.oltp_tracing_url is not None:
            url = config.oltp_tracing_url
            self._tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
            self._tracer_provider.add_span_processor(
                BatchSpanProcessor(self._exporter(_SpanExporter, "traces", url))
            )
            self._tracer = self._tracer_provider.get_tracer(scope)
        if config.oltp_logs_url is not None:
            url = config.oltp_logs_url
            self._logger_provider = LoggerProvider(resource=resource, shutdown_on_exit=False)
            self._logger_provider.add_log_record_processor(
                BatchLogRecordProcessor(self._exporter(_LogExporter, "logs", url))
            )
            self._log_handler = OtelLogHandler(self._logger_provider)
            logging.getLogger(self.logs_logger).addHandler(self._log_handler)

    def open(self) -> None:
        pass  # all set up in __init__

    def _record(self, instrument: Instrument, value: float | int) -> None:
        made = self._instruments.get(instrument.name)
        if made is None:
            if instrument.kind == "counter":
                made = self._meter.create_counter(
                    instrument.name, description=instrument.description
                )
            else:
                made = self._meter.create_gauge(instrument.name, description=instrument.description)
            self._instruments[instrument.name] = made
        attributes = instrument.attributes or None
        if instrument.kind == "gauge":
            made.set(value, attributes)
            return
        # A counter is logged as a running total; OpenTelemetry counters take increments.
        key = (instrument.name, tuple(sorted(instrument.attributes.items())))
        last = self._counter_totals.get(key, 0)
        delta = value - last if value >= last else value
        self._counter_totals[key] = value
        if delta > 0:
            made.add(delta, attributes)

    def _span(
        self, name: str, metrics: dict[str, MetricValue], step: int | None, timestamp: float
    ) -> None:
        end = int(timestamp * 1e9)
        start = self._last_time_ns if self._last_time_ns is not None else end
        self._last_time_ns = end
        attributes: dict[str, Any] = dict(metrics)
        if step is not None:
            attributes["step"] = step
        span = self._tracer.start_span(name, start_time=min(start, end), attributes=attributes)
        span.end(end_time=end)

    def write(self, metrics: dict[str, MetricValue], step: int, timestamp: float) -> None:
        if self._meter is not None:
            numbers, _ = split_values(metrics)
            self._record(ROUND_STEP, step)
            for key, value in numbers.items():
                self._record(otel_instrument(key), value)
        if self._tracer is not None:
            self._span("step", metrics, step, timestamp)

    def write_summary(self, metrics: dict[str, MetricValue], timestamp: float) -> None:
        # A span only: whole-run values (a best loss, a step count) are not the current value
        # a gauge stands for.
        if self._tracer is not None:
            self._span("summary", metrics, None, timestamp)

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout

        def left_ms() -> int:
            return max(0, int((deadline - time.monotonic()) * 1000))

        if self._log_handler is not None:
            logging.getLogger(self.logs_logger).removeHandler(self._log_handler)
            self._log_handler = None
        if self._meter_provider is not None:
            self._meter_provider.shutdown(timeout_millis=left_ms())
            self._meter_provider = None
        if self._tracer_provider is not None:
            self._tracer_provider.force_flush(timeout_millis=left_ms())
            self._tracer_provider.shutdown()
            self._tracer_provider = None
        if self._logger_provider is not None:
            self._logger_provider.force_flush(timeout_millis=left_ms())
            self._logger_provider.shutdown()
            self._logger_provider = None
