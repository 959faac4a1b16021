"""Saved states on disk: names, the `latest` pointer, atomic writes, loading back exactly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from psyche.centralized.save_state import (
    LATEST_POINTER,
    RUN_IDENTITY_FILE,
    SavedStateError,
    load_state,
    resolve_state_path,
    save_file_name,
    save_state,
    saved_run_identity,
)
from psyche.coordinator.backend import OpportunisticData
from psyche.coordinator.run_config import ConfigFileError
from psyche.coordinator.server_core import ServerCore
from psyche.coordinator.testing import quick_coordinator, simulated_identity, warmup_witness_for
from psyche.core.numeric import U64_MAX

NOW = 1_700_000_000


def mid_epoch_snapshot():  # type: ignore[no-untyped-def]
    core = ServerCore.start(quick_coordinator(run_id="my run/1"), now=NOW)
    for i in range(3):
        core.on_join(simulated_identity(i), "my run/1")
    core.on_tick(NOW + 2, 1)
    for i, client in enumerate(core.coordinator.epoch_state.clients):
        core.on_witness(client.id, OpportunisticData.WarmupStep(warmup_witness_for(i)), NOW + 2, 2)
    core.coordinator.epoch_state.rounds[0].random_seed = U64_MAX  # beyond TOML's i64
    core.coordinator.progress.step = 42
    return core.snapshot()


def test_file_name_is_the_run_id_and_last_completed_step() -> None:
    state = mid_epoch_snapshot()
    assert save_file_name(state) == "my_run_1-step41.toml"
    fresh = quick_coordinator()  # step 0
    assert save_file_name(fresh) == "test-run-step0.toml"


def test_save_then_load_is_exact(tmp_path: Path) -> None:
    state = mid_epoch_snapshot()
    path = save_state(tmp_path / "saves", state)
    assert path == tmp_path / "saves" / "my_run_1-step41.toml"
    assert (tmp_path / "saves" / LATEST_POINTER).read_text() == path.name + "\n"
    assert f'"{U64_MAX}"' in path.read_text()
    for source in (path, tmp_path / "saves"):
        loaded = load_state(source)
        assert loaded.to_bytes() == state.to_bytes()
    # no temporary files left behind
    assert sorted(p.name for p in path.parent.iterdir()) == [LATEST_POINTER, path.name]


def test_the_run_identity_is_saved_beside_the_state(tmp_path: Path) -> None:
    """A server resumed from its saves runs the same instance of the run (its clients'
    checkpoints stay theirs); a state file without a saved identity beside it starts a new one."""
    state = mid_epoch_snapshot()
    path = save_state(tmp_path / "saves", state, "0123abcd")
    assert saved_run_identity(path) == "0123abcd"
    assert saved_run_identity(tmp_path / "saves" / LATEST_POINTER) == "0123abcd"
    assert saved_run_identity(tmp_path / "elsewhere.toml") is None
    (tmp_path / "saves" / RUN_IDENTITY_FILE).write_text("../not one\n")
    assert saved_run_identity(path) is None


def test_latest_follows_the_newest_save(tmp_path: Path) -> None:
    state = mid_epoch_snapshot()
    first = save_state(tmp_path, state)
    state.progress.step = 50
    second = save_state(tmp_path, state)
    assert first.exists()
    assert second.exists()
    assert first != second
    assert resolve_state_path(tmp_path) == second
    assert load_state(tmp_path).progress.step == 50


def test_a_failed_write_keeps_the_previous_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = mid_epoch_snapshot()
    path = save_state(tmp_path, state)
    before = path.read_bytes()

    def disk_full(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError, match="No space"):
        save_state(tmp_path, state)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST_POINTER, path.name]


@pytest.mark.parametrize(
    ("pointer", "message"),
    [
        (None, "without a 'latest' file"),
        ("../escape.toml\n", "does not name a file"),
        ("\n", "does not name a file"),
        ("missing.toml\n", "which does not exist"),
    ],
)
def test_bad_save_directories_are_explained(
    tmp_path: Path, pointer: str | None, message: str
) -> None:
    if pointer is not None:
        (tmp_path / LATEST_POINTER).write_text(pointer)
    with pytest.raises(SavedStateError, match=message):
        load_state(tmp_path)


def test_a_corrupt_saved_state_names_the_file(tmp_path: Path) -> None:
    path = save_state(tmp_path, mid_epoch_snapshot())
    path.write_text(path.read_text().replace("[progress]", "[progress]\nbogus = 1"))
    with pytest.raises(ConfigFileError) as info:
        load_state(tmp_path)
    assert str(path) in str(info.value)
    assert "progress.bogus" in str(info.value)
