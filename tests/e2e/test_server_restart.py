"""Issue test 4: the server is stopped in the middle of training and restarted from its
--save-state-dir; the run resumes at the saved step and the same clients carry on training.

The clients are real `psyche-client train` processes on the tiny model. They must outlive the
server (reconnect and join again, keeping their model in memory): see docs/centralized.md,
"Saving and resuming".
"""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from psyche.centralized.save_state import load_state, saved_run_identity
from psyche.coordinator import RunState
from psyche.coordinator.model import Checkpoint

from ..timing import scaled

pytestmark = pytest.mark.slow

ROUND_TRAIN = r"run state: \w+ -> RoundTrain \(epoch (\d+), step (\d+), (\d+) clients\)"


def server_command(config: Path, port: int, saves: Path, state: Path | None = None) -> list[str]:
    return [
        sys.executable, "-m", "psyche.cli.server", "run",
        "--state", str(state or config / "state.toml"), "--data-config", str(config / "data.toml"),
        "--server-port", str(port), "--tui", "false", "--save-state-dir", str(saves),
    ]  # fmt: skip


def client_command(port: int) -> list[str]:
    return [
        sys.executable, "-m", "psyche.cli.client", "train", "--run-id", "tiny-cpu",
        "--server-addr", f"127.0.0.1:{port}", "--logs", "console", "--device", "cpu",
    ]  # fmt: skip


def test_server_restart_resumes_at_the_saved_step(
    tiny_run: Callable[..., Path], processes: Any, free_port: Callable[[], int], tmp_path: Path
) -> None:
    # epoch 0 holds the eight rounds before the stop (~2 s each) with room to spare; the resumed
    # epoch 1 runs as long before the cooldown the test waits for, so no longer than that
    config = tiny_run(epoch_time=30)
    saves = tmp_path / "saves"
    port = free_port()
    server = processes.start("server-1", server_command(config, port, saves))
    processes.wait_for(server, r"serving run 'tiny-cpu'", 60)
    clients = [
        processes.start(
            f"client-{n}", client_command(port), env={"RAW_IDENTITY_SECRET_KEY": f"{n:064x}"}
        )
        for n in (1, 2)
    ]
    # eight rounds of training: enough for the loss to have left its starting value
    after, rounds = 0, 0
    while rounds < 8:
        match = processes.wait_for(server, ROUND_TRAIN, 90, after=after)
        after, rounds = match.end(), rounds + 1
    killed_at_step = int(match.group(2))
    assert int(match.group(1)) == 0
    assert killed_at_step >= 8

    # stop the server mid-round: it saves the run as if the epoch had ended there
    processes.signal(server, signal.SIGTERM)
    assert server.popen.wait(scaled(30)) == 0, server.text()[-3000:]
    assert "Saved state to" in server.text()
    saved = load_state(saves)
    assert saved.run_state is RunState.WaitingForMembers
    assert saved.progress.step == killed_at_step
    assert saved.progress.epoch == 1
    assert isinstance(saved.model.value.checkpoint, Checkpoint.P2P)  # type: ignore[attr-defined]
    ids = sorted(c.id.signer.hex() for c in saved.epoch_state.clients)
    assert len(ids) == 2
    # the run's identity (its clients' checkpoints name it) is saved beside the state
    identity = saved_run_identity(saves / (saves / "latest").read_text().strip())
    assert identity is not None

    # the clients notice and keep reconnecting (`--server-reconnect-timeout`, 120 s by default);
    # a client that exits instead cannot carry on, and that is a failure of this test
    for client in clients:
        processes.wait_for(client, r"lost the coordinator server .*; reconnecting for up to", 60)
        assert client.popen.poll() is None, client.text()[-3000:]

    restarted = processes.start("server-2", server_command(config, port, saves, state=saves))
    resumed = processes.wait_for(
        restarted, r"resuming run 'tiny-cpu' from .*: epoch (\d+), step (\d+)", 60
    )
    assert (int(resumed.group(1)), int(resumed.group(2))) == (1, killed_at_step)
    again = processes.wait_for(restarted, ROUND_TRAIN, 90)
    assert (int(again.group(1)), int(again.group(2)), int(again.group(3))) == (1, killed_at_step, 2)
    processes.wait_for(
        restarted, r"run state: RoundWitness -> RoundTrain \(epoch 1, step (\d+)", 60
    )
    # both clients trained after the restart, continuing from the step they had reached and
    # from the model they held (a model loaded afresh would start again at the first loss)
    first, resumed_losses = [], []
    for client in clients:
        text = client.text()
        losses = {
            (int(e), int(s)): float(v)
            for s, e, v in re.findall(r"step (\d+)/\d+ \(epoch (\d+)\): loss ([\d.]+)", text)
        }
        first.append(losses[(0, 1)])
        after_restart = {s: v for (e, s), v in losses.items() if e == 1}
        assert after_restart, text[-3000:]
        assert min(after_restart) >= killed_at_step, text[-3000:]
        resumed_losses.extend(after_restart.values())
    assert max(resumed_losses) < min(first) - 0.15, (first, resumed_losses)
    # and they end the resumed epoch with the same model (the hash each logs at its cooldown)
    hashes = {
        processes.wait_for(client, r"epoch 1 ended at step \d+: model hash (\w+)", 120).group(1)
        for client in clients
    }
    assert len(hashes) == 1, hashes
    # the resumed server ran the same instance of the run: it kept the saved identity
    processes.signal(restarted, signal.SIGTERM)
    assert restarted.popen.wait(scaled(30)) == 0, restarted.text()[-3000:]
    assert saved_run_identity(saves / (saves / "latest").read_text().strip()) == identity
