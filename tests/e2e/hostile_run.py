"""A run of real client processes on loopback with one hostile member (tests/e2e/hostile_client.py
beside honest `psyche-client train` processes), shared by the end-to-end tests of hostile
results (test_poisoned_members.py, test_verifiers.py)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..processes import REPO, Proc, Processes, events, free_port

sys.path.insert(0, str(REPO / "scripts" / "chaos"))
import hostile_members as hm

HONEST = (1, 2, 3)
HOSTILE = 4
HOSTILE_SCRIPT = REPO / "tests" / "e2e" / "hostile_client.py"


def short_id(number: int) -> str:
    """How the logs name client `number` (`RAW_IDENTITY_SECRET_KEY` = `number`)."""
    return hm.test_key(number).public_key[:4].hex()


@dataclass(frozen=True)
class HostileRun:
    server: Proc
    honest: list[Proc]
    hostile: Proc


def start_hostile_run(
    processes: Processes,
    directory: Path,
    attack: str,
    start: int,
    hostile_env: dict[str, str] | None = None,
    *,
    config_lines: str = "",
    **config: int,
) -> HostileRun:
    """The tiny run (`config` over its `[config]`, `config_lines` appended to it) with clients
    `HONEST` and `HOSTILE`, the hostile one sending what `attack` makes of its results from its
    `start`th on (and with `hostile_env` in its environment); returns once the first round
    started."""
    run = hm.write_run(directory, **config)
    if config_lines:
        state = run / "state.toml"
        text = state.read_text()
        assert "[config]\n" in text, "the run's state.toml has no [config] table to extend"
        state.write_text(text.replace("[config]\n", f"[config]\n{config_lines}\n", 1))
    port = free_port()
    server = processes.start("server", hm.server_command(run, port, "--bind-address", "127.0.0.1"))
    processes.wait_for(server, r"serving run 'tiny-cpu'", 60)
    honest = [
        processes.start(
            f"client-{n}", hm.client_command(port), env={"RAW_IDENTITY_SECRET_KEY": f"{n:064x}"}
        )
        for n in HONEST
    ]
    hostile_argv = [sys.executable, str(HOSTILE_SCRIPT), attack, str(start), "--"]
    hostile = processes.start(
        "hostile", hostile_argv + hm.client_command(port)[3:],
        env={"RAW_IDENTITY_SECRET_KEY": f"{HOSTILE:064x}", **(hostile_env or {})},
    )  # fmt: skip
    processes.wait_for(server, r"-> RoundTrain \(epoch 0", 240)
    return HostileRun(server, honest, hostile)


@dataclass(frozen=True)
class Punished:
    """Who lost a verifying run's dispute (`start_verifying_run`): the hostile member, as `role`
    ("trainer" or "verifier") at `step`; its committees by step."""

    run: HostileRun
    role: str
    step: int
    committees: dict[int, str]


def start_verifying_run(processes: Processes, directory: Path, config_lines: str = "") -> Punished:
    """The tiny run at `verification_percent = 25` (each round one tie-breaker, one verifier, two
    trainers), the hostile member sign-flipping its results and accusing every result it
    verifies; returns once the server punished it, checked to be for what it was that round."""
    run = start_hostile_run(
        processes, directory, "sign-flip", 0, {"HOSTILE_VERIFIER": "1"},
        config_lines=config_lines,
        total_steps=20, epoch_time=60, witness_nodes=0, init_min_clients=4, min_clients=3,
        verification_percent=25,
    )  # fmt: skip
    punished = processes.wait_for(
        run.server,
        rf"verification: {short_id(HOSTILE)} loses \((trainer|verifier)\).*? at step (\d+)",
        240,
    )
    role, step = punished.group(1), int(punished.group(2))
    committees = {e["step"]: e["committee"] for e in events(run.hostile, "round_start")}
    assert committees[step] == role.capitalize(), (role, step, committees)
    return Punished(run, role, step, committees)
