"""Saving the server's coordinator state to files and finding it again.

What a saved state is (the run as right after an epoch ended) is decided by
`psyche.coordinator.resume.resume_snapshot`; this module writes and reads the files.

Files: `<dir>/<run_id>-step<N>.toml` with N = `progress.step - 1`, the last completed step
(upstream writes `FixedString`'s Debug form into the name, quotes and all), then `<dir>/latest`,
a one-line text file naming the newest save, and `<dir>/run-identity`, which instance of the run
these saves are (a port addition: a server resumed from them keeps it, so its clients' checkpoints
stay theirs). All are written atomically.
"""

from __future__ import annotations

import re
from pathlib import Path

from psyche.coordinator.coordinator import Coordinator
from psyche.coordinator.run_config import dumps_toml, load_state_toml, state_to_toml_obj
from psyche.core.atomic_file import write_atomically
from psyche.core.safe_path import path_component

LATEST_POINTER = "latest"
RUN_IDENTITY_FILE = "run-identity"
_RUN_IDENTITY = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class SavedStateError(ValueError):
    """A saved state that cannot be found or read; the message names the path."""


def save_file_name(coordinator: Coordinator) -> str:
    run_id = path_component(coordinator.run_id, "run")
    step = max(coordinator.progress.step - 1, 0)
    return f"{run_id}-step{step}.toml"


def save_state(directory: Path | str, state: Coordinator, run_identity: str | None = None) -> Path:
    """Write `state` (already a `resume_snapshot`), point `latest` at it and record
    `run_identity` beside it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / save_file_name(state)
    write_atomically(path, dumps_toml(state_to_toml_obj(state)))
    write_atomically(directory / LATEST_POINTER, path.name + "\n")
    if run_identity is not None and saved_run_identity(path) != run_identity:
        write_atomically(directory / RUN_IDENTITY_FILE, run_identity + "\n")
    return path


def saved_run_identity(state_path: Path | str) -> str | None:
    """The run identity recorded beside the saved state `state_path` (None: none, or not one
    this module writes)."""
    try:
        text = (Path(state_path).parent / RUN_IDENTITY_FILE).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None
    text = text.strip()
    return text if _RUN_IDENTITY.match(text) else None


def resolve_state_path(path: Path | str) -> Path:
    """A state file as given, or the newest save of a save-state directory."""
    path = Path(path)
    if not path.is_dir():
        return path
    pointer = path / LATEST_POINTER
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise SavedStateError(
            f"{path} is a directory without a '{LATEST_POINTER}' file: pass a state file, or a "
            "--save-state-dir that a server has saved into"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise SavedStateError(f"{pointer}: cannot read: {e}") from None
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise SavedStateError(f"{pointer}: does not name a file in {path}: {name!r}")
    target = path / name
    if not target.is_file():
        raise SavedStateError(f"{pointer} names {name}, which does not exist in {path}")
    return target


def load_state(path: Path | str) -> Coordinator:
    """Load a state file or the newest save in a directory; raises ConfigFileError or
    SavedStateError with the path and the problem."""
    return load_state_toml(resolve_state_path(path))


__all__ = [
    "LATEST_POINTER",
    "RUN_IDENTITY_FILE",
    "SavedStateError",
    "load_state",
    "resolve_state_path",
    "save_file_name",
    "save_state",
    "saved_run_identity",
]
