"""What every Solana command does around its own work: open the backend on the cluster (signed by
the wallet, or by a throwaway key for read-only commands), run the work under trio, and turn a
failure the user meets into one line (`render.user_error`), a bug keeping its traceback
(`psyche.core.cli`)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from psyche.solana.commands.args import ClusterOptions, SignedCommand

Body = Callable[[Any], Awaitable[None]]
"""A command's work on the open backend (a `psyche.solana.backend.SolanaBackend`)."""


def open_backend(
    cluster: ClusterOptions,
    wallet_path: Path | None,
    *,
    wallet: bool = True,
    env: Mapping[str, str] | None = None,
) -> Any:
    """The backend on `cluster`, paying with the wallet (`RAW_WALLET_PRIVATE_KEY` or
    `wallet_path`); without `wallet`, a throwaway keypair, as upstream (it signs nothing).
    `env`: the environment to read the wallet and program ids from (default: the process's)."""
    from solders.keypair import Keypair

    from psyche.solana.backend import SolanaBackend
    from psyche.solana.keypair import load_wallet

    payer = load_wallet(wallet_path, env) if wallet else Keypair()
    return SolanaBackend(cluster.cluster(), payer, ids=cluster.ids.program_ids(env))


def run_on_cluster(
    cluster: ClusterOptions,
    wallet_path: Path | None,
    body: Body,
    *,
    wallet: bool = True,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run `body` on the open backend (see `open_backend`); 0, or a `UserError` saying what
    went wrong in one line."""
    import trio

    async def main() -> None:
        backend = open_backend(cluster, wallet_path, wallet=wallet, env=env)
        async with backend:
            await body(backend)

    try:
        trio.run(main)
    except BrokenPipeError:  # the output was closed (e.g. piped into `head`)
        return 0
    except Exception as e:
        raise_user_error(e, cluster.rpc)
    return 0


def run_signed(options: SignedCommand, body: Body) -> int:
    """`run_on_cluster` with the options' cluster and wallet."""
    return run_on_cluster(options.cluster, options.wallet_private_key_path, body)


def run_read(cluster: ClusterOptions, body: Body) -> int:
    """`run_on_cluster` for a command that signs nothing (a throwaway key pays)."""
    return run_on_cluster(cluster, None, body, wallet=False)


def raise_user_error(error: Exception, rpc_url: str | None) -> NoReturn:
    """Raise `error` as the `UserError` that explains it in one line, or as it is (a bug)."""
    from psyche.solana.commands.render import user_error

    explained = user_error(error, rpc_url)
    if explained is None:
        raise error
    raise explained from error


async def print_logs(backend: Any, signature: Any) -> None:
    print("\n===== Logs =====")
    for line in await backend.get_logs(signature):
        print(line)


def print_json(obj: Any) -> None:
    """As upstream's `serde_json::to_string_pretty` of a `json!` value: two-space indents and
    every object's keys in sorted order (serde_json's map is a BTreeMap there)."""
    print(json.dumps(obj, indent=2, sort_keys=True, allow_nan=False))


def pubkey(text: str | None) -> Any:
    """A base58 public key (None stays None); a malformed one is an `AdminError`."""
    from psyche.solana.admin import pubkey_arg

    return None if text is None else pubkey_arg(text)


__all__ = [
    "Body",
    "open_backend",
    "print_json",
    "print_logs",
    "pubkey",
    "raise_user_error",
    "run_on_cluster",
    "run_read",
    "run_signed",
]
