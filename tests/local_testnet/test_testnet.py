"""`psyche-local-testnet`: its command lines, and the headless and tmux modes with a stand-in
client (`standin_client.py` joins and prints states; the real client is in tests/e2e)."""

from __future__ import annotations

import datetime
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from psyche.cli.local_testnet import main as testnet_main
from psyche.cli.local_testnet.commands import (
    TestnetPlan,
    identity_secret_key_hex,
    log_dir_name,
    pick_victims,
)
from psyche.cli.local_testnet.main import build_parser, client_cpu_threads
from psyche.core.identity import SecretKey

from ..cli.support import alive, dummy_state
from ..processes import free_port
from ..timing import scaled
from ..tmux import kill_tmux_server

STANDIN = Path(__file__).with_name("standin_client.py")
STANDIN_PROGRAM = f"{sys.executable} {STANDIN}"

FAST_STATE = dummy_state("testnet-test")


def fast_config(tmp_path: Path) -> Path:
    config = tmp_path / "config"
    config.mkdir()
    (config / "state.toml").write_text(FAST_STATE)
    return config


# ---- command lines ---------------------------------------------------------------------------


def test_keys_are_upstreams_test_keys() -> None:
    assert identity_secret_key_hex(1) == "0" * 63 + "1"
    public = SecretKey.from_hex(identity_secret_key_hex(1)).public_key.hex()
    assert public == "4cb5abf6ad79fbf5abbccafcc269d85cd2651ed4b885b5869f241aedf0a5ba29"


def test_server_and_client_commands(tmp_path: Path) -> None:
    config = fast_config(tmp_path)
    (config / "data.toml").write_text("")
    plan = TestnetPlan(
        num_clients=3,
        config_path=config,
        run_id="r",
        server_port=20000,
        tui=False,
        first_client_checkpoint="me/repo",
        hf_token="tok",
        write_log_dir=Path("logs/x"),
        optim_stats=5,
        eval_tasks="hellaswag",
        events_dir=Path("ev"),
        python="/py",
        client_program=("psyche-client",),
    )
    server = plan.server_command()
    assert server.argv == (
        "/py", "-m", "psyche.cli.server", "run", "--state", str(config / "state.toml"),
        "--server-port", "20000", "--tui", "false", "--data-config", str(config / "data.toml"),
        "--events-dir", "ev",
    )  # fmt: skip
    assert server.env == (("RUST_LOG", "warn,psyche=info"),)  # debug only when asked
    first, second = plan.client_command(1), plan.client_command(2)
    assert dict(first.env) == {
        "HF_TOKEN": "tok",
        "RUST_LOG": "warn,psyche=info",
        "RUST_BACKTRACE": "1",
        "RAW_IDENTITY_SECRET_KEY": identity_secret_key_hex(1),
    }
    assert first.argv == (
        "psyche-client", "train", "--run-id", "r", "--server-addr", "localhost:20000",
        "--logs", "console", "--checkpoint-dir", "checkpoints", "--hub-repo", "me/repo",
        "--write-log", "logs/x/client-1.txt", "--optim-stats-steps", "5",
        "--eval-tasks", "hellaswag", "--events-dir", "ev",
    )  # fmt: skip
    # only the first client checkpoints (the run's final model is kept by default)
    assert "--hub-repo" not in second.argv
    assert "--checkpoint-dir" not in second.argv
    assert first.shell().startswith("HF_TOKEN=tok RUST_LOG=")
    assert "'warn,psyche=info'" not in first.shell()  # no quoting needed for this one
    tui = TestnetPlan(num_clients=1, config_path=config, run_id="r", python="/py")
    assert "--logs tui" in " ".join(tui.client_command(1).argv)
    assert tui.client_command(1).argv[-2:] == ("--checkpoint-dir", "checkpoints")
    elsewhere = TestnetPlan(
        num_clients=1, config_path=config, run_id="r", python="/py", checkpoint_dir=Path("m")
    )
    assert elsewhere.client_command(1).argv[-2:] == ("--checkpoint-dir", "m")
    nowhere = TestnetPlan(
        num_clients=1, config_path=config, run_id="r", python="/py", checkpoint_dir=None
    )
    assert "--checkpoint-dir" not in nowhere.client_command(1).argv


