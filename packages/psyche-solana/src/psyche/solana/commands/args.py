"""How the options of the Solana commands are declared: each field of an options dataclass is one
command-line argument (`arg`), with upstream's flags and environment variables, so that the
command (`psyche-solana-client`) builds its parser from the options (`psyche.core.cli.add_options`)
and builds them back (`options_from_args`), and Python code builds them directly.

An argument's environment variable is read when the parser is built, as upstream's clap `env`
defaults are shown: it replaces the default (converted by `from_env`), and an argument that is
`required` is required only when its variable is unset. Light (no solders, no trio): the command's
`--help` loads nothing else.

The options every cluster command shares: the cluster (`ClusterOptions`: `--rpc`, `--ws-rpc` and
the program ids, in the `cluster` group of `--help`) and the wallet (`wallet_arg`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psyche.core.cli import CLI_FIELD, EnvOptions, field_default, flag_name, nested
from psyche.solana.cluster import LOCALNET_RPC, LOCALNET_WS_RPC, Cluster

if TYPE_CHECKING:
    from psyche.solana.program_ids import ProgramIds

CLUSTER_GROUP = "cluster"


def env_value(name: str | None) -> str | None:
    """The variable's value; None when it is unset or empty."""
    value = os.environ.get(name) if name is not None else None
    return value or None


def env_flag(value: str) -> bool:
    """A switch's variable: 1, true, yes or on (any case) sets it."""
    return value.lower() in ("1", "true", "yes", "on")


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite amount >= 0, found {text!r}")
    return value


@dataclass(frozen=True)
class Arg:
    """One argument: argparse's names and keywords, the environment variable its default comes
    from, the argument group it is listed in."""

    names: tuple[str, ...]
    env: str | None
    from_env: Callable[[str], Any]
    required: bool
    group: str | None
    kwargs: Mapping[str, Any]

    def add(self, parser: argparse.ArgumentParser, env: EnvOptions, field: Field[Any]) -> None:
        raw = env_value(self.env)
        default = field_default(field) if raw is None else self.from_env(raw)
        names = self.names or (flag_name(field.name),)
        kwargs = dict(self.kwargs)
        if names[0].startswith("-"):
            kwargs["dest"] = field.name
            kwargs["required"] = self.required and raw is None
        _group(parser, self.group).add_argument(*names, default=default, **kwargs)

    def value(self, args: argparse.Namespace, field: Field[Any]) -> Any:
        return getattr(args, field.name)


