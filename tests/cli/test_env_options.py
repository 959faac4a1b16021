"""The argparse pieces every command shares (`psyche.core.cli`): options that fall back to the
environment, the value parsers, the subcommand parser, and `RUST_LOG`-style log levels."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator

import pytest

from psyche.core.cli import (
    EnvOptions,
    apply_log_directives,
    command_env,
    command_parser,
    log_directives_from_environment,
    parse_bool,
    parse_command,
    parse_unsigned,
)


def parser_with_options() -> tuple[argparse.ArgumentParser, EnvOptions]:
    parser, commands = command_parser("prog", "what it does")
    run = commands.add_parser("run")
    env = EnvOptions()
    env.add(run, "--port", short="-p", parse=parse_unsigned(16), default=8, help="Port")
    env.add(run, "--name", required=True, help="Name")
    env.add(run, "--fast", flag_only=True, parse=parse_bool, default=False, help="Fast")
    env.add(run, "--tui", optional_value=True, parse=parse_bool, default=True, help="Dashboard")
    return parser, env


def parse(argv: list[str]) -> argparse.Namespace:
    parser, env = parser_with_options()
    args = parser.parse_args(argv)
    env.resolve(parser, args)
    return args


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PORT", "NAME", "FAST", "TUI", "PSYCHE_LOG", "RUST_LOG"):
        monkeypatch.delenv(name, raising=False)


def test_the_command_line_wins_then_the_environment_then_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = parse(["run", "--name", "a"])
    assert (args.port, args.name, args.fast, args.tui) == (8, "a", False, True)
    monkeypatch.setenv("PORT", "9")
    monkeypatch.setenv("NAME", "b")
    monkeypatch.setenv("FAST", "yes")
    monkeypatch.setenv("TUI", "false")
    args = parse(["run"])
    assert (args.port, args.name, args.fast, args.tui) == (9, "b", True, False)
    args = parse(["run", "-p", "10", "--name", "c", "--tui"])
    assert (args.port, args.name, args.tui) == (10, "c", True)
    monkeypatch.setenv("PORT", "")  # empty is unset, as clap
    assert parse(["run"]).port == 8


def test_parse_command_fills_in_the_environment_of_the_command_it_names(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    parser, commands = command_parser("prog", "what it does")
    run, relay = commands.add_parser("run"), commands.add_parser("relay")
    command_env(run).add(run, "--name", required=True, help="Name")
    command_env(relay).add(relay, "--port", parse=parse_unsigned(16), default=8, help="Port")
    monkeypatch.setenv("PORT", "9")
    assert parse_command(parser, ["relay"]).port == 9
    assert parse_command(parser, ["relay", "--port", "10"]).port == 10
    # `relay`'s environment is not read for `run`, and `run`'s required option is its error
    with pytest.raises(SystemExit):
        parse_command(parser, ["run"])
    assert "prog run: error: the following arguments are required: --name (or NAME)" in (
        capsys.readouterr().err
    )
    monkeypatch.setenv("NAME", "a")
    args = parse_command(parser, ["run"])
    assert args.name == "a"
    assert not hasattr(args, "port")


def test_errors_name_the_flag_and_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as missing:
        parse(["run"])
    assert missing.value.code == 2
    assert "required: --name (or NAME)" in capsys.readouterr().err
    monkeypatch.setenv("PORT", "70000")
    with pytest.raises(SystemExit):
        parse(["run", "--name", "a"])
    assert "environment variable PORT: 70000 is out of range 0..=65535" in capsys.readouterr().err
    monkeypatch.delenv("PORT")
    with pytest.raises(SystemExit):
        parse(["run", "--name", "a", "--tui", "maybe"])
    assert "expected true or false, found 'maybe'" in capsys.readouterr().err


def test_help_names_the_variable_and_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    parser, _ = parser_with_options()
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "-p <PORT>, --port <PORT> Port [env: PORT] [default: 8]" in text
    assert "--name <NAME> Name [env: NAME]" in text
    assert "--fast Fast [env: FAST]" in text  # a False default is not shown
    assert "Dashboard [env: TUI] [default: true]" in text
    with pytest.raises(SystemExit) as no_command:
        parser.parse_args([])
    assert no_command.value.code == 2
    assert "<COMMAND>" in capsys.readouterr().err


def test_value_parsers() -> None:
    assert [parse_bool(t) for t in ("true", "1", "YES", " on ")] == [True] * 4
    assert [parse_bool(t) for t in ("false", "0", "No", "off")] == [False] * 4
    u8 = parse_unsigned(8)
    assert (u8("0"), u8("255"), u8.__name__) == (0, 255, "u8")
    for bad, message in (("256", "out of range 0..=255"), ("-1", "out of range"), ("x", "integer")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            u8(bad)


@pytest.fixture
def loggers() -> Iterator[None]:
    names = [None, "psyche", "psyche.client", "foo.bar"]
    levels = {n: logging.getLogger(n).level for n in names}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.usefixtures("loggers")
def test_log_directives(monkeypatch: pytest.MonkeyPatch) -> None:
    apply_log_directives("warn, psyche.client=debug,foo::bar=error,psyche_client::x=info,y=loud")
    assert logging.getLogger().level == logging.WARNING
    assert logging.getLogger("psyche.client").level == logging.DEBUG
    assert logging.getLogger("foo.bar").level == logging.ERROR
    assert logging.getLogger("psyche").level == logging.INFO  # an upstream crate: the package
    apply_log_directives("psyche=off")
    assert not logging.getLogger("psyche").isEnabledFor(logging.CRITICAL)
    assert log_directives_from_environment() == ""
    monkeypatch.setenv("RUST_LOG", "debug")
    assert log_directives_from_environment() == "debug"
    monkeypatch.setenv("PSYCHE_LOG", "info")
    assert log_directives_from_environment() == "info"
