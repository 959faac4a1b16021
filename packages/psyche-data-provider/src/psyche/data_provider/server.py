"""Standalone TCP data server: `python -m psyche.data_provider.server --data-config data.toml
--port N --allow KEY ...`.

Only the listed ed25519 public keys (64 hex characters) may fetch. `--allow-file` names a file of
keys, one per line (`#` comments allowed), that is re-read whenever it changes, so a coordinator
running elsewhere can keep it equal to the run's current clients. `--allow-any` serves everyone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import trio

from psyche.data_provider.data_config import DataConfigError, DataServerInfo
from psyche.data_provider.tcp_server import DataProviderTcpServer
from psyche.data_provider.types import DataProviderError

log = logging.getLogger("psyche.data_provider.server")

ALLOW_FILE_POLL_SECONDS = 1.0


def parse_key(text: str) -> bytes:
    from psyche.core.identity import parse_hex_key

    try:
        return parse_hex_key(text, "the key")
    except ValueError as e:
        raise ValueError(f"not an ed25519 public key: {text.strip()!r}: {e}") from None


def read_allow_file(path: Path) -> set[bytes]:
    keys = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            try:
                keys.add(parse_key(line))
            except ValueError as e:
                raise ValueError(f"{path}:{number}: {e}") from None
    return keys


async def watch_allow_file(server: DataProviderTcpServer, path: Path, fixed: set[bytes]) -> None:
    """Keep the allowlist equal to `fixed` plus the file's keys, re-reading it when it changes."""
    seen: tuple[int, int] | None = None
    while True:
        try:
            stat = os.stat(path)
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp != seen:
                keys = read_allow_file(path)
                server.set_allowed(fixed | keys)
                log.info("allowlist from %s: %d keys", path, len(keys))
                seen = stamp
        except (OSError, ValueError) as e:
            # Keep the last good allowlist: a half-written file must not lock everyone out.
            log.warning("cannot read allowlist %s (keeping the previous one): %s", path, e)
        await trio.sleep(ALLOW_FILE_POLL_SECONDS)


async def serve(args: argparse.Namespace) -> None:
    info = DataServerInfo.load(args.data_config)
    provider = info.open_provider()
    fixed = {parse_key(k) for k in args.allow}
    if args.allow_any:
        log.warning("--allow-any: every client that connects may fetch data")
    elif not fixed and args.allow_file is None:
        log.warning("no --allow, --allow-file or --allow-any given: every request is rejected")
    async with (
        DataProviderTcpServer.start(
            provider, host=args.host, port=args.port, allowed=fixed, allow_any=args.allow_any
        ) as server,
        trio.open_nursery() as nursery,
    ):
        log.info(
            "serving %d sequences of %d tokens from %s on %s:%d",
            provider.num_sequences(),
            info.seq_len,
            info.dir,
            *server.local_addr,
        )
        if args.allow_file is not None:
            nursery.start_soon(watch_allow_file, server, Path(args.allow_file), fixed)
        await trio.sleep_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m psyche.data_provider.server",
        description="Host a pre-tokenized dataset for the clients of a run over authenticated TCP.",
    )
    parser.add_argument("--data-config", required=True, help="data.toml (dir, token_size, ...)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, required=True, help="TCP port (0: any free port)")
    parser.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="KEY",
        help="hex ed25519 public key allowed to fetch (repeatable)",
    )
    parser.add_argument("--allow-file", help="file of allowed keys, re-read when it changes")
    parser.add_argument("--allow-any", action="store_true", help="let every client fetch")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    try:
        for key in args.allow:
            parse_key(key)
        trio.run(serve, args)
    except KeyboardInterrupt:
        return 0
    except Exception as e:
        cause = _single_cause(e)
        if isinstance(cause, DataConfigError | DataProviderError | ValueError | OSError):
            log.error("%s", cause)
            return 1
        raise
    return 0


def _single_cause(e: BaseException) -> BaseException:
    """The one error inside (nested) exception groups, as trio's nurseries wrap errors."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e


if __name__ == "__main__":
    sys.exit(main())