def arg(
    *names: str,
    env: str | None = None,
    from_env: Callable[[str], Any] = str,
    required: bool = False,
    group: str | None = None,
    default: Any = MISSING,
    default_factory: Any = MISSING,
    **kwargs: Any,
) -> Any:
    """An options field given as `names` (default `--field-name`; a name without dashes is a
    positional argument), with argparse's other keywords (`type`, `action`, `help`, ...); a
    field without a default is one the options cannot do without."""
    metadata = {CLI_FIELD: Arg(names, env, from_env, required, group, kwargs)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def env_arg(env: str, *names: str, help: str = "", **kwargs: Any) -> Any:
    """`arg` whose default comes from the variable `env`, converted as the command line's text is
    (its `type`) unless `from_env` says otherwise; its help ends naming the variable, as clap
    shows an `env` argument."""
    kwargs.setdefault("from_env", kwargs.get("type", str))
    return arg(*names, env=env, help=f"{help} [env: {env}]".lstrip(), **kwargs)


def _group(parser: argparse.ArgumentParser, title: str | None) -> Any:
    """The parser's argument group `title` (made on first use), or the parser itself."""
    if title is None:
        return parser
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


# --------------------------------------------------------------------------------------------
# What most commands take


def program_id_arg(program: str) -> Any:
    return arg(
        group=CLUSTER_GROUP,
        default=None,
        help=f"override the {program} program id [env: PSYCHE_{program.upper()}_PROGRAM_ID]",
    )


@dataclass(frozen=True, kw_only=True)
class ProgramIdOptions:
    """The programs' ids when they are not the deployed ones (else their variables'; see
    `psyche.solana.program_ids`)."""

    coordinator_program_id: str | None = program_id_arg("coordinator")
    authorizer_program_id: str | None = program_id_arg("authorizer")
    treasurer_program_id: str | None = program_id_arg("treasurer")

    def program_ids(self, env: Mapping[str, str] | None = None) -> ProgramIds:
        """The ids, the options winning over the variables of `env` (default: the process's)."""
        from psyche.solana.program_ids import ProgramIds

        return ProgramIds.from_env(
            env,
            coordinator=self.coordinator_program_id,
            authorizer=self.authorizer_program_id,
            treasurer=self.treasurer_program_id,
        )


def rpc_arg(name: str, default: str) -> Any:
    """`--rpc`-like: an endpoint, from the variable of its name (`RPC`, `WS_RPC_2`, ...)."""
    return env_arg(name, group=CLUSTER_GROUP, default=default)


@dataclass(frozen=True, kw_only=True)
class ClusterOptions:
    """The cluster a command talks to: a local validator unless told otherwise."""

    rpc: str = rpc_arg("RPC", LOCALNET_RPC)
    ws_rpc: str = rpc_arg("WS_RPC", LOCALNET_WS_RPC)
    ids: ProgramIdOptions = nested(ProgramIdOptions)

    def cluster(self) -> Cluster:
        return Cluster(self.rpc, self.ws_rpc)


@dataclass(frozen=True, kw_only=True)
class BackupRpcOptions:
    """A training client's backup endpoints (upstream's `--rpc-2`, `--rpc-3` and their
    websockets)."""

    rpc_2: str = rpc_arg("RPC_2", "")
    ws_rpc_2: str = rpc_arg("WS_RPC_2", "")
    rpc_3: str = rpc_arg("RPC_3", "")
    ws_rpc_3: str = rpc_arg("WS_RPC_3", "")

    def clusters(self) -> tuple[Cluster, ...]:
        """The pairs where both are set (upstream ignores half pairs)."""
        pairs = [(self.rpc_2, self.ws_rpc_2), (self.rpc_3, self.ws_rpc_3)]
        return tuple(Cluster(rpc, ws) for rpc, ws in pairs if rpc and ws)


@dataclass(frozen=True, kw_only=True)
class TrainClusterOptions:
    """The cluster a training client follows its run on, with backup endpoints."""

    rpc: str = rpc_arg("RPC", LOCALNET_RPC)
    ws_rpc: str = rpc_arg("WS_RPC", LOCALNET_WS_RPC)
    backups: BackupRpcOptions = nested(BackupRpcOptions)
    ids: ProgramIdOptions = nested(ProgramIdOptions)

    def cluster(self) -> Cluster:
        return Cluster(self.rpc, self.ws_rpc)


def treasurer_index_arg() -> Any:
    return env_arg("TREASURER_INDEX", type=int, default=None)


def address_arg() -> Any:
    """Upstream's `--address` (aliases `--wallet`, `--user`): the public key asked about."""
    return env_arg("ADDRESS", "--address", "--wallet", "--user", metavar="PUBKEY", required=True)


def wallet_arg() -> Any:
    """The wallet that signs (`RAW_WALLET_PRIVATE_KEY`, read when it is loaded, wins)."""
    return env_arg(
        "WALLET_PRIVATE_KEY_PATH",
        "-w",
        "--wallet-private-key-path",
        type=Path,
        default=None,
        help="solana-keygen JSON keypair",
    )


def run_id_arg() -> Any:
    return env_arg("RUN_ID", "-r", "--run-id", required=True)


@dataclass(frozen=True, kw_only=True)
class ClusterCommand:
    """The options of a command on the cluster (the options of each command add to these)."""

    cluster: ClusterOptions = nested(ClusterOptions)


@dataclass(frozen=True, kw_only=True)
class RunQuery(ClusterCommand):
    """A command that reads a run (it signs nothing)."""

    run_id: str = run_id_arg()


@dataclass(frozen=True, kw_only=True)
class SignedCommand(ClusterCommand):
    """A command on the cluster signed by the wallet (`RAW_WALLET_PRIVATE_KEY`, read when it is
    loaded, wins over the path)."""

    wallet_private_key_path: Path | None = wallet_arg()  # noqa: RUF009 (a field)


@dataclass(frozen=True, kw_only=True)
class RunCommand(SignedCommand):
    """A command on a run, signed by the wallet."""

    run_id: str = run_id_arg()


__all__ = [
    "CLUSTER_GROUP",
    "Arg",
    "BackupRpcOptions",
    "ClusterCommand",
    "ClusterOptions",
    "ProgramIdOptions",
    "RunCommand",
    "RunQuery",
    "SignedCommand",
    "TrainClusterOptions",
    "address_arg",
    "arg",
    "env_flag",
    "env_value",
    "non_negative_float",
    "program_id_arg",
    "rpc_arg",
    "run_id_arg",
    "treasurer_index_arg",
    "wallet_arg",
]
