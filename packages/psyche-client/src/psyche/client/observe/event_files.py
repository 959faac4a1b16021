"""`--events-dir`: this client's record of the run, one file per epoch (upstream's
`shared/event-sourcing` `FileBackend`, which the solana client writes to `<dir>/<node id>/`).

Files are `<dir>/<node id>/epoch-<N>.jsonl`, one JSON object a line, each with `ts` (unix
seconds) and `event`:

* `run_started` (first line of every file): `run_id`, `node_id`, `epoch`;
* `state_changed`: `old`, `new` (run state names), `epoch`, `step`, `clients`;
* `round`: a finished round (`psyche.client.observe.telemetry.RoundReport`'s fields, the network's
  numbers under `network`);
* `evals`: `step`, `scores` (task -> score), `partial` (the tasks whose score is over fewer
  documents than the task holds) whenever the evaluation scores change;
* `finished`: the run summary's fields.

Upstream writes its own postcard event records (readable by its Rust tools only); this port
writes JSON lines that any tool reads (docs/client.md). A new file starts when the run's epoch
grows; only the newest `keep` files are kept (0: all). Lines are small and written on the
client's loop, one `write` each; a file that cannot be written is switched off with one warning.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from psyche.client.observe.telemetry import RoundReport

if TYPE_CHECKING:
    from psyche.coordinator import Coordinator

log = logging.getLogger(__name__)

_FILE = re.compile(r"^epoch-(\d+)\.jsonl$")


def epoch_file_name(epoch: int) -> str:
    return f"epoch-{epoch}.jsonl"


def read_event_files(directory: Path) -> list[dict[str, Any]]:
    """Every event of a node's directory, oldest file first (a torn last line is skipped)."""
    files = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _FILE.match(p.name)))
    events = []
    for _, path in files:
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    return str(value)


class EventFiles:
    """A `RunObserver` writing the events above."""

    def __init__(self, directory: Path, *, run_id: str, node_id: str, keep: int = 5) -> None:
        self.directory = Path(directory)
        self.run_id = run_id
        self.node_id = node_id
        self.keep = keep
        self.epoch: int | None = None
        self._file: IO[str] | None = None
        self._last_state: str | None = None
        self._broken = False
        self.directory.mkdir(parents=True, exist_ok=True)

    # ---- writing

    def _open(self, epoch: int) -> None:
        if self._file is not None:
            self._file.close()
        self.epoch = epoch
        self._file = open(self.directory / epoch_file_name(epoch), "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._write_line(
            {"event": "run_started", "run_id": self.run_id, "node_id": self.node_id, "epoch": epoch}
        )
        self._rotate()

    def _rotate(self) -> None:
        if self.keep <= 0:
            return
        files = sorted(
            (int(m.group(1)), p) for p in self.directory.iterdir() if (m := _FILE.match(p.name))
        )
        for _, path in files[: max(0, len(files) - self.keep)]:
            path.unlink(missing_ok=True)

    def _write_line(self, event: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps({"ts": round(time.time(), 3), **_jsonable(event)}) + "\n")
        self._file.flush()

    def _emit(self, epoch: int, event: dict[str, Any]) -> None:
        if self._broken:
            return
        try:
            if self._file is None or (self.epoch is not None and epoch > self.epoch):
                self._open(epoch)
            self._write_line(event)
        except OSError as e:
            self._broken = True
            log.warning("--events-dir %s: cannot write events, stopped: %s", self.directory, e)

    # ---- RunObserver

    def on_state(self, state: Coordinator) -> None:
        name = state.run_state.name
        if name == self._last_state:
            return
        old, self._last_state = self._last_state, name
        self._emit(
            state.progress.epoch,
            {
                "event": "state_changed",
                "old": old,
                "new": name,
                "epoch": state.progress.epoch,
                "step": state.progress.step,
                "clients": len(state.epoch_state.clients),
            },
        )

    def on_round(self, report: RoundReport) -> None:
        self._emit(report.epoch, {"event": "round", **asdict(report)})

    def on_evals(
        self, step: int, scores: Mapping[str, float], partial: frozenset[str] = frozenset()
    ) -> None:
        event = {"event": "evals", "step": step, "scores": dict(scores), "partial": sorted(partial)}
        self._emit(self.epoch or 0, event)

    def on_finished(self, summary: Mapping[str, Any]) -> None:
        self._emit(self.epoch or 0, {"event": "finished", **summary})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


__all__ = ["EventFiles", "epoch_file_name", "read_event_files"]
