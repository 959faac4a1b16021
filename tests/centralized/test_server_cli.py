"""`psyche-server run` as a process: options from flags and the environment, a clean stop that
saves the state, a restart that resumes it, and clear errors."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import trio

from psyche.centralized.save_state import load_state
from psyche.centralized.testing import ProtocolClient

from ..processes import REPO, free_port
from .servers import TINY, tiny_state

SERVING = re.compile(r"serving run '([^']*)' on port (\d+)")


def server(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "psyche.cli.server", "run", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_serving(process: subprocess.Popen[str], lines: list[str]) -> int:
    assert process.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = SERVING.search(line)
        if match:
            return int(match.group(2))
    raise AssertionError("server did not start:\n" + "".join(lines))


def wait_status_page(process: subprocess.Popen[str], lines: list[str]) -> int:
    assert process.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = re.search(r"status page on http://[^:]+:(\d+)/", line)
        if match:
            return int(match.group(1))
    raise AssertionError("no status page:\n" + "".join(lines))


def joins(port: int) -> None:
    async def main() -> None:
        async with await ProtocolClient.connect(f"127.0.0.1:{port}") as client:
            await client.join("tiny-cpu")
            state = await client.next_coordinator()
            assert state.run_id == "tiny-cpu"

    trio.run(main)


def test_run_from_environment_stop_saves_and_restart_resumes(tmp_path: Path) -> None:
    state = tiny_state(tmp_path, free_port())
    saves = tmp_path / "saves"
    port = free_port()
    env = {
        "SERVER_PORT": str(port),
        "DATA_CONFIG": str(TINY / "data.toml"),
        "SAVE_STATE_DIR": str(saves),
        "METRICS_JSONL": str(tmp_path / "server-metrics.jsonl"),
        "STATUS_PORT": "0",
    }
    lines: list[str] = []
    process = server("--state", str(state), env=env)  # not a terminal: --tui falls back
    try:
        assert wait_serving(process, lines) == port
        status_port = wait_status_page(process, lines)
        joins(port)
        with urllib.request.urlopen(f"http://127.0.0.1:{status_port}/status.json") as reply:
            status = json.load(reply)
        assert status["run_id"] == "tiny-cpu"
        assert status["run_state"] == "WaitingForMembers"
    finally:
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=30)
    log = "".join(lines) + out
    assert process.returncode == 0, log
    assert "running with --tui false" in log
    logged = [json.loads(line) for line in (tmp_path / "server-metrics.jsonl").open()]
    states = [e["values"]["coordinator/run_state"] for e in logged if e["kind"] == "log"]
    assert states, logged
    assert states[0] == "WaitingForMembers", logged
    assert "got SIGTERM, shutting down" in log
    assert "Saved state to" in log
    saved = load_state(saves)
    assert saved.run_id == "tiny-cpu"
    assert saved.progress.step == 1

    # --state naming the save directory resumes from its newest state; the flag beats the env
    lines = []
    process = server("--state", str(saves), "--tui", "false", "-s", "0", env=env)
    try:
        assert wait_serving(process, lines) != port
    finally:
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=30)
    assert process.returncode == 0, "".join(lines) + out
    assert "got SIGINT" in out


def test_bad_options_and_configs_fail_clearly(tmp_path: Path) -> None:
    def fails(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
        result = subprocess.run(
            [sys.executable, "-m", "psyche.cli.server", "run", *args],
            cwd=REPO,
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=60,
        )
        return result.returncode, result.stdout + result.stderr

    code, out = fails()
    assert code == 2
    assert "--state (or STATE)" in out
    code, out = fails("--state", "x", env={"SERVER_PORT": "http"})
    assert code == 2
    assert "environment variable SERVER_PORT: expected an integer" in out
    code, out = fails("--state", "x", "--server-port", "70000")
    assert code == 2
    assert "70000 is out of range" in out
    code, out = fails("--state", "x", "--tui", "maybe")
    assert code == 2
    assert "expected true or false" in out

    code, out = fails("--state", str(tmp_path / "missing.toml"), "--tui", "false")
    assert code == 1
    assert "Error found in config" in out
    assert "file not found" in out
    ephemeral = {
        '[model.LLM.checkpoint.Hub]\nrepo_id = "configs/tiny-cpu/model"': "",
        "cold_start_warmup_steps = 0": 'cold_start_warmup_steps = 0\ncheckpoint = "Ephemeral"',
    }
    state = tiny_state(tmp_path, free_port(), **ephemeral)
    code, out = fails("--state", str(state), "--tui", "false")
    assert code == 1, out
    assert "Can't start up a run with an Ephemeral checkpoint." in out


def test_validate_config_takes_what_run_takes(tmp_path: Path) -> None:
    """A save-state directory (what `run --state` resumes from) validates too."""
    from psyche.centralized.save_state import save_state

    saves = tmp_path / "saves"
    save_state(saves, load_state(tiny_state(tmp_path, free_port())))

    def validate(state: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "psyche.cli.server", "validate-config", "--state", str(state)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )

    result = validate(saves)
    assert result.returncode == 0, result
    assert "Configs are OK! run 'tiny-cpu'" in result.stdout, result
    result = validate(tmp_path)  # a directory no server saved into: run refuses it alike
    assert result.returncode == 1
    assert "is a directory without a 'latest' file" in result.stderr, result.stderr


def test_a_private_run_from_an_authorized_keys_file(tmp_path: Path) -> None:
    from psyche.core.identity import SecretKey

    member, stranger = SecretKey.generate(), SecretKey.generate()
    keys = tmp_path / "authorized"
    keys.write_text(f"# the run's clients\n0x{member.public_key.hex()}  # client 1\n\n")
    state = tiny_state(tmp_path, free_port())
    lines: list[str] = []
    process = server(
        "--state", str(state), "--tui", "false", "--data-config", str(TINY / "data.toml"),
        "--bind-address", "127.0.0.1", env={"AUTHORIZED_KEYS": str(keys)},
    )  # fmt: skip
    try:
        port = wait_serving(process, lines)
        assert "(127.0.0.1); private run: 1 authorized key" in lines[-1], lines[-1]

        async def main() -> None:
            async with await ProtocolClient.connect(f"127.0.0.1:{port}", member) as client:
                await client.join("tiny-cpu")
                assert (await client.next_coordinator()).run_id == "tiny-cpu"
            async with await ProtocolClient.connect(f"127.0.0.1:{port}", stranger) as client:
                try:
                    with trio.fail_after(10):
                        await client.join("tiny-cpu")
                        await client.next_coordinator()
                except Exception as e:  # closed by the server right after the handshake
                    refusal = str(e)
                else:
                    raise AssertionError("the stranger was served")
                assert "tiny-cpu" not in refusal

        trio.run(main)
    finally:
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=30)
    log = "".join(lines) + out
    assert process.returncode == 0, log
    assert f"key {stranger.public_key.hex()} is not allowed to log in" in log

    def fails(keys_text: str) -> str:
        keys.write_text(keys_text)
        result = subprocess.run(
            [sys.executable, "-m", "psyche.cli.server", "run", "--state", str(state),
             "--tui", "false", "--authorized-keys", str(keys)],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 1, result
        return result.stdout + result.stderr

    assert f"{keys}:2: not an ed25519 public key: 'zz'" in fails(f"{member.public_key.hex()}\nzz\n")
    assert "lists no key: nobody could join this run" in fails("# nobody yet\n")
