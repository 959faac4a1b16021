"""A client killed while it writes a checkpoint leaves its staging directory behind; the next
client start removes it (and only the staging directories whose writer is gone)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from psyche.cli.client.main import build_parser
from psyche.client.checkpoints.store import remove_stale_staging
from psyche.client.run import run_init_config
from psyche.client.setup.options import TrainOptions

# A checkpoint write that stops inside its staging directory until the process is killed.
WRITER = """
import sys, time
from pathlib import Path
import psyche.modeling.checkpoint as checkpoint
from psyche.client.checkpoints.store import RunInstance, save_checkpoint_locally

def stuck(variables, directory):
    (directory / "model.safetensors").write_bytes(b"half a model")
    print("writing", flush=True)
    time.sleep(600)

checkpoint.save_tensors_into_safetensors = stuck
save_checkpoint_locally(
    Path(sys.argv[1]) / "tiny-cpu-step7", {}, [], "{}", "{}",
    run=RunInstance("tiny-cpu", "instance"), step=7,
)
"""


def start_writers(directory: Path, count: int = 1) -> list[subprocess.Popen[str]]:
    """`count` writers, each stopped inside its staging directory. They start side by side:
    each imports torch, seconds of CPU."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(directory)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(count)
    ]
    for process in processes:
        assert process.stdout is not None
        assert process.stdout.readline() == "writing\n"
    return processes


def staging(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_staging_left_by_a_killed_writer_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    killed, live = start_writers(tmp_path, 2)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        names = staging(tmp_path)
        assert len(names) == 2
        assert all(n.startswith(".tiny-cpu-step7.pid") for n in names), names
        (tmp_path / "tiny-cpu-step3").mkdir()  # a finished checkpoint
        (tmp_path / ".notes.tmp").mkdir()  # not a staging directory
        removed = remove_stale_staging(tmp_path)
        assert [p.name for p in removed] == [f for f in names if f".pid{killed.pid}." in f]
        left = sorted(p.name for p in tmp_path.iterdir())
        assert len(left) == 3
        assert "tiny-cpu-step3" in left
        assert ".notes.tmp" in left
        assert any(f".pid{live.pid}." in n for n in left)  # its writer still runs
    finally:
        for process in (killed, live):
            process.kill()
            process.wait(30)
    assert remove_stale_staging(tmp_path / "absent") == []


def test_a_starting_client_removes_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (writer,) = start_writers(checkpoints)
    writer.send_signal(signal.SIGKILL)
    writer.wait(30)
    assert len(staging(checkpoints)) == 1
    for name in ("RAW_IDENTITY_SECRET_KEY", "RUN_ID", "SERVER_ADDR", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    parser, env = build_parser()
    args = parser.parse_args(
        ["train", "--run-id", "tiny-cpu", "--server-addr", "127.0.0.1:1",
         "--checkpoint-dir", str(checkpoints)]
    )  # fmt: skip
    env.resolve(parser, args)
    config = run_init_config(TrainOptions.from_args(args), None, None)
    assert config.checkpoint.checkpoint_dir == checkpoints
    assert staging(checkpoints) == []
