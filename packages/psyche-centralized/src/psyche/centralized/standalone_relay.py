"""`psyche-server relay`: only the server's circuit relay, for runs without a centralized server
(Solana runs). Clients behind NAT reserve a slot on it and reach each other through it; give
them its address with `--iroh-relay`.

    from psyche.centralized.options import StandaloneRelayOptions
    from psyche.centralized.standalone_relay import run_relay

    code = run_relay(StandaloneRelayOptions(authorized_keys=Path("members.txt")))

Who may use it: the keys of `authorized_keys` (the run's members; the file is re-read when it
changes, as the data server's `--allow-file`), or anyone with `open`. It refuses to start with
neither (exit status 2), since nobody could use it. It serves until SIGINT or SIGTERM (0); a key
or a port it cannot use is one logged line and 1.
"""

from __future__ import annotations

import logging

from psyche.centralized.options import StandaloneRelayOptions
from psyche.core.cli import run_serving, serve_until_signalled

log = logging.getLogger(__name__)


class _Members:
    """The relay's allowlist, as `watch_allow_file` keeps it (`set_allowed`)."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def set_allowed(self, keys: set[bytes]) -> None:
        self.keys = set(keys)

    def allowed(self, key: bytes) -> bool:
        return key in self.keys


def run_relay(options: StandaloneRelayOptions) -> int:
    """Serve the relay of `options` until SIGINT or SIGTERM; the exit status (see the module)."""
    from psyche.centralized.run import setup_logging

    setup_logging(False)
    if options.authorized_keys is None and not options.open:
        log.error("give --authorized-keys FILE (the run's members) or --open (anyone)")
        return 2
    from psyche.core.identity import SecretKey

    if options.identity_secret_key_path is not None:
        try:
            key = SecretKey.read_file(options.identity_secret_key_path)
        except (OSError, ValueError) as e:
            log.error("cannot read the relay's key %s: %s", options.identity_secret_key_path, e)
            return 1
    else:
        key = SecretKey.generate()
        log.warning(
            "no --identity-secret-key-path: a new relay identity, so a new address, each start"
        )
    members_file = options.authorized_keys
    if members_file is not None:
        from psyche.data_provider.server import read_allow_file

        try:  # a bad file is an error at start; later, the last good list is kept
            read_allow_file(members_file)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            log.error("cannot read the authorized keys %s: %s", members_file, e)
            return 1

    import trio

    from psyche.network import open_relay

    members = _Members()
    allowed = (lambda key: True) if options.open else members.allowed
    relay_options = options.relay_options()

    async def serve() -> None:
        import signal

        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with (
                open_relay(key, allowed, relay_options) as relay,
                trio.open_nursery() as nursery,
            ):
                if members_file is not None:
                    from psyche.data_provider.server import watch_allow_file

                    nursery.start_soon(watch_allow_file, members, members_file, set())
                who = "anyone (--open)" if options.open else f"the keys in {members_file}"
                log.info(
                    "serving %s; clients take --iroh-relay %s", who, ",".join(relay.multiaddrs())
                )
                await serve_until_signalled(signals, nursery, log)

    return run_serving(
        serve, log, {OSError: f"cannot start the relay on port {relay_options.port}: %s"}
    )


__all__ = ["run_relay"]