def test_each_client_gets_its_share_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 28: N clients on one machine each run torch on cores / N threads (at least one),
    not every core each; `--cpu-threads` overrides the share and 0 leaves torch's default."""
    monkeypatch.setattr(testnet_main, "available_cores", lambda: 2)
    assert [client_cpu_threads(None, n) for n in (1, 2, 3)] == [2, 1, 1]
    monkeypatch.setattr(testnet_main, "available_cores", lambda: 16)
    assert [client_cpu_threads(None, n) for n in (1, 3, 4, 32)] == [16, 5, 4, 1]
    assert client_cpu_threads(6, 3) == 6
    assert client_cpu_threads(0, 3) is None
    config = Path("config")
    capped = TestnetPlan(num_clients=3, config_path=config, run_id="r", cpu_threads=5)
    for number in (1, 2, 3):
        argv = capped.client_command(number).argv
        assert argv[argv.index("--cpu-threads") + 1] == "5"
    default = TestnetPlan(num_clients=3, config_path=config, run_id="r")
    assert "--cpu-threads" not in default.client_command(1).argv


def test_random_kill_choice_and_log_dir_name() -> None:
    rng = random.Random(4)
    for _ in range(20):
        victims = pick_victims([1, 2, 3, 4], [2, 4], 1, rng)
        assert len(victims) == 1
        assert victims[0] in (2, 4)
    assert sorted(pick_victims([1, 2, 3], [], 3, rng)) == [1, 2, 3]
    start = datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    assert log_dir_name(start) == "2025-01-02_03:04:05"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-clients", "0", "--config-path", "."], "NUM_CLIENTS must be a positive integer"),
        (["--num-clients", "2", "--config-path", "/no/such/dir"], "does not exist"),
        (["--num-clients", "x", "--config-path", "."], "NUM_CLIENTS must be a positive integer"),
    ],
)
def test_argument_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser()[0].parse_args(["start", *args])
    assert message in capsys.readouterr().err


def test_too_many_random_kills_is_refused(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "psyche.cli.local_testnet", "start", "--num-clients", "1",
         "--config-path", str(fast_config(tmp_path)), "--random-kill-num", "2", "--headless"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "You requested to kill 2 clients randomly, but you only have 1 clients." in result.stderr


# ---- headless --------------------------------------------------------------------------------


def read_until(
    process: subprocess.Popen[str], pattern: str, lines: list[str], timeout: float
) -> re.Match[str]:
    assert process.stdout is not None
    regex = re.compile(pattern)
    deadline = time.monotonic() + timeout
    for line in process.stdout:
        lines.append(line)
        match = regex.search(line)
        if match:
            return match
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"no line matching {pattern!r}:\n" + "".join(lines[-60:]))


def test_headless_runs_server_and_clients_and_stops_them_all(tmp_path: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "psyche.cli.local_testnet", "start", "--num-clients", "2",
         "--config-path", str(fast_config(tmp_path)), "--server-port", str(port), "--headless",
         "--write-log", "--random-kill-num", "1", "--random-kill-interval", str(round(scaled(2))),
         "--allowed-to-kill", "2", "--client-program", STANDIN_PROGRAM],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        read_until(process, r"\[client-1\] standin state=Warmup .*clients=2", lines, scaled(60))
        # client 2 is killed and started again with the same key
        read_until(process, r"\[testnet\] random kill: restarting client-2", lines, scaled(30))
        read_until(process, r"\[client-2\] standin got SIGINT", lines, scaled(30))
        read_until(process, r"\[client-2\] started \(pid", lines, scaled(30))
        read_until(process, r"\[client-2\] standin state=", lines, scaled(30))
    finally:
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=scaled(30))
    lines.append(out)
    text = "".join(lines)
    assert process.returncode == 0, text
    pids = [int(p) for p in re.findall(r"started \(pid (\d+)\)", text)]
    # server, two clients, one process per restart (a kill every 2 s can land again before
    # the test stops the testnet)
    restarts = text.count("[testnet] random kill: restarting client-2")
    assert restarts >= 1, text
    assert len(pids) == 3 + restarts == len(set(pids)), text
    assert not any(alive(pid) for pid in pids)
    keys = re.findall(r"\[client-2\] standin key=(\w+)", text)
    expected = SecretKey.from_hex(identity_secret_key_hex(2)).public_key.hex()
    assert len(keys) >= 2
    assert set(keys) == {expected}
    assert "[server] " in text
    assert "serving run 'testnet-test'" in text
    (log_dir,) = (tmp_path / "logs").iterdir()
    assert sorted(p.name for p in log_dir.iterdir()) == [
        "client-1.txt",
        "client-2.txt",
        "server.txt",
    ]
    assert "standin state=" in (log_dir / "client-1.txt").read_text()
    assert "serving run" in (log_dir / "server.txt").read_text()


