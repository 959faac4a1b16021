"""The entry point every `psyche-*` command goes through: signals, exit codes, one-line errors.

    def main(argv: Sequence[str] | None = None) -> int:
        return run_command("psyche-client", _main, argv)

What it guarantees, however the command was started:

* **SIGINT** stops it, even when the process started with SIGINT ignored (a background job of a
  non-interactive shell, `nohup`, a test harness started from such a script): Python keeps an
  inherited SIG_IGN, and trio only takes SIGINT over when the handler is Python's default one,
  so that handler is installed explicitly. Ctrl-C raises KeyboardInterrupt (trio cancels the
  run and raises it out of `trio.run`), cleanups run (children are stopped, files closed) and
  the command exits **130**.
* **SIGTERM** takes the same path: it is re-raised as SIGINT, so the same cleanups run, and the
  command exits **143** (128 + 15, what a shell reports for a process SIGTERM ended).
  Commands whose job is to serve until stopped (`psyche-server run`, `psyche-server relay`,
  `psyche-local-testnet`) receive both signals themselves (`trio.open_signal_receiver`, then
  `serve_until_signalled`) and exit 0.
* A **`UserError`** (something the user caused and can fix: an unreachable address, a missing
  file, a malformed key) is one line on stderr, `<prog>: error: <message>`, exit 1;
  `UsageError` exits 2, as argparse's usage errors do. So is a file-system error naming a file
  (`FileNotFoundError`, `PermissionError`, ...). The traceback is printed too only when asked
  for: `--verbose`/`-v` (`add_verbose_flag`) or `PSYCHE_VERBOSE=1`, the same in every command.
* **Any other exception is a bug**: its traceback, then one line saying so, exit 1.
* `--help` shows every option's default (`HelpFormatter`).
* A process left with native threads nothing can stop (a torch.distributed collective waiting
  on a rank that died) calls `skip_finalization`: it then ends with its status through
  `os._exit` after flushing logs, instead of aborting in the interpreter's finalization.

The argparse pieces every command shares live here too: `command_parser` (a command with
subcommands; `commands_parser` and `run_commands` declare and run them from a table of
`Command`s), `EnvOptions` (options that fall back to the environment, as upstream's clap
`env`), options declared as the fields of a dataclass (`env_option`, `nested`; `add_options`
puts them on a parser and `options_from_args` builds the dataclass back, so that a library
owns its command's options and the command only parses), the value parsers `parse_bool` and
`parse_unsigned`, and `apply_log_directives` (`RUST_LOG`-style levels).

The signal handlers and the root logger's handlers in place before `run_command` are restored
when it returns, so calling a command's `main` in-process (tests) leaves the caller as it was. Nothing here is third-party.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import MISSING, Field, dataclass, field, fields
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar

if TYPE_CHECKING:
    import trio
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

VERBOSE_ENV = "PSYCHE_VERBOSE"
EXIT_USER_ERROR = 1
EXIT_USAGE = 2
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM

# File-system errors that name their file: the user pointed at something that is not there or
# not theirs.
_FILE_ERRORS = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)


class UserError(Exception):
    """A problem the user caused and can fix; its message is the whole story, one line.

    Library code raises it (or a subclass) where the cause is the user's input or environment,
    so every command reports it the same way. `exit_code` is the process's exit status (the
    class's, or the one given)."""

    exit_code: int = EXIT_USER_ERROR

    def __init__(self, *args: object, exit_code: int | None = None) -> None:
        super().__init__(*args)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(UserError):
    """A command line that cannot work (conflicting or unsupported options): exit 2."""

    exit_code = EXIT_USAGE


class _State:
    verbose = False
    terminated = False  # the interrupt being handled came from SIGTERM
    skip_finalization = False  # see `skip_finalization`


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """`--help` with descriptions as written and every option's default: an option whose
    default is a value (not None, False or suppressed) and whose help does not already name
    it ends with `(default: ...)`."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            default is None
            or default is False
            or default is argparse.SUPPRESS
            or default == []
            or "default" in text.lower()
            or not (action.option_strings or action.nargs in (argparse.OPTIONAL, "*"))
        ):
            return text
        return f"{text} (default: %(default)s)".strip()


def command_parser(
    prog: str, description: str
) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction[argparse.ArgumentParser]]:
    """A command's parser (description as written, defaults shown) and its required
    `<COMMAND>` subcommands, to which the caller adds its commands (then `add_verbose_flag`)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=HelpFormatter
    )
    commands = parser.add_subparsers(dest="command", metavar="<COMMAND>", required=True)
    return parser, commands


