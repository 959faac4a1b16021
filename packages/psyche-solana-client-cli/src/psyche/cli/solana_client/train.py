"""`psyche-solana-client train`: the training client (`psyche.client.run.run_client`) on a run
whose coordinator lives on Solana (upstream solana-client `main.rs` `Train` and `app.rs`), composed
here because it needs both: the client's options and runner, and the Solana side's settings,
preflight and backend (`psyche.solana.app`).

Options: the cluster (`--rpc`, `--ws-rpc`, backups `--rpc-2/--ws-rpc-2`, `--rpc-3/--ws-rpc-3`:
`psyche.solana.commands.args.TrainClusterOptions`), the wallet, upstream's `TrainArgs` (shared
with `psyche-client train`: `psyche.client.setup.options`), `--authorizer`, and the port's
`--bootstrap-peer` (how clients find each other without a server; see docs/solana.md).

The P2P identity is `-i`/`RAW_IDENTITY_SECRET_KEY` when given, else derived from the run id and
the wallet as upstream does, so a restarted client keeps its identity. The run is looked up (and
`CLIENT_VERSION` checked, exit code 10 on a mismatch) before torch is imported, so a wrong run id
or an unreachable RPC fails in a second.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psyche.client.setup.options import TrainOptions
from psyche.core.cli import nested
from psyche.solana.commands.args import TrainClusterOptions, wallet_arg
from psyche.solana.commands.authorization import EVERYONE

if TYPE_CHECKING:
    from psyche.client.run import BeforeJoin
    from psyche.solana.app import SolanaRun, SolanaTrainSettings

log = logging.getLogger("psyche.cli.solana_client")

BOOTSTRAP_PEERS_ENV = "BOOTSTRAP_PEERS"

IDENTITY_HELP = (
    "Path to the client's 32-byte P2P secret key (`openssl rand 32 > secret.key`); derived from "
    "the run id and the wallet (as upstream) if neither this nor RAW_IDENTITY_SECRET_KEY is given"
)
DISCOVERY_HELP = (
    "Discovery: `n0` (default) = the --bootstrap-peer list, then peer exchange with the peers "
    "found; `local` = also files in a directory shared by the clients on this machine"
)


@dataclass(frozen=True, kw_only=True)
class ChainOptions:
    """Where the run lives and who pays: the options before the client's."""

    cluster: TrainClusterOptions = nested(TrainClusterOptions)
    wallet_private_key_path: Path | None = wallet_arg()


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of `train`; the client's fall back to the environment once parsed
    (`psyche.core.cli.parse_command`)."""
    from psyche.client.setup.options import add_train_options
    from psyche.core.cli import add_options, command_env

    env = command_env(parser)
    add_options(parser, env, ChainOptions)
    add_train_options(
        parser,
        env,
        help={"identity_secret_key_path": IDENTITY_HELP, "iroh_discovery": DISCOVERY_HELP},
    )
    parser.add_argument(
        "--authorizer",
        default=os.environ.get("AUTHORIZER") or None,
        help="the grantee of the join authorization to join with: a key the run's join "
        f"authority authorized (permissioned runs); default everyone ({EVERYONE}) "
        "[env: AUTHORIZER]",
    )
    parser.add_argument(
        "--bootstrap-peer",
        dest="bootstrap_peers",
        action="append",
        default=None,
        metavar="<ENDPOINT_ID@HOST:PORT>",
        help="port extension: a run member's P2P address (hex endpoint id @ host : libp2p "
        "port), as each client logs it; repeat for several. Peer exchange finds the rest "
        f"[env: {BOOTSTRAP_PEERS_ENV}, comma-separated]",
    )


# --------------------------------------------------------------------------------------------
# Bootstrap peers


def parse_bootstrap_peer(text: str) -> Any:
    """`<64 hex endpoint id>@<host>:<port>` as an `EndpointAddr` with one libp2p address; a
    host name is resolved (IPv4) now."""
    from psyche.core.identity import parse_hex_key
    from psyche.network import EndpointAddr, TransportAddr, parse_host_port

    text = text.strip()
    ident, sep, host_port = text.partition("@")
    if not sep:
        raise ValueError(f"bootstrap peer {text!r}: expected <endpoint id hex>@<host>:<port>")
    try:
        endpoint_id = parse_hex_key(ident, "the endpoint id")
    except ValueError as e:
        raise ValueError(f"bootstrap peer {text!r}: {e}") from None
    try:
        host, port = parse_host_port(host_port)
    except ValueError as e:
        raise ValueError(f"bootstrap peer {text!r}: {e}") from None
    try:
        ip = str(ipaddress.IPv4Address(host))
    except ValueError:
        try:
            ip = socket.gethostbyname(host)
        except (OSError, UnicodeError) as e:  # UnicodeError: an empty or over-long label
            raise ValueError(f"bootstrap peer {text!r}: cannot resolve {host!r}: {e}") from None
    return EndpointAddr(endpoint_id, [TransportAddr.Libp2p(f"/ip4/{ip}/tcp/{port}")])


def bootstrap_peers(cli: Sequence[str] | None, environ: dict[str, str] | None = None) -> list[Any]:
    """The command line's entries, else `BOOTSTRAP_PEERS` (comma-separated)."""
    environ = dict(os.environ) if environ is None else environ
    if cli:
        entries = [e for item in cli for e in item.split(",")]
    else:
        entries = environ.get(BOOTSTRAP_PEERS_ENV, "").split(",")
    return [parse_bootstrap_peer(e) for e in entries if e.strip()]


