"""`python -m psyche.solana.localnet` (and `psyche-solana-client localnet`): serve a local Solana
endpoint until interrupted. `LocalnetOptions` declares its flags; `run_localnet` serves."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from psyche.core.cli import EnvOptions, add_options, options_from_args
from psyche.solana.commands.args import arg

DEFAULT_FUND_SOL = 1000


@dataclass(frozen=True, kw_only=True)
class LocalnetOptions:
    host: str = arg(default="127.0.0.1", help="address to listen on")
    port: int = arg(type=int, default=8899, help="JSON-RPC port (0 picks a free one)")
    ws_port: int | None = arg(type=int, default=None, help="websocket port (default: --port + 1)")
    fund: list[Path] = arg(
        action="append",
        default_factory=list,
        type=Path,
        metavar="KEYPAIR_PATH",
        help=f"give {DEFAULT_FUND_SOL} SOL to this keypair at start (created if missing)",
    )
    coordinator_program_id: str | None = arg(default=None)
    authorizer_program_id: str | None = arg(default=None)
    treasurer_program_id: str | None = arg(default=None)


def build_parser(prog: str = "python -m psyche.solana.localnet") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "A local Solana endpoint (JSON-RPC + websocket) for Psyche without a validator. "
            "System and SPL programs run for real in LiteSVM; the Psyche programs run as their "
            "Python ports, not the deployed SBF binaries. State lives in memory only."
        ),
    )
    add_options(parser, EnvOptions(), LocalnetOptions)
    return parser


def serve(options: LocalnetOptions) -> int:
    """Fund the keypairs, print the endpoint's URLs and serve until interrupted (a
    KeyboardInterrupt); 1 when it cannot listen."""
    from psyche.solana.keypair import read_or_create_keypair_file
    from psyche.solana.localnet.ledger import Ledger
    from psyche.solana.localnet.server import LocalnetServer, run_forever
    from psyche.solana.program_ids import ProgramIds

    ids = ProgramIds.from_env(
        coordinator=options.coordinator_program_id,
        authorizer=options.authorizer_program_id,
        treasurer=options.treasurer_program_id,
    )
    ledger = Ledger(ids)
    for path in options.fund:
        keypair = read_or_create_keypair_file(path)
        ledger.airdrop(keypair.pubkey(), DEFAULT_FUND_SOL * 1_000_000_000)
        print(f"funded {keypair.pubkey()} ({path}) with {DEFAULT_FUND_SOL} SOL", flush=True)
    port = options.port
    ws_port = options.ws_port if options.ws_port is not None else (port + 1 if port else 0)
    server = LocalnetServer(ledger, options.host, port, ws_port)

    def ready(server: LocalnetServer) -> None:
        print(f"JSON-RPC: {server.rpc_url}", flush=True)
        print(f"websocket: {server.ws_url}", flush=True)
        print(
            f"programs: coordinator {ids.coordinator}, authorizer {ids.authorizer}, "
            f"treasurer {ids.treasurer} (Python ports)",
            flush=True,
        )

    try:
        run_forever(server, ready)
    except OSError as e:
        print(f"error: cannot serve on {options.host}:{port}: {e}", file=sys.stderr)
        return 1
    return 0


def run_localnet(options: LocalnetOptions) -> int:
    """`serve` until SIGINT or SIGTERM, which end it normally (exit 0)."""
    from psyche.core.cli import single_cause

    try:
        return serve(options)
    except BaseException as e:
        if isinstance(single_cause(e), KeyboardInterrupt):
            return 0
        raise


def main(argv: Sequence[str] | None = None) -> int:
    return serve(options_from_args(LocalnetOptions, build_parser().parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