def finishing_config(tmp_path: Path) -> Path:
    """FAST_STATE with one step and short timings: the run is Finished a few seconds in."""
    config = fast_config(tmp_path)
    text = (config / "state.toml").read_text()
    for key, value in (("warmup_time", 2), ("total_steps", 1)):
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
    (config / "state.toml").write_text(text)
    return config


def test_headless_ends_by_itself_when_the_run_finishes(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "psyche.cli.local_testnet", "start", "--num-clients", "2",
         "--config-path", str(finishing_config(tmp_path)), "--server-port", str(free_port()),
         "--headless", "--client-program", STANDIN_PROGRAM],
        cwd=tmp_path, capture_output=True, text=True, timeout=scaled(120),
    )  # fmt: skip
    text = result.stdout + result.stderr
    assert result.returncode == 0, text
    for number in (1, 2):
        assert f"[client-{number}] standin: the run is finished" in text
        assert f"[client-{number}] exited with code 0" in text
    assert "[server] exited with code 0" in text
    # the server's summary (the step counts from 1 in a state file: one step ends at step 2)
    assert "[server] " in text
    assert "run 'testnet-test' finished at step 2 of 1" in text
    last = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"\[testnet\] done in \d+s: the server and 2 clients exited 0; client-1 saved the "
        rf"model under {re.escape(str(tmp_path / 'checkpoints'))}",
        last,
    ), last
    pids = [int(p) for p in re.findall(r"started \(pid (\d+)\)", text)]
    assert len(pids) == 3
    assert not any(alive(pid) for pid in pids)


def test_headless_names_the_processes_that_failed(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "psyche.cli.local_testnet", "start", "--num-clients", "2",
         "--config-path", str(fast_config(tmp_path)), "--server-port", str(free_port()),
         "--headless", "--client-program", STANDIN_PROGRAM, "--client-args", "--exit-with 3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=scaled(120),
    )  # fmt: skip
    text = result.stdout + result.stderr
    assert result.returncode == 1, text
    assert result.stdout.strip().splitlines()[-1] == (
        "[testnet] the run did not end cleanly: server was stopped (it had not exited by "
        "itself); client-1 exited with code 3; client-2 exited with code 3"
    )


def test_headless_refuses_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "psyche.cli.local_testnet", "start", "--num-clients", "1",
             "--config-path", str(fast_config(tmp_path)), "--server-port", str(port),
             "--headless", "--client-program", STANDIN_PROGRAM],
            cwd=tmp_path, capture_output=True, text=True, timeout=scaled(60),
        )  # fmt: skip
    assert result.returncode == 1
    assert f"[testnet] error: port {port} (--server-port) is already in use" in result.stdout
    assert "started (pid" not in result.stdout


