"""Run the real `psyche-client` / `psyche-server` with the few network settings the chaos
proxies need and the command lines do not expose.

    python scripts/chaos/launch.py client train --run-id ... --server-addr ...
    python scripts/chaos/launch.py server run --state ...

Environment:
* `CHAOS_ANNOUNCE_HOST`, `CHAOS_BLOB_PORT` (client): the host peers are told to dial (a proxy
  on another loopback address) and a fixed port for the blob side channel, so the proxy can
  listen on it before the client starts (`NetworkConfig.announce_host` / `blob_port`).
* `CHAOS_DATA_SERVER_HOST` (server): the address the run's data server binds
  (`ServerOptions.data_server_host`), leaving the run's announced address to a proxy.

Everything else is the unmodified command: argument parsing, logging, backend, network, client
and server are the packages' own.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any


def _with_defaults(cls: Any, **overrides: Any) -> Any:
    """`cls` whose instances get `overrides` (the command builds its config with keywords)."""

    def build(*args: Any, **kwargs: Any) -> Any:
        return dataclasses.replace(cls(*args, **kwargs), **overrides)

    return build


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("client", "server"):
        print("usage: launch.py client|server ARGS...", file=sys.stderr)
        return 2
    which, rest = argv[0], argv[1:]
    if which == "client":
        import psyche.network.connection as connection
        from psyche.cli.client.main import main as client_main

        overrides: dict[str, Any] = {}
        if host := os.environ.get("CHAOS_ANNOUNCE_HOST"):
            overrides["announce_host"] = host
        if port := os.environ.get("CHAOS_BLOB_PORT"):
            overrides["blob_port"] = int(port)
        if overrides:
            connection.NetworkConfig = _with_defaults(connection.NetworkConfig, **overrides)  # type: ignore[misc]
        return client_main(rest)
    import psyche.centralized.server as server
    from psyche.cli.server.main import main as server_main

    if host := os.environ.get("CHAOS_DATA_SERVER_HOST"):
        server.ServerOptions = _with_defaults(server.ServerOptions, data_server_host=host)  # type: ignore[misc]
    return server_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