def format_bootstrap_peer(addr: Any) -> str | None:
    """What another client passes to `--bootstrap-peer` to reach this endpoint (None when it
    listens on no IPv4 TCP address)."""
    for multiaddr in addr.libp2p_addrs():
        parts = multiaddr.split("/")
        if len(parts) >= 5 and parts[1] == "ip4" and parts[3] == "tcp":
            return f"{addr.id.hex()}@{parts[2]}:{parts[4]}"
    return None


# --------------------------------------------------------------------------------------------
# Settings


def backup_clusters(args: argparse.Namespace) -> tuple[Any, ...]:
    """`--rpc-N`/`--ws-rpc-N` pairs where both are set (upstream ignores half pairs)."""
    from psyche.core.cli import options_from_args
    from psyche.solana.commands.args import BackupRpcOptions

    return options_from_args(BackupRpcOptions, args).clusters()


def settings_from_args(args: argparse.Namespace, options: TrainOptions, wallet: Any) -> Any:
    """The Solana side's settings (`psyche.solana.app.SolanaTrainSettings`)."""
    from psyche.core.cli import options_from_args
    from psyche.solana.admin import pubkey_arg
    from psyche.solana.app import SolanaTrainSettings

    cluster = options_from_args(ChainOptions, args).cluster
    return SolanaTrainSettings(
        run_id=options.run_id,
        wallet=wallet,
        cluster=cluster.cluster(),
        backup_clusters=cluster.backups.clusters(),
        ids=cluster.ids.program_ids(),
        authorizer=pubkey_arg(args.authorizer) if args.authorizer else None,
        client_version=os.environ.get("CLIENT_VERSION") or None,
    )


# --------------------------------------------------------------------------------------------
# The command


def train(args: argparse.Namespace) -> int:
    """`train` with the namespace `parse_command` made of its arguments (the environment
    filled in)."""
    from psyche.client.run import network_config, setup_logging
    from psyche.client.setup.options import OptionError, read_identity_secret_key
    from psyche.core.cli import EXIT_USAGE, UsageError
    from psyche.core.identity import SecretKey
    from psyche.solana.admin import AdminError
    from psyche.solana.app import preflight
    from psyche.solana.commands.render import explain_error
    from psyche.solana.commands.shell import raise_user_error
    from psyche.solana.keypair import derive_p2p_secret_key, load_wallet

    options = TrainOptions.from_args(args).check()
    try:
        wallet = load_wallet(args.wallet_private_key_path)
        key = read_identity_secret_key(options.identity_secret_key_path) or SecretKey.from_bytes(
            derive_p2p_secret_key(options.run_id, wallet)
        )
        settings = settings_from_args(args, options, wallet)
        network = network_config(options, key, bootstrap_peers(args.bootstrap_peers))
    except (OptionError, AdminError, ValueError) as e:  # KeypairError is a ValueError
        raise UsageError(explain_error(e, None), exit_code=EXIT_USAGE) from e
    setup_logging(options)
    log.info("looking up run %r at %s", settings.run_id, settings.cluster.rpc)
    try:
        run = preflight(settings)
    except Exception as e:
        raise_user_error(e, settings.cluster.rpc)
    return _train(options, settings, run, key, network)


def _train(
    options: TrainOptions, settings: SolanaTrainSettings, run: SolanaRun, key: Any, network: Any
) -> int:
    from psyche.client.run import run_client
    from psyche.core.node_identity import NodeIdentity

    log.info("Solana wallet pubkey: %s", settings.wallet.pubkey())
    if settings.client_version is None:
        log.warning(
            "CLIENT_VERSION is not set: continuing without checking it against the run's "
            "client version (%r)",
            run.client_version,
        )
    else:
        log.info("client version %s: version check passed", settings.client_version)
    if not network.bootstrap_peers and network.local_discovery_dir is None:
        log.info(
            "no --bootstrap-peer: this client finds the others once one of them connects to it"
        )
    identity = NodeIdentity(bytes(settings.wallet.pubkey()), key.public_key)
    log.info(
        "client %s (P2P identity %s) starting on run %s (coordinator account %s)",
        identity,
        key.public_key.hex(),
        run.run_id,
        run.account,
    )
    on_run = OnRun(settings, run, identity)
    return run_client(options, identity, key, on_run.connect, network, on_run.train)


@dataclass(frozen=True)
class OnRun:
    """The Solana backend of one run, for `run_client`: the runner subscribes to the run while
    torch loads (`psyche.solana.app.connect_run`), and the client trains under `train_on_run`
    (which joins and rejoins it)."""

    settings: SolanaTrainSettings
    run: SolanaRun
    identity: Any  # NodeIdentity

    @asynccontextmanager
    async def connect(self, *, before_join: BeforeJoin) -> AsyncIterator[Any]:
        from psyche.solana.app import connect_run

        async with connect_run(self.settings, self.run, before_join=before_join) as runner:
            yield runner

    async def train(self, runner: Any, client: Any, network: Any) -> None:
        from psyche.solana.app import train_on_run

        log.info(
            "P2P address for --bootstrap-peer: %s", format_bootstrap_peer(network.endpoint_addr())
        )
        await train_on_run(
            runner, self.identity, self.run, client.run, authorizer=self.settings.authorizer
        )
