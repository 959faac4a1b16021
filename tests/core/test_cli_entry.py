"""`psyche.core.cli`, the entry point of every command: exit codes, one-line user errors,
tracebacks only for bugs or with --verbose, and SIGINT/SIGTERM that stop a process which
started with SIGINT ignored (real processes; every wait is bounded)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from psyche.core.cli import (
    EXIT_SIGINT,
    EXIT_SIGTERM,
    HelpFormatter,
    UsageError,
    UserError,
    add_verbose_flag,
    error_line,
    run_command,
    single_cause,
)

# -- in-process: exit codes and messages


def test_a_user_error_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    def main(argv: Sequence[str] | None) -> int:
        raise UserError("cannot connect to the coordinator at localhost:1: connection refused")

    assert run_command("psyche-x", main, []) == 1
    err = capsys.readouterr().err
    assert err == (
        "psyche-x: error: cannot connect to the coordinator at localhost:1: connection refused\n"
    )


def test_usage_errors_exit_2_and_exit_codes_can_be_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def usage(argv: Sequence[str] | None) -> int:
        raise UsageError("--peers needs --distro")

    def versioned(argv: Sequence[str] | None) -> int:
        raise UserError("version mismatch", exit_code=10)

    assert run_command("p", usage, []) == 2
    assert run_command("p", versioned, []) == 10
    assert capsys.readouterr().err.splitlines() == [
        "p: error: --peers needs --distro",
        "p: error: version mismatch",
    ]


def test_a_missing_file_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nothing.toml"

    def main(argv: Sequence[str] | None) -> int:
        missing.read_text()
        return 0

    assert run_command("p", main, []) == 1
    assert capsys.readouterr().err == f"p: error: {missing}: No such file or directory\n"


def test_a_bug_prints_its_traceback_and_says_it_is_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def main(argv: Sequence[str] | None) -> int:
        return {}["missing"]  # type: ignore[no-any-return]

    assert run_command("p", main, []) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.splitlines()[-1].startswith("p: error: unexpected KeyError: 'missing' (a bug in p")


def test_verbose_flag_and_environment_add_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def main(argv: Sequence[str] | None) -> int:
        parser = argparse.ArgumentParser(prog="p")
        sub = parser.add_subparsers(dest="command", required=True)
        sub.add_parser("run")
        add_verbose_flag(parser)
        parser.parse_args(argv)
        raise UserError("bad input")

    monkeypatch.delenv("PSYCHE_VERBOSE", raising=False)
    for argv in (["run"], ["run", "--verbose"], ["-v", "run"]):
        assert run_command("p", main, argv) == 1
        err = capsys.readouterr().err
        assert err.endswith("p: error: bad input\n")
        assert ("Traceback" in err) == (argv != ["run"]), argv
    monkeypatch.setenv("PSYCHE_VERBOSE", "1")
    assert run_command("p", main, ["run"]) == 1
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("PSYCHE_VERBOSE", "0")
    assert run_command("p", main, ["run"]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_argparse_exits_pass_through_and_return_values_are_exit_codes() -> None:
    def main(argv: Sequence[str] | None) -> int:
        argparse.ArgumentParser(prog="p").parse_args(argv)
        return 3

    with pytest.raises(SystemExit) as info:
        run_command("p", main, ["--nope"])
    assert info.value.code == 2
    assert run_command("p", main, []) == 3
    assert run_command("p", lambda argv: None, []) == 0  # type: ignore[arg-type,return-value]


def test_messages_and_causes() -> None:
    assert error_line("p", "two\nlines") == "p: error: two; lines"
    inner = UserError("the real one")
    group = BaseExceptionGroup("outer", [BaseExceptionGroup("inner", [inner])])
    assert single_cause(group) is inner
    mixed = BaseExceptionGroup("g", [KeyboardInterrupt(), inner])
    assert single_cause(mixed) is inner
    assert isinstance(
        single_cause(BaseExceptionGroup("g", [KeyboardInterrupt()])), KeyboardInterrupt
    )


def test_previous_signal_handlers_are_restored() -> None:
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    seen = []

    def main(argv: Sequence[str] | None) -> int:
        seen.append((signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)))
        return 0

    assert run_command("p", main, []) == 0
    assert seen[0][0] is signal.default_int_handler
    assert callable(seen[0][1])
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_root_logging_is_restored() -> None:
    root = logging.getLogger()
    before = (list(root.handlers), root.level)

    def main(argv: Sequence[str] | None) -> int:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.addHandler(logging.StreamHandler(sys.stderr))
        root.setLevel(logging.DEBUG)
        return 0

    assert run_command("p", main, []) == 0
    assert (list(root.handlers), root.level) == before


def test_help_shows_defaults() -> None:
    parser = argparse.ArgumentParser(prog="p", formatter_class=HelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="steps to train")
    parser.add_argument("--name", help="no default shown for None")
    parser.add_argument("--flag", action="store_true", help="no default shown for False")
    parser.add_argument("--port", default=1, help="Port [default: 1]")
    text = " ".join(parser.format_help().split())
    assert "steps to train (default: 200)" in text
    assert "no default shown for None --flag" in text
    assert "no default shown for False --port" in text
    assert "[default: 1] (default" not in text


# -- real processes: signals, however the process was started

# A command that waits (in trio, or in plain Python) until it is stopped, prints "ready" first
# and "cleanup ran" from its `finally`.
COMMAND = textwrap.dedent(
    """
    import sys, time
    import trio
    from psyche.core.cli import run_command

    def main(argv):
        try:
            print("ready", flush=True)
            if argv[0] == "trio":
                trio.run(trio.sleep_forever)
            else:
                while True:
                    time.sleep(0.05)
        finally:
            print("cleanup ran", flush=True)

    sys.exit(run_command("waiter", main, sys.argv[1:]))
    """
)


SHOW_SIGINT = "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], Path]:
    log = tmp_path / f"{mode}.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", COMMAND, mode],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            preexec_fn=_ignore_sigint,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return process, log


def _wait_ready(process: subprocess.Popen[str], log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while "ready" not in log.read_text():
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"not ready in {timeout} s: {log.read_text()}"
        time.sleep(0.05)


def test_the_harness_really_starts_processes_with_sigint_ignored() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SHOW_SIGINT],
        preexec_fn=_ignore_sigint,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.strip() == "True"


@pytest.mark.parametrize("mode", ["trio", "plain"])
@pytest.mark.parametrize(
    ("signum", "code", "name"),
    [(signal.SIGINT, EXIT_SIGINT, "SIGINT"), (signal.SIGTERM, EXIT_SIGTERM, "SIGTERM")],
)
def test_a_signal_stops_a_command_that_started_with_sigint_ignored(
    tmp_path: Path, mode: str, signum: int, code: int, name: str
) -> None:
    process, log = _start(tmp_path, mode)
    try:
        _wait_ready(process, log)
        process.send_signal(signum)
        assert process.wait(60) == code, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    assert "cleanup ran" in text
    assert text.splitlines()[-1] == f"waiter: interrupted by {name}; stopped"
    assert "Traceback" not in text


NATIVE_THREAD_STUCK = """
import logging, sys, threading, time
from psyche.core.cli import run_command, skip_finalization

logging.basicConfig(level=logging.INFO, format="%(message)s")

def main(argv):
    # stands in for a collective that waits on a dead rank: a thread that never ends
    threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
    logging.getLogger("x").info("the rank died; stopping")
    print("said before exiting", end="")  # no newline: only a flush gets it out
    skip_finalization()
    return 3

sys.exit(run_command("prog", main))
"""


def test_a_process_that_cannot_finalize_still_exits_with_its_status() -> None:
    """A command left with a thread that never ends (as a collective waiting on a dead rank) asks
    for `skip_finalization`: it exits at once with its status, its output flushed (a plain exit
    would wait for the thread forever; torch.distributed's would abort with SIGABRT)."""
    done = subprocess.run(
        [sys.executable, "-c", NATIVE_THREAD_STUCK], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done
    assert done.stdout == "said before exiting"
    assert "the rank died; stopping" in done.stderr
