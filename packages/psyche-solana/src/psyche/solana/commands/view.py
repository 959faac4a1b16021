"""Reading runs (upstream run-manager `json_dump_run.rs`, `json_dump_user.rs` and the runs list):
a run's decoded state as text or JSON, what a run knows of one address, the runs a wallet may
join. Each command is its options and a `run_*` function that prints and returns the exit
status."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psyche.core.cli import nested
from psyche.solana.cluster import LOCALNET_RPC, LOCALNET_WS_RPC
from psyche.solana.commands.args import (
    CLUSTER_GROUP,
    ClusterOptions,
    ProgramIdOptions,
    RunQuery,
    address_arg,
    arg,
    treasurer_index_arg,
    wallet_arg,
)
from psyche.solana.commands.shell import (
    print_json,
    pubkey,
    raise_user_error,
    run_on_cluster,
    run_read,
)


@dataclass(frozen=True, kw_only=True)
class ShowOptions(RunQuery):
    treasurer_index: int | None = treasurer_index_arg()
    json: bool = arg(action="store_true", default=False, help="print JSON instead of text")


def run_show(options: ShowOptions) -> int:
    """`show` (`json`: upstream's `json-dump-run`, which is `show --json`)."""
    from psyche.solana import snapshots
    from psyche.solana.commands.render import render_run, run_to_json

    async def body(backend: Any) -> None:
        snapshot = await snapshots.fetch_run(backend, options.run_id, options.treasurer_index)
        if options.json:
            print_json(run_to_json(snapshot))
        else:
            print(render_run(snapshot))

    return run_read(options.cluster, body)


@dataclass(frozen=True, kw_only=True)
class JsonDumpUserOptions(RunQuery):
    treasurer_index: int | None = treasurer_index_arg()
    address: str = address_arg()


def run_json_dump_user(options: JsonDumpUserOptions) -> int:
    from psyche.solana import snapshots
    from psyche.solana.commands.render import user_to_json

    async def body(backend: Any) -> None:
        user = await snapshots.fetch_user(
            backend, options.run_id, pubkey(options.address), options.treasurer_index
        )
        print_json(user_to_json(user))

    return run_read(options.cluster, body)


@dataclass(frozen=True, kw_only=True)
class ListRunsOptions:
    """The cluster and the wallet may come from `env_file` (read before they are looked for)."""

    env_file: Path | None = arg(
        type=Path,
        default=None,
        help="a .env file with RPC and wallet settings (KEY=VALUE lines)",
    )
    rpc: str | None = arg(
        group=CLUSTER_GROUP, default=None, help=f"[env: RPC] [default: {LOCALNET_RPC}]"
    )
    ws_rpc: str | None = arg(
        group=CLUSTER_GROUP, default=None, help=f"[env: WS_RPC] [default: {LOCALNET_WS_RPC}]"
    )
    ids: ProgramIdOptions = nested(ProgramIdOptions)
    wallet_private_key_path: Path | None = wallet_arg()
    authorizer: str | None = arg(
        default=None, help="only runs whose join authority is this public key"
    )


def run_list_runs(options: ListRunsOptions) -> int:
    """The runs the wallet may join: not paused, finished or uninitialized, and authorized for
    everyone, for the wallet, or for the delegate authorizer `AUTHORIZER`; runs waiting for
    members first."""
    import os
    import time

    from psyche.solana import runs as runs_ops
    from psyche.solana.admin import pubkey_arg
    from psyche.solana.commands.render import format_runs_table

    try:
        env = runs_ops.env_with_file(options.env_file, os.environ)
    except Exception as e:
        raise_user_error(e, None)
    cluster = ClusterOptions(
        rpc=options.rpc or env.get("RPC") or LOCALNET_RPC,
        ws_rpc=options.ws_rpc or env.get("WS_RPC") or LOCALNET_WS_RPC,
        ids=options.ids,
    )
    wallet = options.wallet_private_key_path or env.get("WALLET_PRIVATE_KEY_PATH")

    async def body(backend: Any) -> None:
        runs = await runs_ops.get_all_runs(backend)
        if not runs:
            print(f"No runs found on coordinator program {backend.ids.coordinator}")
            return
        authorizer = None if options.authorizer is None else pubkey_arg(options.authorizer)
        delegate = env.get("AUTHORIZER")
        delegate_authorizer = pubkey_arg(delegate) if delegate else None
        joinable = await runs_ops.find_joinable_runs(
            backend, runs, backend.get_payer(), authorizer, delegate_authorizer
        )
        if not joinable:
            print("No available runs to join")
            return
        print(f"Found {len(joinable)} joinable run(s):")
        for line in format_runs_table([run for run, _ in joinable], int(time.time())):
            print(line)

    return run_on_cluster(cluster, None if wallet is None else Path(wallet), body, env=env)


__all__ = [
    "JsonDumpUserOptions",
    "ListRunsOptions",
    "ShowOptions",
    "run_json_dump_user",
    "run_list_runs",
    "run_show",
]