# --------------------------------------------------------------------------------------------
# Options with environment fallbacks


def parse_bool(text: str) -> bool:
    """`true`/`false` (also 1/0, yes/no, on/off, any case), as clap's bool values."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, found {text!r}")


def parse_unsigned(bits: int) -> Callable[[str], int]:
    """A parser of a decimal `u<bits>` (named so in argparse's messages)."""
    top = (1 << bits) - 1

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, found {text!r}") from None
        if not 0 <= value <= top:
            raise argparse.ArgumentTypeError(f"{value} is out of range 0..={top}")
        return value

    parse.__name__ = f"u{bits}"
    return parse


def env_name(flag: str) -> str:
    """The environment variable of a flag: its upper snake case (`--run-id` -> `RUN_ID`)."""
    return flag.lstrip("-").replace("-", "_").upper()


@dataclass(frozen=True)
class _EnvOption:
    dest: str
    flag: str
    env: str
    parse: Callable[[str], Any]
    default: Any
    required: bool


class EnvOptions:
    """Options whose values missing from the command line come from the environment under
    their upper-snake name, then from their default (upstream's clap `env`); the command line
    wins. `add` puts an option on a parser (its help ends with `[env: NAME]` and, when it has
    one, `[default: value]`, as clap shows them); `resolve` fills the parsed namespace once
    the command line is parsed: an unparsable variable or a missing required option is a usage
    error naming both the flag and the variable."""

    def __init__(self) -> None:
        self._options: list[_EnvOption] = []

    def add(
        self,
        parser: argparse.ArgumentParser,
        flag: str,
        *,
        short: str | None = None,
        parse: Callable[[str], Any] = str,
        default: Any = None,
        required: bool = False,
        flag_only: bool = False,
        optional_value: bool = False,
        metavar: str | None = None,
        help: str = "",
    ) -> None:
        """`flag_only`: a switch (`--flag` sets True; the variable is parsed with `parse`);
        `optional_value`: `--flag` alone means True, `--flag VALUE` parses VALUE."""
        dest = flag.lstrip("-").replace("-", "_")
        env = env_name(flag)
        text = f"{help} [env: {env}]"
        if default is not None and default is not False:
            shown = str(default).lower() if isinstance(default, bool) else default
            text += f" [default: {shown}]"
        kwargs: dict[str, Any] = {"dest": dest, "default": None, "help": text.strip()}
        if flag_only:
            kwargs["action"] = "store_const"
            kwargs["const"] = True
        else:
            kwargs["type"] = parse
            kwargs["metavar"] = metavar or f"<{dest.upper()}>"
            if optional_value:
                kwargs["nargs"] = "?"
                kwargs["const"] = True
        names = [short, flag] if short else [flag]
        parser.add_argument(*names, **kwargs)
        self._options.append(_EnvOption(dest, flag, env, parse, default, required))

    def resolve(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        for option in self._options:
            if getattr(args, option.dest, None) is not None:
                continue
            raw = os.environ.get(option.env)
            if raw:
                try:
                    value = option.parse(raw)
                except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
                    parser.error(f"environment variable {option.env}: {e}")
                setattr(args, option.dest, value)
            elif option.required:
                parser.error(
                    f"the following arguments are required: {option.flag} (or {option.env})"
                )
            else:
                setattr(args, option.dest, option.default)


def command_env(command: argparse.ArgumentParser) -> EnvOptions:
    """The environment fallbacks of a subcommand's options (add them with `EnvOptions.add` or
    `add_options`): `parse_command` resolves them when the command line names `command`, and
    reports their errors as `command`'s own (as argparse reports its arguments')."""
    env = EnvOptions()
    command.set_defaults(command_env=(command, env))
    return env


def parse_command(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    """`argv` parsed by `parser`, with the options of the subcommand it names that the command
    line leaves out filled from the environment, then their defaults (`command_env`)."""
    args = parser.parse_args(argv)
    declared: tuple[argparse.ArgumentParser, EnvOptions] | None = getattr(args, "command_env", None)
    if declared is not None:
        command, env = declared
        env.resolve(command, args)
    return args


# --------------------------------------------------------------------------------------------
# Options declared as dataclass fields


CLI_FIELD = "psyche.core.cli"
"""The metadata key of a field's `CommandLineField`."""


class CommandLineField(Protocol):
    """How one field of an options dataclass is given on a command line: `add` declares it on
    a parser, `value` reads it back from the parsed namespace."""

    def add(self, parser: argparse.ArgumentParser, env: EnvOptions, field: Field[Any]) -> None: ...

    def value(self, args: argparse.Namespace, field: Field[Any]) -> Any: ...


def flag_name(name: str) -> str:
    """A field's long flag: `--` and its name in kebab case (`run_id` -> `--run-id`)."""
    return "--" + name.replace("_", "-")


def field_default(field: Field[Any]) -> Any:
    """A field's default value (its factory's product), or None when it has none."""
    if field.default is not MISSING:
        return field.default
    if field.default_factory is not MISSING:
        return field.default_factory()
    return None


@dataclass(frozen=True)
class EnvFlag:
    """A field given as `--field-name`, falling back to the environment (`EnvOptions.add`'s
    keywords; the field's default is the option's)."""

    parse: Callable[[str], Any] = str
    short: str | None = None
    required: bool = False
    flag_only: bool = False
    optional_value: bool = False
    metavar: str | None = None
    help: str = ""

    def add(self, parser: argparse.ArgumentParser, env: EnvOptions, field: Field[Any]) -> None:
        env.add(
            parser,
            flag_name(field.name),
            short=self.short,
            parse=self.parse,
            default=field_default(field),
            required=self.required,
            flag_only=self.flag_only,
            optional_value=self.optional_value,
            metavar=self.metavar,
            help=self.help,
        )

    def value(self, args: argparse.Namespace, field: Field[Any]) -> Any:
        return getattr(args, field.name)


def env_option(default: Any = MISSING, **flag: Any) -> Any:
    """An options field given as `--field-name` or in the environment (`EnvFlag`'s keywords:
    parse, short, required, flag_only, optional_value, metavar, help)."""
    return field(default=default, metadata={CLI_FIELD: EnvFlag(**flag)})


@dataclass(frozen=True)
class Nested:
    """A field holding options of their own (a component's settings object), declared on the
    same parser as the fields around it."""

    options: type[Any]

    def add(self, parser: argparse.ArgumentParser, env: EnvOptions, field: Field[Any]) -> None:
        add_options(parser, env, self.options)

    def value(self, args: argparse.Namespace, field: Field[Any]) -> Any:
        return options_from_args(self.options, args)


def nested(options: type[Any]) -> Any:
    """A field holding an `options` object (every field of which has a default), given by
    the flags of its own fields."""
    return field(default_factory=options, metadata={CLI_FIELD: Nested(options)})


def add_options(parser: argparse.ArgumentParser, env: EnvOptions, options: type[Any]) -> None:
    """Every field of the `options` dataclass on `parser`, in their order (environment
    fallbacks in `env`, resolved after parsing: `EnvOptions.resolve`)."""
    for f in fields(options):
        f.metadata[CLI_FIELD].add(parser, env, f)


def options_from_args(options: type[T], args: argparse.Namespace) -> T:
    """The `options` dataclass from a namespace that `add_options` filled (and its
    `EnvOptions` resolved)."""
    values = {f.name: f.metadata[CLI_FIELD].value(args, f) for f in fields(options) if f.init}
    return options(**values)


# --------------------------------------------------------------------------------------------
# Log levels


LOG_DIRECTIVES_ENV = ("PSYCHE_LOG", "RUST_LOG")
_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 1,
}


def log_directives_from_environment() -> str:
    """`PSYCHE_LOG`, else `RUST_LOG` (empty when neither is set)."""
    return next((os.environ[n] for n in LOG_DIRECTIVES_ENV if os.environ.get(n)), "")


def apply_log_directives(spec: str) -> None:
    """Levels from a `RUST_LOG`-style spec (`warn,psyche=debug`): a bare level sets the root
    logger, `target=level` the logger of that name. A Python name is taken as it is
    (`psyche.client=debug`); a Rust path (`::`) names its module (`a::b` -> `a.b`), and an
    upstream crate (`psyche_client::...`) the whole `psyche` package. Unknown levels are
    ignored."""
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        target, _, level = part.rpartition("=")
        value = _LEVELS.get(level.strip().lower())
        if value is None:
            continue
        name = target.strip().replace("::", ".")
        if name.split(".")[0].startswith("psyche_"):
            name = "psyche"
        logging.getLogger(name or None).setLevel(value)


def add_verbose_flag(parser: argparse.ArgumentParser) -> None:
    """`--verbose`/`-v` on `parser` and on each of its subcommands (call it after adding them):
    user errors also print their traceback. `PSYCHE_VERBOSE=1` does the same."""
    help_text = f"print the traceback of errors too [env: {VERBOSE_ENV}=1]"
    _add_verbose(parser, help_text)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in {id(p): p for p in action.choices.values()}.values():
                add_verbose_flag(sub)


@dataclass(frozen=True)
class Command:
    """One subcommand of a command: its name and help, its options (a dataclass whose fields
    declare its arguments, `add_options`) and the function that runs it with them; or, without
    options, what declares its arguments (`add`, which returns their environment fallbacks if
    it has any) and runs it from the parsed namespace."""

    name: str
    help: str
    options: type[Any] | None
    run: Callable[[Any], int]
    description: str | None = None
    """`--help`'s text (default: the help, when `described`)."""
    described: bool = True
    aliases: tuple[str, ...] = ()
    implied: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """What an alias implies: option values by alias."""
    add: Callable[[argparse.ArgumentParser], EnvOptions | None] | None = None

    def declare(
        self,
        commands: argparse._SubParsersAction[argparse.ArgumentParser],
        formatter_class: type[argparse.HelpFormatter] = HelpFormatter,
    ) -> EnvOptions | None:
        """This subcommand on `commands`; the environment fallbacks of its arguments (None
        when it has none)."""
        sub = commands.add_parser(
            self.name,
            help=self.help,
            description=self.description or (self.help if self.described else None),
            aliases=list(self.aliases),
            formatter_class=formatter_class,
        )
        if self.options is None:
            assert self.add is not None
            return self.add(sub)
        env = command_env(sub)
        add_options(sub, env, self.options)
        return env

    def options_from(self, args: argparse.Namespace) -> Any:
        """The command's options from the parsed namespace (with what its alias implies)."""
        assert self.options is not None
        options = options_from_args(self.options, args)
        return dataclasses.replace(options, **self.implied.get(args.command, {}))

    def call(self, args: argparse.Namespace) -> int:
        if self.options is None:
            return self.run(args)
        return self.run(self.options_from(args))


def commands_parser(
    prog: str,
    description: str,
    commands: Sequence[Command],
    formatter_class: type[argparse.HelpFormatter] = HelpFormatter,
) -> tuple[argparse.ArgumentParser, dict[str, EnvOptions]]:
    """`command_parser` with `commands` declared (`formatter_class` their `--help`'s) and
    `--verbose`; the environment fallbacks of those that have some, by name."""
    parser, subcommands = command_parser(prog, description)
    envs: dict[str, EnvOptions] = {}
    for command in commands:
        env = command.declare(subcommands, formatter_class)
        if env is not None:
            envs[command.name] = env
    add_verbose_flag(parser)
    return parser, envs


def call_command(commands: Sequence[Command], args: argparse.Namespace) -> int:
    """Run the command of `commands` (by name or alias) that `args` names."""
    by_name = {name: c for c in commands for name in (c.name, *c.aliases)}
    return by_name[args.command].call(args)


def run_commands(
    prog: str,
    parser: Callable[[], argparse.ArgumentParser],
    commands: Sequence[Command],
    argv: Sequence[str] | None = None,
) -> int:
    """A command's `main`: the subcommand of `commands` that `argv` names, parsed by
    `parser()` (`parse_command`) and run under `run_command`."""
    return run_command(prog, lambda a: call_command(commands, parse_command(parser(), a)), argv)


def _add_verbose(parser: argparse.ArgumentParser, help_text: str) -> None:
    if any("--verbose" in action.option_strings for action in parser._actions):
        return
    names = ["--verbose"]
    if not any("-v" in action.option_strings for action in parser._actions):
        names.insert(0, "-v")
    parser.add_argument(*names, action=_Verbose, help=help_text)


class _Verbose(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.pop("nargs", None)
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        _State.verbose = True


def is_verbose() -> bool:
    """Whether `--verbose` was given or `PSYCHE_VERBOSE` is set (to anything but 0/false)."""
    env = os.environ.get(VERBOSE_ENV, "").strip().lower()
    return _State.verbose or env not in ("", "0", "false", "no", "off")


def interrupted_by() -> str:
    """The signal that interrupted the command, by name: SIGTERM or SIGINT."""
    return "SIGTERM" if _State.terminated else "SIGINT"


def interrupt_exit_code() -> int:
    """The exit status for an interrupted command: 143 after SIGTERM, else 130."""
    return EXIT_SIGTERM if _State.terminated else EXIT_SIGINT


def short_duration(seconds: float) -> str:
    """A wall-clock span as a person reads it in a status line: `42s`, `3m05s`."""
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def error_line(prog: str, message: object) -> str:
    """`<prog>: error: <message>` on one line (newlines in the message become `; `)."""
    text = "; ".join(part.strip() for part in str(message).splitlines() if part.strip())
    return f"{prog}: error: {text}"


def user_error_message(error: BaseException) -> str | None:
    """The one line a user-caused `error` is reported with; None when it is a bug."""
    if isinstance(error, UserError):
        return str(error) or type(error).__name__
    if isinstance(error, _FILE_ERRORS) and error.filename is not None:
        return f"{error.filename}: {error.strerror or error}"
    return None


def single_cause(error: BaseException) -> BaseException:
    """The exception that matters inside nested exception groups: the only member, or the first
    that is not an interrupt."""
    while isinstance(error, BaseExceptionGroup):
        members: Sequence[BaseException] = error.exceptions
        if len(members) != 1:
            others = [e for e in members if not _is_interrupt(e)]
            if not others:
                return KeyboardInterrupt()
            members = others
        error = members[0]
    return error


def _is_interrupt(error: BaseException) -> bool:
    if isinstance(error, BaseExceptionGroup):
        return all(_is_interrupt(e) for e in error.exceptions)
    return isinstance(error, KeyboardInterrupt)


def report(prog: str, error: BaseException) -> int:
    """Print `error` as the command's last word and return the exit status (see the module)."""
    cause = single_cause(error)
    if isinstance(cause, KeyboardInterrupt):
        print(f"{prog}: interrupted by {interrupted_by()}; stopped", file=sys.stderr, flush=True)
        return interrupt_exit_code()
    message = user_error_message(cause)
    if message is not None:
        if is_verbose():
            traceback.print_exception(error, file=sys.stderr)
        print(error_line(prog, message), file=sys.stderr, flush=True)
        return int(getattr(cause, "exit_code", EXIT_USER_ERROR))
    traceback.print_exception(error, file=sys.stderr)
    print(
        error_line(
            prog,
            f"unexpected {type(cause).__name__}: {cause} (a bug in {prog}: the traceback above "
            "says where; please report it)",
        ),
        file=sys.stderr,
        flush=True,
    )
    return EXIT_USER_ERROR


@contextmanager
def stop_signals() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt and SIGTERM does the same (remembered for the exit
    status) inside the block, whatever the process inherited; the previous handlers after.

    Only the main thread can install handlers; elsewhere the block changes nothing."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    _State.terminated = False

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        _State.terminated = True
        # Whoever handles SIGINT now (Python's default handler, or trio's while it runs)
        # delivers it as KeyboardInterrupt at a safe point.
        signal.raise_signal(signal.SIGINT)

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)


async def serve_until_signalled(
    signals: AsyncIterator[int], nursery: trio.Nursery, log: logging.Logger
) -> None:
    """A serving command's last step: wait for SIGINT or SIGTERM (`signals`, from a
    `trio.open_signal_receiver` opened before serving began, so that a signal during start-up
    counts too), say so, and cancel `nursery`, whose block holds what serves."""
    async for signum in signals:
        log.info("got %s, shutting down", signal.Signals(signum).name)
        break
    nursery.cancel_scope.cancel()


@asynccontextmanager
async def interrupt_on_signal() -> AsyncIterator[trio.CancelScope]:
    """The block runs until SIGINT or SIGTERM, which cancels it; then KeyboardInterrupt is
    raised here, from the task that opened the block, with the signal noted for the exit status
    (`interrupted_by`, `interrupt_exit_code`), so the command ends as `stop_signals` promises.
    A second signal while the block's cleanups run raises KeyboardInterrupt in the task that
    receives the signals, which cancels what of the block is not shielded (a shielded cleanup
    runs to its end).

    Why not let the signal raise KeyboardInterrupt where it lands (trio's default): it may land
    in a task another library started in trio's system nursery (py-libp2p's listener and its
    connection handlers), which makes trio stop with `TrioInternalError` instead of running the
    command's cleanups (seen on a client stopped during a Noise handshake). Here the signal is
    an event (`trio.open_signal_receiver`) and nothing is raised inside another task."""
    import trio

    got: list[int] = []
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def receive() -> None:
                async for signum in signals:
                    _State.terminated = signum == signal.SIGTERM
                    if got:
                        raise KeyboardInterrupt  # a second signal: stop the cleanups too
                    got.append(signum)
                    block.cancel()

            nursery.start_soon(receive)
            with trio.CancelScope() as block:
                yield block
            nursery.cancel_scope.cancel()
    if got:
        raise KeyboardInterrupt


def run_serving(
    main: Callable[[], Awaitable[None]],
    log: logging.Logger,
    failures: Mapping[type[BaseException], str],
) -> int:
    """`trio.run(main)` for a command that serves until SIGINT or SIGTERM (which `main` handles,
    `serve_until_signalled`): 0 when it returns; 1 when it raised one of `failures`, logged as
    one line (its message, a %-format of the cause); anything else propagates."""
    import trio

    try:
        trio.run(main)
    except BaseException as e:
        cause = single_cause(e)
        for kind, message in failures.items():
            if isinstance(cause, kind):
                log.error(message, cause)
                return EXIT_USER_ERROR
        raise
    return 0


def skip_finalization() -> None:
    """Ask for the process to end without the interpreter's finalization (`exit_process`).

    For a process that holds native threads nothing can stop: a collective of a
    torch.distributed group waiting on a rank that died. Finalizing the interpreter destroys
    the group under that thread and the C++ runtime aborts ("terminate called without an
    active exception", SIGABRT) instead of exiting with the command's status."""
    _State.skip_finalization = True


def exit_process(code: int) -> NoReturn:
    """`sys.exit(code)`; after `skip_finalization`, `os._exit(code)` once the log handlers and
    the standard streams are flushed (only from the main thread: elsewhere, `sys.exit`)."""
    import threading

    if _State.skip_finalization and threading.current_thread() is threading.main_thread():
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)
    sys.exit(code)


def run_command(
    prog: str,
    main: Callable[[Sequence[str] | None], int | None],
    argv: Sequence[str] | None = None,
) -> int:
    """Run a command's `main(argv)` under `stop_signals` and turn how it ended into an exit
    status: its return value (None is 0), or what `report` says for an exception. SystemExit
    passes through (argparse's usage errors and `--help` already printed what they had to).
    After `skip_finalization` the process ends here (`exit_process`)."""
    _State.verbose = False
    with stop_signals(), _root_logging_kept():
        try:
            code = int(main(argv) or 0)
        except SystemExit:
            raise
        except BaseException as e:
            try:
                code = report(prog, e)
            except KeyboardInterrupt:  # a second Ctrl-C while reporting
                code = interrupt_exit_code()
    if _State.skip_finalization:
        exit_process(code)
    return code


@contextmanager
def _root_logging_kept() -> Iterator[None]:
    """The root logger's handlers and level as they were before the block (commands set up
    their logging; a caller running them in-process keeps its own)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)


__all__ = [
    "CLI_FIELD",
    "EXIT_SIGINT",
    "EXIT_SIGTERM",
    "EXIT_USAGE",
    "EXIT_USER_ERROR",
    "LOG_DIRECTIVES_ENV",
    "VERBOSE_ENV",
    "Command",
    "CommandLineField",
    "EnvFlag",
    "EnvOptions",
    "HelpFormatter",
    "Nested",
    "UsageError",
    "UserError",
    "add_options",
    "add_verbose_flag",
    "apply_log_directives",
    "call_command",
    "command_parser",
    "commands_parser",
    "env_name",
    "env_option",
    "error_line",
    "field_default",
    "flag_name",
    "interrupt_exit_code",
    "interrupt_on_signal",
    "interrupted_by",
    "is_verbose",
    "log_directives_from_environment",
    "nested",
    "options_from_args",
    "parse_bool",
    "parse_unsigned",
    "report",
    "run_command",
    "run_commands",
    "run_serving",
    "short_duration",
    "single_cause",
    "stop_signals",
    "user_error_message",
]
