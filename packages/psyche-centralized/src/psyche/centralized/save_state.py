"""Saving the server's coordinator state and resuming a run from it.

What a saved state means (docs/centralized.md, "Saving and resuming"): the run as it would be
right after an epoch ended, so that a restarted server continues it with the clients that hold
the model. `resume_snapshot` makes that state from the live coordinator:

* at an epoch end (upstream saves there) it only restores the `--init-warmup-time` override and
  empties `exited_clients`;
* mid-epoch (the save on shutdown), the epoch is closed as its cooldown would close it: the next
  epoch starts after the current round's data, the epoch counter advances, non-healthy clients
  leave, and a Hub/Gcs checkpoint becomes P2P (the clients now hold a newer model than the repo);
* the clients of the last epoch keep their identities (upstream zeroes them), so when one of
  them rejoins, joiners fetch the model from it (P2P) rather than from the initial repo;
* the state is WaitingForMembers (upstream), except that a Finished run stays Finished.

Files: `<dir>/<run_id>-step<N>.toml` with N = `progress.step - 1`, the last completed step
(upstream writes `FixedString`'s Debug form into the name, quotes and all), then `<dir>/latest`,
a one-line text file naming the newest save. Both are written atomically.
"""

from __future__ import annotations

import re
from pathlib import Path

from psyche.coordinator.coordinator import ClientState, Coordinator, RunState
from psyche.coordinator.model import Checkpoint
from psyche.coordinator.run_config import ConfigFileError, dumps_toml
from psyche.core.atomic_file import write_atomically
from psyche.core.numeric import truncating_cast_unsigned, wrapping_u64

LATEST_POINTER = "latest"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class SavedStateError(ValueError):
    """A saved state that cannot be found or read; the message names the path."""


def save_file_name(coordinator: Coordinator) -> str:
    run_id = _UNSAFE.sub("_", coordinator.run_id) or "run"
    step = max(coordinator.progress.step - 1, 0)
    return f"{run_id}-step{step}.toml"


def close_epoch(coordinator: Coordinator) -> None:
    """End a running epoch in place as its cooldown tick would (without the clock)."""
    if coordinator.run_state not in (
        RunState.RoundTrain,
        RunState.RoundWitness,
        RunState.Cooldown,
    ):
        return
    current = coordinator.current_round()
    if current is not None:
        batch_size = coordinator.get_target_global_batch_size(current)
        coordinator.progress.epoch_start_data_index = wrapping_u64(current.data_index + batch_size)
    coordinator.progress.epoch = truncating_cast_unsigned(coordinator.progress.epoch + 1, 16)
    epoch_state = coordinator.epoch_state
    epoch_state.clients = [c for c in epoch_state.clients if c.state is ClientState.Healthy]
    llm = coordinator.model.value  # type: ignore[attr-defined]
    match llm.checkpoint:
        case Checkpoint.Hub(repo) | Checkpoint.Dummy(repo):
            llm.checkpoint = Checkpoint.P2P(repo)
        case Checkpoint.Gcs(repo):
            llm.checkpoint = Checkpoint.P2PGcs(repo)
    epoch_state.cold_start_epoch = False
    coordinator.pending_pause = False


def resume_snapshot(coordinator: Coordinator, original_warmup_time: int) -> Coordinator:
    """The state to write to disk (see the module docstring); `coordinator` is not changed."""
    state = coordinator.copy()
    state.config.warmup_time = original_warmup_time
    close_epoch(state)
    if state.run_state is not RunState.Finished:
        state.run_state = RunState.WaitingForMembers
    state.epoch_state.exited_clients = []
    return state


def save_state(directory: Path | str, state: Coordinator) -> Path:
    """Write `state` (already a `resume_snapshot`) and point `latest` at it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / save_file_name(state)
    write_atomically(path, dumps_toml(state.to_toml_obj()))
    write_atomically(directory / LATEST_POINTER, path.name + "\n")
    return path


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
    return Coordinator.from_state_toml(resolve_state_path(path))


__all__ = [
    "LATEST_POINTER",
    "ConfigFileError",
    "SavedStateError",
    "close_epoch",
    "load_state",
    "resolve_state_path",
    "resume_snapshot",
    "save_file_name",
    "save_state",
]
