"""`python -m psyche.solana.localnet`: serve a local Solana endpoint until interrupted."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

DEFAULT_FUND_SOL = 1000


def build_parser(prog: str = "python -m psyche.solana.localnet") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "A local Solana endpoint (JSON-RPC + websocket) for Psyche without a validator. "
            "System and SPL programs run for real in LiteSVM; the Psyche programs run as their "
            "Python ports, not the deployed SBF binaries. State lives in memory only."
        ),
    )
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8899, help="JSON-RPC port (0 picks a free one)")
    parser.add_argument(
        "--ws-port", type=int, default=None, help="websocket port (default: --port + 1)"
    )
    parser.add_argument(
        "--fund",
        action="append",
        default=[],
        type=Path,
        metavar="KEYPAIR_PATH",
        help=f"give {DEFAULT_FUND_SOL} SOL to this keypair at start (created if missing)",
    )
    parser.add_argument("--coordinator-program-id", default=None)
    parser.add_argument("--authorizer-program-id", default=None)
    parser.add_argument("--treasurer-program-id", default=None)


def run(args: argparse.Namespace) -> int:
    from psyche.solana.keypair import read_or_create_keypair_file
    from psyche.solana.localnet.ledger import Ledger
    from psyche.solana.localnet.server import LocalnetServer, run_forever
    from psyche.solana.program_ids import ProgramIds

    ids = ProgramIds.from_env(
        coordinator=args.coordinator_program_id,
        authorizer=args.authorizer_program_id,
        treasurer=args.treasurer_program_id,
    )
    ledger = Ledger(ids)
    for path in args.fund:
        keypair = read_or_create_keypair_file(path)
        ledger.airdrop(keypair.pubkey(), DEFAULT_FUND_SOL * 1_000_000_000)
        print(f"funded {keypair.pubkey()} ({path}) with {DEFAULT_FUND_SOL} SOL", flush=True)
    ws_port = args.ws_port if args.ws_port is not None else (args.port + 1 if args.port else 0)
    server = LocalnetServer(ledger, args.host, args.port, ws_port)

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
        print(f"error: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
