"""Client logging: plain console lines, JSON lines, or (`tui`) the console with a note.

Events that tools read (the loss per round, model hashes, assignments) are logged with
`log_event(logger, name, **fields)`: the message is the event name and the fields follow as
`key=value` pairs on the console, or as JSON keys. Upstream marks the same lines with its
`integration_test_log_marker`; the names here follow upstream's (`client_loss`, `loaded_model`,
...). Values are rendered with `repr`-free plain text so a line can be split on spaces.
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


def log_event(
    logger: logging.Logger, name: str, /, level: int = logging.INFO, **fields: Any
) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={_FIELDS: fields})


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
        text += record.getMessage()
        fields = getattr(record, _FIELDS, None)
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
    file. The TUI is not built: `tui` logs to the console and says so once."""
    if mode not in LOG_MODES:
        raise ValueError(f"unknown log mode {mode!r}; expected one of {', '.join(LOG_MODES)}")
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter() if mode == "json" else ConsoleFormatter())
    root.addHandler(handler)
    if write_log is not None:
        write_log.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(write_log, encoding="utf-8")
        file_handler.setFormatter(ConsoleFormatter())
        root.addHandler(file_handler)
    root.setLevel(level)
    # third-party chatter (libp2p logs every stream at INFO)
    for noisy in ("libp2p", "multiaddr", "httpx", "httpcore", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if mode == "tui":
        logging.getLogger("psyche.client").warning(
            "--logs tui: the terminal dashboard is not built in the Python port; "
            "logging to the console instead"
        )
