"""Every `psyche-local-testnet start` flag, and what it hands on: each command line the testnet
builds parses with the real client's (and server's) parser and passes the client's own option
checks, so no client the testnet starts exits over a flag it was given."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from psyche.cli.client.main import build_parser as client_parser
from psyche.cli.local_testnet.main import build_parser, plan_from_args
from psyche.cli.server.main import build_parser as server_parser
from psyche.client.setup.options import TrainOptions

# A value for every flag of `start` (None: a switch); a new flag must be added here.
EVERY_FLAG: dict[str, str | None] = {
    "--num-clients": "2",
    "--config-path": "CONFIG",
    "--write-distro-data": "distro",
    "--server-port": "20000",
    "--tui": "false",
    "--random-kill-num": "1",
    "--allowed-to-kill": "1,2",
    "--random-kill-interval": "60",
    "--log": "warn,psyche=debug",
    "--first-client-checkpoint": "me/repo",
    "--hf-token": "token",
    "--write-log": None,
    "--wandb-project": "project",
    "--wandb-group": "group",
    "--wandb-entity": "entity",
    "--optim-stats": "5",
    "--eval-tasks": "piqa,arc_easy",
    "--events-dir": "events",
    "--eval-data-dir": "evals",
    "--metrics-dir": "metrics",
    "--tensorboard-dir": "tb",
    "--status-port": "20080",
    "--cpu-threads": "3",
    "--headless": None,
    "--tmux-socket": "sock",
    "--no-attach": None,
    "--client-program": "psyche-client",
    "--client-args": "--micro-batch-size 2",
    "--server-args": "--ban-epochs 0",
}


def start_flags(parser: argparse.ArgumentParser) -> set[str]:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    start = commands.choices["start"]
    return {
        s
        for action in start._actions
        for s in action.option_strings
        if s.startswith("--") and s not in ("--help", "--verbose")
    }


def test_every_flag_reaches_commands_the_client_and_server_accept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser, env = build_parser()
    assert start_flags(parser) == set(EVERY_FLAG)
    config = tmp_path / "config"
    config.mkdir()
    (config / "state.toml").write_text('run_id = "r"\n')
    (config / "data.toml").write_text("")
    argv = ["start"]
    for flag, value in EVERY_FLAG.items():
        argv += [flag] if value is None else [flag, str(config) if value == "CONFIG" else value]
    args = parser.parse_args(argv)
    env.resolve(parser, args)
    plan = plan_from_args(args, config, "r", headless=False, log_dir=tmp_path / "logs")

    server_args = server_parser()[0].parse_args(list(plan.server_command().argv[3:]))
    assert server_args.events_dir == Path("events")
    assert server_args.metrics_jsonl == Path("metrics/server.jsonl")
    assert server_args.status_port == 20080
    assert server_args.ban_epochs == 0

    # W&B writes offline without a key; the hub upload needs HF_TOKEN, as the testnet gives it
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    parser_, client_env = client_parser()
    for number in (1, 2):
        command = plan.client_command(number)
        for key, value in command.env:
            monkeypatch.setenv(key, value)
        parsed = parser_.parse_args(list(command.argv[1:]))
        client_env.resolve(parser_, parsed)
        options = TrainOptions.from_args(parsed)
        assert options.problems() == [], command.argv
        assert options.events_dir == Path("events")
        assert options.metrics_jsonl == Path(f"metrics/client-{number}.jsonl")
        assert options.tensorboard_dir == Path(f"tb/client-{number}")
        assert (options.eval_tasks, options.eval_data_dir) == ("piqa,arc_easy", Path("evals"))
        assert (options.wandb_project, options.wandb_group, options.wandb_entity) == (
            "project",
            "group",
            "entity",
        )
        assert options.optim_stats_steps == 5
        assert options.micro_batch_size == 2
        assert options.cpu_threads == 3
        assert options.write_gradients_dir == Path("distro")
        assert options.logs == "console"  # --tui false
        assert options.write_log == tmp_path / "logs" / f"client-{number}.txt"
        assert (options.hub_repo is not None) == (number == 1)
