"""`psyche-solana-client`: create, configure, pause, resume and inspect Psyche runs on Solana.

The admin commands are upstream's (they lived in `psyche-solana-client` before they moved to
`run-manager`) with the same flags and environment variables; `localnet` serves a local endpoint
for users without a validator. Every command prints what it did; failures print one clear line
on stderr (`psyche-solana-client: error: ...`) and exit 1 (2 for bad options); signals and the
rest as every command (`psyche.core.cli`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from psyche.core.cli import HelpFormatter, add_verbose_flag, command_parser, run_command

PROG = "psyche-solana-client"
LOCAL_RPC = "http://127.0.0.1:8899"
LOCAL_WS_RPC = "ws://127.0.0.1:8900"
DESCRIPTION = """\
Manage and follow Psyche training runs on Solana.

Cluster flags default to a local validator (http://127.0.0.1:8899, ws://127.0.0.1:8900); use
--rpc/--ws-rpc (or RPC/WS_RPC) for devnet. The wallet is a solana-keygen JSON keypair
(--wallet-private-key-path or WALLET_PRIVATE_KEY_PATH), or RAW_WALLET_PRIVATE_KEY (a JSON byte
array or base58), which wins when set. Errors are one line; --verbose (or PSYCHE_VERBOSE=1) adds
their traceback. SIGINT (Ctrl+C) or SIGTERM stops any command (exit 130 / 143)."""


def _env(name: str, default: Any = None) -> Any:
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def _env_flag(name: str) -> bool:
    return str(_env(name, "")).lower() in ("1", "true", "yes", "on")


def _env_int(name: str, default: int | None = None) -> int | None:
    value = _env(name)
    return default if value is None else int(value)


def add_cluster_args(
    parser: argparse.ArgumentParser, backups: bool = False, *, late_env: bool = False
) -> None:
    """`late_env`: --rpc/--ws-rpc default to None and the command reads RPC/WS_RPC itself
    (list-runs, whose --env-file may set them)."""
    group = parser.add_argument_group("cluster")
    if late_env:
        group.add_argument("--rpc", default=None, help=f"[env: RPC] [default: {LOCAL_RPC}]")
        group.add_argument(
            "--ws-rpc", default=None, help=f"[env: WS_RPC] [default: {LOCAL_WS_RPC}]"
        )
    else:
        group.add_argument("--rpc", default=_env("RPC", LOCAL_RPC), help="[env: RPC]")
        group.add_argument("--ws-rpc", default=_env("WS_RPC", LOCAL_WS_RPC), help="[env: WS_RPC]")
    if backups:
        for n in (2, 3):
            group.add_argument(f"--rpc-{n}", default=_env(f"RPC_{n}", ""), help=f"[env: RPC_{n}]")
            group.add_argument(
                f"--ws-rpc-{n}", default=_env(f"WS_RPC_{n}", ""), help=f"[env: WS_RPC_{n}]"
            )
    group.add_argument(
        "--coordinator-program-id",
        default=None,
        help="override the coordinator program id [env: PSYCHE_COORDINATOR_PROGRAM_ID]",
    )
    group.add_argument(
        "--authorizer-program-id",
        default=None,
        help="override the authorizer program id [env: PSYCHE_AUTHORIZER_PROGRAM_ID]",
    )
    group.add_argument(
        "--treasurer-program-id",
        default=None,
        help="override the treasurer program id [env: PSYCHE_TREASURER_PROGRAM_ID]",
    )


def add_wallet_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-w",
        "--wallet-private-key-path",
        type=Path,
        default=_env("WALLET_PRIVATE_KEY_PATH"),
        help="solana-keygen JSON keypair [env: WALLET_PRIVATE_KEY_PATH]",
    )


def add_run_id(parser: argparse.ArgumentParser) -> None:
    run_id = _env("RUN_ID")
    parser.add_argument(
        "-r", "--run-id", default=run_id, required=run_id is None, help="[env: RUN_ID]"
    )


def add_treasurer_index(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--treasurer-index",
        type=int,
        default=_env_int("TREASURER_INDEX"),
        help="[env: TREASURER_INDEX]",
    )


def _env_float(name: str) -> float | None:
    value = _env(name)
    return None if value is None else float(value)


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite amount >= 0, found {text!r}")
    return value


def add_address(parser: argparse.ArgumentParser) -> None:
    """Upstream's `--address` (aliases `--wallet`, `--user`): the public key asked about."""
    address = _env("ADDRESS")
    parser.add_argument(
        "--address",
        "--wallet",
        "--user",
        dest="address",
        metavar="PUBKEY",
        default=address,
        required=address is None,
        help="[env: ADDRESS]",
    )


def add_run_down_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--expires-in-seconds",
        type=int,
        default=_env_int("EXPIRES_IN_SECONDS", 3600),
        help="how long the signed URLs stay valid [env: EXPIRES_IN_SECONDS]",
    )
    parser.add_argument(
        "--run-down-service-url",
        default=_env("RUN_DOWN_SERVICE_URL"),
        help="the run-down service's API, default upstream's (a port addition: upstream's is "
        "fixed) [env: RUN_DOWN_SERVICE_URL]",
    )


