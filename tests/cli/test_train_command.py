"""`psyche-train` out of the box: its defaults train the tiny run's model on the tiny dataset
offline (found from anywhere inside the repository), absent defaults and an uncached hub model
end in one line; and every command's `--help` shows its defaults. Real processes, offline
(`HF_HUB_OFFLINE=1` with an empty hub cache)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ..processes import REPO
from ..timing import scaled
from .conftest import command

TINY_MODEL = REPO / "configs" / "tiny-cpu" / "model"


def offline(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}


def train(args: list[str], cwd: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [command("psyche-train"), *args],
        cwd=cwd,
        env=offline(tmp_path),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )


def checkout(root: Path, *, data: bool) -> Path:
    """The parts of a repository `psyche-train`'s defaults use: the tiny model's directory and,
    with `data`, the tiny dataset as scripts/setup.sh writes it."""
    shutil.copytree(TINY_MODEL, root / "configs" / "tiny-cpu" / "model")
    if data:
        from psyche.centralized.tiny_run import write_tiny_dataset

        write_tiny_dataset(root / "data" / "tiny-cpu", tokenizer_path=TINY_MODEL / "tokenizer.json")
    return root


def test_defaults_train_the_tiny_model_offline_from_inside_the_repository(tmp_path: Path) -> None:
    root = checkout(tmp_path / "repo", data=True)
    result = train(["--total-steps", "2"], root / "configs", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"Loading {root / 'configs' / 'tiny-cpu' / 'model'}" in out
    steps = [line for line in out.splitlines() if line.startswith("step: ")]
    assert [s.split(",")[0] for s in steps] == ["step: 1", "step: 2"]
    assert "batch: B[8, 15]" in steps[1]
    assert "loss: " in steps[1]
    assert "trained 2 steps" in out


def test_absent_defaults_end_in_one_line(tmp_path: Path) -> None:
    nowhere = tmp_path / "elsewhere"
    nowhere.mkdir()
    result = train([], nowhere, tmp_path)
    assert result.returncode == 1
    assert result.stderr == (
        "psyche-train: error: no model at configs/tiny-cpu/model (the default --model): run "
        "psyche-train from the repository, or pass --model or --init-config\n"
    )
    root = checkout(tmp_path / "repo", data=False)
    result = train([], root, tmp_path)
    assert result.returncode == 1
    assert result.stderr == (
        "psyche-train: error: no data at data/tiny-cpu (the default --data-path): run "
        "scripts/setup.sh (it writes the tiny dataset), or pass --data-path\n"
    )


def test_an_uncached_hub_model_offline_ends_in_one_line(tmp_path: Path) -> None:
    root = checkout(tmp_path / "repo", data=True)
    result = train(["--model", "nobody/no-such-model", "--total-steps", "1"], root, tmp_path)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(
        "psyche-train: error: cannot fetch 'nobody/no-such-model' from the hub: "
    )


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (
            ["psyche-train"],
            ["(default: configs/tiny-cpu/model)", "(default: data/tiny-cpu)", "(default: 128)"],
        ),
        (["psyche-client", "train"], ["[default: 30.0]", "[default: 120.0]", "[default: console]"]),
        (["psyche-server", "run"], ["[default: true]"]),
        (["psyche-local-testnet", "start"], ["[default: 20000]", "[default: 120]"]),
        (["psyche-solana-client", "tick"], ["(default: 1000)", "(default: http://127.0.0.1:8899)"]),
        (["psyche-solana-client", "localnet"], ["(default: 127.0.0.1)", "(default: 8899)"]),
        (["psyche-solana-client", "train"], ["[default: 1]", "(default: ws://127.0.0.1:8900)"]),
    ],
)
def test_help_shows_defaults(argv: list[str], shown: list[str]) -> None:
    environ = {k: v for k, v in os.environ.items() if k not in ("RPC", "WS_RPC", "MS_INTERVAL")}
    result = subprocess.run(
        [command(argv[0]), *argv[1:], "--help"],
        env={**environ, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for text in [*shown, "--verbose"]:
        assert text in result.stdout, (text, result.stdout)
    assert "llama2-215m" not in result.stdout
