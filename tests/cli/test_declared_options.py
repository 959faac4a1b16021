"""The server's and the Solana client's options are declared once, in their libraries: what a
command parses is the options object Python code builds with the same values, defaults
included, and the environment fills what the command line leaves out (`psyche.core.cli`
`env_option`/`nested`, `psyche.solana.commands.args.arg`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from psyche.centralized.options import ServerRunOptions, StandaloneRelayOptions
from psyche.cli.server.main import build_parser as server_parser
from psyche.cli.solana_client.main import COMMANDS
from psyche.cli.solana_client.main import build_parser as solana_parser
from psyche.coordinator import server_core
from psyche.core.cli import options_from_args, parse_command
from psyche.solana.commands.args import ClusterOptions, ProgramIdOptions
from psyche.solana.commands.authorization import JoinAuthorizationSetDelegatesOptions
from psyche.solana.commands.results import DownloadResultsOptions
from psyche.solana.commands.run import CreateRunOptions, TickOptions
from psyche.solana.commands.view import ShowOptions
from psyche.solana.localnet.__main__ import LocalnetOptions

ENVIRONMENT = (
    "STATE", "SERVER_PORT", "TUI", "BAN_EPOCHS", "OPEN", "RPC", "WS_RPC", "RUN_ID",
    "CLIENT_VERSION", "TREASURER_INDEX", "WALLET_PRIVATE_KEY_PATH", "MS_INTERVAL", "COUNT",
    "OUTPUT_DIR", "DELEGATES_ADDED", "JOIN_AUTHORITY", "PSYCHE_COORDINATOR_PROGRAM_ID",
)  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)


def server(argv: list[str]) -> Any:
    args = parse_command(server_parser()[0], argv)
    return options_from_args(ServerRunOptions if argv[0] == "run" else StandaloneRelayOptions, args)


def solana(argv: list[str]) -> Any:
    args = solana_parser().parse_args(argv)
    command = next(c for c in COMMANDS if args.command in (c.name, *c.aliases))
    return command.options_from(args)


def test_the_server_parses_the_options_python_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    assert server(["run", "--state", "s.toml"]) == ServerRunOptions(state=Path("s.toml"))
    monkeypatch.setenv("SERVER_PORT", "7000")  # the environment fills in, the flag wins
    parsed = server(["run", "--state", "s", "--tui", "false", "--ban-epochs", "0"])
    assert parsed == ServerRunOptions(state=Path("s"), server_port=7000, tui=False, ban_epochs=0)
    assert server(["run", "--state", "s", "-s", "1"]).server_port == 1
    # the server's default ban is the coordinator rules' (named apart so that --help stays light)
    assert ServerRunOptions(state=Path("s")).ban_epochs == server_core.DEFAULT_BAN_EPOCHS
    assert server(["relay"]) == StandaloneRelayOptions()
    monkeypatch.setenv("OPEN", "true")
    assert server(["relay", "--max-reservations", "8"]) == StandaloneRelayOptions(
        open=True, max_reservations=8
    )


def test_the_solana_client_parses_the_options_python_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert solana(["create-run", "-r", "r", "-c", "v"]) == CreateRunOptions(
        run_id="r", client_version="v"
    )
    assert solana(["show", "-r", "r"]) == ShowOptions(run_id="r")
    assert solana(["json-dump-run", "-r", "r"]) == ShowOptions(run_id="r", json=True)
    assert solana(["download-results", "-r", "r"]) == DownloadResultsOptions(run_id="r")
    assert solana(["localnet"]) == LocalnetOptions()
    delegates = JoinAuthorizationSetDelegatesOptions(join_authority="j", delegates_added=[])
    assert solana(["join-authorization-set-delegates", "--join-authority", "j"]) == delegates

    # the environment replaces a default and makes a required argument optional
    monkeypatch.setenv("RPC", "http://cluster:8899")
    monkeypatch.setenv("RUN_ID", "from-env")
    monkeypatch.setenv("COUNT", "3")
    monkeypatch.setenv("DELEGATES_ADDED", "a b")
    monkeypatch.setenv("PSYCHE_COORDINATOR_PROGRAM_ID", "ignored-here")  # read when used
    cluster = ClusterOptions(rpc="http://cluster:8899", ids=ProgramIdOptions())
    tick = solana(["tick", "--coordinator-program-id", "C", "-w", "w.json"])
    assert tick == TickOptions(
        cluster=ClusterOptions(rpc=cluster.rpc, ids=ProgramIdOptions(coordinator_program_id="C")),
        wallet_private_key_path=Path("w.json"),
        run_id="from-env",
        count=3,
    )
    parsed = solana(["join-authorization-set-delegates", "--join-authority", "j"])
    assert list(parsed.delegates_added) == ["a", "b"]
    assert parsed.cluster == cluster