# ---- tmux ------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_tmux_panes_come_up(tmp_path: Path) -> None:
    socket_name = f"psyche-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "psyche.cli.local_testnet", "start", "--num-clients", "2",
             "--config-path", str(fast_config(tmp_path)), "--server-port", str(port),
             "--tui", "false", "--tmux-socket", socket_name, "--no-attach",
             "--client-program", STANDIN_PROGRAM],
            cwd=tmp_path, capture_output=True, text=True, timeout=scaled(90),
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        match = re.search(
            r"panes: server (%\d+), monitor (%\d+), clients (%\d+) (%\d+)", result.stdout
        )
        assert match, result.stdout
        server, monitor, *clients = match.groups()

        def capture(pane: str) -> str:
            return subprocess.run(
                ["tmux", "-L", socket_name, "capture-pane", "-p", "-J", "-t", pane, "-S", "-200"],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            panes = [capture(p) for p in clients]
            if all("state=Warmup" in p for p in panes):
                break
            time.sleep(0.5)
        assert all("standin state=Warmup" in p for p in panes), panes
        assert "serving run 'testnet-test'" in capture(server)
        layout = subprocess.run(
            ["tmux", "-L", socket_name, "list-panes", "-t", "psyche", "-F",
             "#{pane_id} #{pane_left} #{pane_top}"],
            capture_output=True, text=True, check=True,
        ).stdout.split("\n")  # fmt: skip
        where = {p: (int(x), int(y)) for p, x, y in (line.split() for line in layout if line)}
        assert where[server] == (0, 0)
        assert where[monitor][0] == 0
        assert where[monitor][1] > 0
        assert all(where[c][0] > 0 for c in clients)  # right column
        assert where[clients[0]][1] < where[clients[1]][1]
    finally:
        kill_tmux_server(socket_name)


@pytest.mark.skipif(
    shutil.which("tmux") is None or shutil.which("script") is None,
    reason="needs tmux and script (a terminal to attach from)",
)
def test_tmux_random_kill_retypes_the_same_command(tmp_path: Path) -> None:
    """The random kill sends Ctrl+C to client 1's pane every 2 s and types its command again.

    A kill can land while the retyped stand-in is still starting (the shell reading the line,
    Python importing: a KeyboardInterrupt traceback, no "standin got SIGINT"); on a busy machine
    the first kills often do. So the test does not assume the first kill hits a running
    stand-in: it waits, with a generous deadline, until one did and the same command (same key)
    ran again after it. It reads what happened from the stand-ins' journal, not from the pane:
    a narrow pane's redraws lost the restarted stand-in's first line (a flake on busy machines).
    """
    socket_name = f"psyche-test-{uuid.uuid4().hex[:8]}"
    command = " ".join(
        [sys.executable, "-m", "psyche.cli.local_testnet", "start", "--num-clients", "2",
         "--config-path", str(fast_config(tmp_path)), "--server-port", str(free_port()),
         "--tui", "false", "--tmux-socket", socket_name, "--random-kill-num", "1",
         "--random-kill-interval", str(round(scaled(2))), "--allowed-to-kill", "1",
         "--client-program", f"'{STANDIN_PROGRAM}'"]
    )  # fmt: skip
    key = SecretKey.from_hex(identity_secret_key_hex(1)).public_key.hex()
    journal = tmp_path / "standin-journal.log"

    def killed_and_back() -> bool:
        """Client 1's stand-in got SIGINT in its pane, then started again there."""
        lines = journal.read_text().split("\n")[:-1] if journal.exists() else []
        panes = {line.split()[2] for line in lines if line.startswith(f"start {key} ")}
        for pane in panes:
            events = [line.split()[0] for line in lines if line.endswith(f" {pane}")]
            if "SIGINT" in events and "start" in events[events.index("SIGINT") :]:
                return True
        return False

    # `script` gives the testnet a terminal, so it attaches and runs its random kills
    output = tmp_path / "testnet.out"
    with output.open("wb") as out:
        testnet = subprocess.Popen(
            ["script", "-qfec", command, "/dev/null"],
            cwd=tmp_path, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + scaled(120)
        while time.monotonic() < deadline and testnet.poll() is None and not killed_and_back():
            time.sleep(0.5)
        lines = journal.read_text().splitlines() if journal.exists() else []
        if not killed_and_back():
            said = output.read_bytes().decode(errors="replace")[-3000:]
            raise AssertionError(
                f"no kill and restart seen (testnet exit {testnet.poll()})\n"
                f"--- stand-in journal:\n{chr(10).join(lines)}\n--- testnet:\n{said}"
            )
        # every start in client 1's pane ran with client 1's key (the same command retyped)
        pane = next(line.split()[2] for line in lines if line.startswith(f"start {key} "))
        starts = [line.split()[1] for line in lines if line.startswith("start ")
                  and line.endswith(f" {pane}")]  # fmt: skip
        assert len(starts) >= 2, lines
        assert set(starts) == {key}, lines
    finally:
        kill_tmux_server(socket_name)
        try:
            testnet.wait(20)
        except subprocess.TimeoutExpired:
            testnet.kill()
            testnet.wait()
    assert testnet.returncode == 0