def build_parser() -> argparse.ArgumentParser:
    parser, commands = command_parser(PROG, DESCRIPTION)

    def plain(
        name: str, help_text: str, description: str | None = None, aliases: Sequence[str] = ()
    ) -> argparse.ArgumentParser:
        return commands.add_parser(
            name,
            help=help_text,
            description=description,
            aliases=list(aliases),
            formatter_class=HelpFormatter,
        )

    def command(
        name: str, help_text: str, *, wallet: bool = True, aliases: Sequence[str] = ()
    ) -> argparse.ArgumentParser:
        """A command on the cluster (and, with `wallet`, signed by the wallet)."""
        sub = plain(name, help_text, help_text, aliases)
        add_cluster_args(sub)
        if wallet:
            add_wallet_args(sub)
        return sub

    sub = command(
        "create-run", "Create and initialize a run (its coordinator account and instance)"
    )
    add_run_id(sub)
    client_version = _env("CLIENT_VERSION")
    sub.add_argument(
        "-c",
        "--client-version",
        default=client_version,
        required=client_version is None,
        help="[env: CLIENT_VERSION]",
    )
    add_treasurer_index(sub)
    sub.add_argument("--treasurer-collateral-mint", default=_env("TREASURER_COLLATERAL_MINT"))
    sub.add_argument("--join-authority", default=None, help="default: the wallet")

    sub = command("close-run", "Close a halted run and recover the rent of its accounts")
    add_run_id(sub)

    sub = command(
        "update-config", "Update a run's config/model (from a run config TOML) and metadata"
    )
    add_run_id(sub)
    add_treasurer_index(sub)
    sub.add_argument(
        "--config-path",
        type=Path,
        default=_env("CONFIG_PATH"),
        help="TOML with [config] and [model] [env: CONFIG_PATH]",
    )
    sub.add_argument("--restart-from-step", type=int, default=_env_int("RESTART_FROM_STEP"))
    sub.add_argument("--switch-to-hub", action="store_true", default=_env_flag("SWITCH_TO_HUB"))
    sub.add_argument("--name")
    sub.add_argument("--description")
    sub.add_argument("--num-parameters", type=int)
    sub.add_argument("--vocab-size", type=int)
    sub.add_argument("--client-version", default=_env("CLIENT_VERSION"))

    sub = command("set-paused", "Pause a run, or resume it with --resume")
    add_run_id(sub)
    add_treasurer_index(sub)
    sub.add_argument("--resume", action="store_true", default=_env_flag("RESUME"))

    sub = command("set-future-epoch-rates", "Set reward rates from the next epoch (treasurer runs)")
    add_run_id(sub)
    add_treasurer_index(sub)
    sub.add_argument(
        "--earning-rate-total-shared",
        type=non_negative_float,
        default=_env_float("EARNING_RATE_TOTAL_SHARED"),
        help="[env: EARNING_RATE_TOTAL_SHARED]",
    )
    sub.add_argument(
        "--slashing-rate-per-client",
        type=non_negative_float,
        default=_env_float("SLASHING_RATE_PER_CLIENT"),
        help="[env: SLASHING_RATE_PER_CLIENT]",
    )

    sub = command("tick", "Send tick transactions to a run")
    add_run_id(sub)
    sub.add_argument(
        "--ms-interval",
        type=int,
        default=_env_int("MS_INTERVAL", 1000),
        help="milliseconds between ticks [env: MS_INTERVAL]",
    )
    sub.add_argument(
        "--count",
        type=int,
        default=_env_int("COUNT"),
        help="ticks to send (default: until stopped) [env: COUNT]",
    )

    sub = command("checkpoint", "Point a run's checkpoint at a Hugging Face repo")
    add_run_id(sub)
    sub.add_argument("--repo", default=_env("REPO"), required=_env("REPO") is None)
    sub.add_argument("--revision", default=_env("REVISION"))

    sub = command(
        "join-authorization-create", "Allow a key (or everyone) to join the wallet's runs"
    )
    sub.add_argument(
        "--authorizer",
        default=_env("AUTHORIZER"),
        required=_env("AUTHORIZER") is None,
        help="grantee; 11111111111111111111111111111111 means everyone",
    )

    sub = command(
        "join-authorization-set-delegates",
        "As an authorization's grantee, set the delegate keys that may join for it",
        aliases=["join-authorization-delegate"],
    )
    sub.add_argument(
        "--join-authority", default=_env("JOIN_AUTHORITY"), required=_env("JOIN_AUTHORITY") is None
    )
    sub.add_argument("--delegates-clear", action="store_true", default=_env_flag("DELEGATES_CLEAR"))
    sub.add_argument(
        "--delegates-added",
        "--delegate-added",
        nargs="*",
        default=str(_env("DELEGATES_ADDED", "")).split(),
        metavar="PUBKEY",
        help="[env: DELEGATES_ADDED (separated by spaces)]",
    )

    sub = command("join-authorization-read", "Show a join authorization", wallet=False)
    sub.add_argument(
        "--join-authority", default=_env("JOIN_AUTHORITY"), required=_env("JOIN_AUTHORITY") is None
    )
    sub.add_argument("--authorizer", default=_env("AUTHORIZER"), help="[env: AUTHORIZER]")

    sub = command("join-authorization-delete", "Deactivate the wallet's join authorization")
    sub.add_argument(
        "--authorizer",
        default=_env("AUTHORIZER"),
        required=_env("AUTHORIZER") is None,
        help="[env: AUTHORIZER]",
    )

    sub = command("can-join", "Whether an address may join a run", wallet=False)
    add_run_id(sub)
    sub.add_argument("--authorizer", default=_env("AUTHORIZER"), help="[env: AUTHORIZER]")
    add_address(sub)

    sub = command(
        "show",
        "Decode and print a run's on-chain state (as JSON with --json or as json-dump-run)",
        wallet=False,
        aliases=["json-dump-run"],
    )
    add_run_id(sub)
    add_treasurer_index(sub)
    sub.add_argument("--json", action="store_true", help="print JSON instead of text")

    sub = command(
        "json-dump-user",
        "Print, as JSON, what a run knows of one address (client, epoch, rewards)",
        wallet=False,
    )
    add_run_id(sub)
    add_treasurer_index(sub)
    add_address(sub)

    sub = command(
        "treasurer-top-up-rewards",
        "Transfer collateral from the wallet into a treasurer run's rewards vault",
    )
    add_run_id(sub)
    add_treasurer_index(sub)
    collateral = _env_float("COLLATERAL_AMOUNT")
    sub.add_argument(
        "--collateral-amount",
        type=non_negative_float,
        default=collateral,
        required=collateral is None,
        help="in the collateral mint's UI units [env: COLLATERAL_AMOUNT]",
    )

    sub = command(
        "treasurer-claim-rewards",
        "Claim the collateral the wallet earned in a treasurer run (as far as the vault holds)",
    )
    add_run_id(sub)
    add_treasurer_index(sub)

    sub = plain(
        "list-runs",
        "List the runs the wallet may join on the coordinator program",
        "List the runs the wallet may join on the coordinator program: not paused, finished or "
        "uninitialized, and authorized for everyone, for the wallet, or for the delegate "
        "authorizer AUTHORIZER; runs waiting for members first. The wallet is "
        "RAW_WALLET_PRIVATE_KEY or WALLET_PRIVATE_KEY_PATH (or -w), read after --env-file.",
    )
    sub.add_argument(
        "--env-file", type=Path, help="a .env file with RPC and wallet settings (KEY=VALUE lines)"
    )
    add_cluster_args(sub, late_env=True)
    add_wallet_args(sub)
    sub.add_argument(
        "--authorizer", default=None, help="only runs whose join authority is this public key"
    )

    sub = command(
        "download-results",
        "Download a run's result files from the run-down service (signed with the wallet)",
    )
    add_run_id(sub)
    sub.add_argument(
        "-o",
        "--output-dir",
        type=Path,
        default=Path(_env("OUTPUT_DIR", ".")),
        help="[env: OUTPUT_DIR]",
    )
    add_run_down_args(sub)
    sub.add_argument(
        "--overwrite",
        action="store_true",
        help="do not ask before writing into a non-empty --output-dir",
    )

    sub = command(
        "upload-data",
        "Upload a file or a directory's files to a run through the run-down service",
    )
    add_run_id(sub)
    sub.add_argument(
        "-p", "--path", type=Path, required=True, help="a single file or a directory to upload"
    )
    add_run_down_args(sub)

    sub = command(
        "predownload",
        "Fetch a run's model (--model) and evaluation datasets (--eval-tasks) before joining",
        wallet=False,
    )
    add_run_id(sub)
    sub.add_argument(
        "--model",
        action="store_true",
        default=_env_flag("MODEL"),
        help="the model of the run's checkpoint (hub repo or GCS bucket) [env: MODEL]",
    )
    sub.add_argument("--eval-tasks", default=_env("EVAL_TASKS"), help="[env: EVAL_TASKS]")
    sub.add_argument(
        "--hub-max-concurrent-downloads",
        type=int,
        default=_env_int("HUB_MAX_CONCURRENT_DOWNLOADS", 3),
        help="accepted as upstream's (huggingface_hub picks its own parallelism) "
        "[env: HUB_MAX_CONCURRENT_DOWNLOADS]",
    )

    what = "Print the wallet's public key and the P2P identity it trains with"
    sub = plain("show-identity", what, what)
    add_wallet_args(sub)
    sub.add_argument(
        "-r",
        "--run-id",
        default=_env("RUN_ID"),
        help="the P2P key is derived from the run id and the wallet",
    )
    sub.add_argument(
        "-i", "--identity-secret-key-path", type=Path, default=_env("IDENTITY_SECRET_KEY_PATH")
    )

    sub = plain("show-static-p2p-identity", "Print a P2P identity key file's key")
    sub.add_argument("identity_secret_key_path", type=Path, nargs="?")
    sub = plain("create-static-p2p-identity", "Write a new P2P identity key")
    sub.add_argument("save_path", type=Path)

    sub = plain(
        "train",
        "Join a run and train (the Psyche training client on a Solana coordinator)",
        "Join a run whose coordinator lives on Solana and train until stopped (Ctrl+C) or until "
        "the coordinator drops this client. Every train option can also be given in the "
        "environment, named in upper snake case (--micro-batch-size: MICRO_BATCH_SIZE).",
    )
    add_cluster_args(sub, backups=True)
    add_wallet_args(sub)
    from psyche.cli.solana_client.train import add_train_arguments

    add_train_arguments(sub)

    sub = command(
        "airdrop",
        "Request SOL from the cluster's faucet (a local endpoint or devnet), like `solana "
        "airdrop`: to --address, else to the wallet",
    )
    sub.add_argument("--sol", type=float, default=10.0, help="amount in SOL")
    sub.add_argument("--address", default=None, help="recipient (default: the wallet)")

    sub = plain(
        "create-wallet", "Write a new solana-keygen style keypair file (like `solana-keygen new`)"
    )
    sub.add_argument("save_path", type=Path)
    sub.add_argument("--force", action="store_true", help="replace an existing file")

    sub = plain("localnet", "Serve a local Solana endpoint with the Psyche programs (Python ports)")
    from psyche.solana.localnet.__main__ import add_arguments

    add_arguments(sub)
    add_verbose_flag(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The `psyche-solana-client` command (exit codes and signals: `psyche.core.cli`)."""
    return run_command(PROG, _main, argv)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from psyche.cli.solana_client import commands

    handler: Callable[[argparse.Namespace], int] = commands.HANDLERS[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
