"""Client logging: plain console lines, JSON lines, or (`tui`) console lines that the terminal
dashboard (`psyche.client.observe.tui`) takes over into its log panel once it starts.

Events that tools read (the loss per round, model hashes, assignments) are logged with
`log_event(logger, name, **fields)`: the record's message is the event name and the fields
follow as `key=value` pairs on the console, or as JSON keys. Upstream marks the same lines with
its `integration_test_log_marker`; the names here follow upstream's (`client_loss`,
`loaded_model`, ...). Values are rendered with `repr`-free plain text so a line can be split on
spaces.

The console is for people, JSON for tools. Two keywords of `log_event` shape the console only:

* `text`: what a person reads instead of the name and fields (the per-step progress line, the
  run summary); JSON lines keep the name and every field.
* `quiet`: a routine per-round event (`round_start`, `trained_batch`, ...) stays in JSON lines
  at its level but shows on the console only when its logger is at DEBUG (`RUST_LOG=...debug`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

LOG_MODES = ("tui", "console", "json")
_FIELDS = "psyche_fields"
_TEXT = "psyche_text"
_QUIET = "psyche_quiet"


def log_event(
    logger: logging.Logger,
    name: str,
    /,
    level: int = logging.INFO,
    *,
    text: str | None = None,
    quiet: bool = False,
    **fields: Any,
) -> None:
    """Log event `name` with `fields` (no field may be called `text` or `quiet`)."""
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={_FIELDS: fields, _TEXT: text, _QUIET: quiet})


def event_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a `log_event` record carries (empty for any other record)."""
    return dict(getattr(record, _FIELDS, None) or {})


class QuietEventFilter(logging.Filter):
    """Drops `quiet` events unless their logger is enabled for DEBUG (for console handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, _QUIET, False):
            return True
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def _plain(value: Any) -> str:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(_plain(v) for v in value) + "]"
    return str(value).replace(" ", "")


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, float | int | bool | str) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


class ConsoleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        text = f"{stamp}.{int(record.msecs):03d} {record.levelname:<5} {record.name}: "
        human = getattr(record, _TEXT, None)
        fields = getattr(record, _FIELDS, None)
        if human:
            text += human
        else:
            text += record.getMessage()
            if fields:
                text += " " + " ".join(f"{k}={_plain(v)}" for k, v in fields.items())
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": record.created,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, _FIELDS, None)
        if fields:
            doc.update({k: _jsonable(v) for k, v in fields.items() if k not in doc})
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup_logging(mode: str, *, write_log: Path | None = None, level: int = logging.INFO) -> None:
    """Configure the root logger for `mode`; `write_log` also writes console-format lines to a
    file. `tui` starts as `console`; the dashboard swaps the console handler for its own."""
    if mode not in LOG_MODES:
        raise ValueError(f"unknown log mode {mode!r}; expected one of {', '.join(LOG_MODES)}")
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stdout)
    if mode == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(ConsoleFormatter())
        handler.addFilter(QuietEventFilter())
    root.addHandler(handler)
    if write_log is not None:
        write_log.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(write_log, encoding="utf-8")
        file_handler.setFormatter(ConsoleFormatter())
        file_handler.addFilter(QuietEventFilter())
        root.addHandler(file_handler)
    root.setLevel(level)
    # third-party chatter (libp2p logs every stream at INFO)
    for noisy in ("libp2p", "multiaddr", "httpx", "httpcore", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
