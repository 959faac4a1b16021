"""`psyche-server relay`: only the server's circuit relay, for runs without a centralized server
(Solana runs). Clients behind NAT reserve a slot on it and reach each other through it; give
them its address with `--iroh-relay`.

Who may use it: the keys of `--authorized-keys` (the run's members; the file is re-read when it
changes, as the data server's `--allow-file`), or anyone with `--open`. It refuses to start with
neither, since nobody could use it.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from psyche.core.cli import serve_until_signalled, single_cause

log = logging.getLogger("psyche.cli.server.relay")


class _Members:
    """The relay's allowlist, as `watch_allow_file` keeps it (`set_allowed`)."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def set_allowed(self, keys: set[bytes]) -> None:
        self.keys = set(keys)

    def allowed(self, key: bytes) -> bool:
        return key in self.keys


def run_relay(args: argparse.Namespace) -> int:
    from psyche.cli.server.main import setup_logging

    setup_logging(False)
    if args.authorized_keys is None and not args.open:
        log.error("give --authorized-keys FILE (the run's members) or --open (anyone)")
        return 2
    from psyche.core.identity import SecretKey

    if args.identity_secret_key_path is not None:
        try:
            key = SecretKey.read_file(args.identity_secret_key_path)
        except (OSError, ValueError) as e:
            log.error("cannot read the relay's key %s: %s", args.identity_secret_key_path, e)
            return 1
    else:
        key = SecretKey.generate()
        log.warning(
            "no --identity-secret-key-path: a new relay identity, so a new address, each start"
        )
    if args.authorized_keys is not None:
        from psyche.data_provider.server import read_allow_file

        try:  # a bad file is an error at start; later, the last good list is kept
            read_allow_file(args.authorized_keys)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            log.error("cannot read the authorized keys %s: %s", args.authorized_keys, e)
            return 1

    import trio

    from psyche.network.relay import RelayOptions, open_relay

    members = _Members()
    allowed = (lambda key: True) if args.open else members.allowed
    options = RelayOptions(
        bind_host=args.bind_address,
        port=args.relay_port or 0,
        announce_host=args.relay_announce_address,
        max_reservations=args.max_reservations,
    )

    async def serve() -> None:
        import signal

        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with open_relay(key, allowed, options) as relay, trio.open_nursery() as nursery:
                if args.authorized_keys is not None:
                    from psyche.data_provider.server import watch_allow_file

                    nursery.start_soon(watch_allow_file, members, Path(args.authorized_keys), set())
                who = "anyone (--open)" if args.open else f"the keys in {args.authorized_keys}"
                log.info(
                    "serving %s; clients take --iroh-relay %s", who, ",".join(relay.multiaddrs())
                )
                await serve_until_signalled(signals, nursery, log)

    try:
        trio.run(serve)
    except BaseException as e:
        cause = single_cause(e)
        if isinstance(cause, OSError):
            log.error("cannot start the relay on port %s: %s", options.port, cause)
            return 1
        raise
    return 0
