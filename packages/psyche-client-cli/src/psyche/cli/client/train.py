"""`psyche-client train`: the training client (`psyche.client.run.run_client`) on the
centralized backend (`psyche.centralized.client.CentralizedBackend`)."""

from __future__ import annotations

import argparse
import logging
from functools import partial

from psyche.client.setup.options import TrainOptions

log = logging.getLogger("psyche.cli.client")


def train(options: TrainOptions, args: argparse.Namespace) -> int:
    """Train with `options` on the coordinator server of `args` (`--server-addr` and its
    timeouts); the exit code is `run_client`'s."""
    from psyche.centralized.client import CentralizedBackend
    from psyche.client.run import network_config, run_client, setup_logging
    from psyche.client.setup.options import read_identity_secret_key
    from psyche.core.identity import SecretKey
    from psyche.core.node_identity import NodeIdentity

    key = read_identity_secret_key(options.identity_secret_key_path) or SecretKey.generate()
    setup_logging(options)
    identity = NodeIdentity.from_single_key(key.public_key)
    log.info("client %s (public key %s) starting", identity, key.public_key.hex())
    connect = partial(
        CentralizedBackend.connect,
        args.server_addr,
        key,
        options.run_id,
        connect_timeout=args.server_connect_timeout,
        reconnect_timeout=args.server_reconnect_timeout or None,
    )
    return run_client(
        options,
        identity,
        key,
        connect,
        network_config(options, key),
        service="psyche-centralized-client",  # upstream's OpenTelemetry service name
    )
