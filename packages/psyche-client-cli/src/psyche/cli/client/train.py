"""`psyche-client train`: wire the centralized backend, the network and the client together.

The assembly every client binary shares (logging, `RunInitConfig` from the train options, the
trio run and its exit codes) is public here; `psyche-solana-client train` uses it too."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("psyche.cli.client")

_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "off": logging.CRITICAL + 10,
}


def apply_log_directives(spec: str) -> None:
    """`RUST_LOG`-style directives (`warn,psyche=debug`): a bare level sets the root logger, a
    `target=level` pair the logger of that name (`::` becomes `.`)."""
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        target, _, level = part.rpartition("=")
        value = _LEVELS.get(level.lower())
        if value is None:
            continue
        logging.getLogger(target.replace("::", ".") if target else None).setLevel(value)


def setup_logging(args: argparse.Namespace) -> None:
    """Logging as `--logs`, `--write-log` and `RUST_LOG`/`PSYCHE_LOG` say, plus the notes about
    options that are accepted but ignored."""
    from psyche.client.logs import setup_logging as setup_client_logging

    mode = args.logs
    if mode == "tui-and-console":
        mode = "tui"
    setup_client_logging("console" if mode == "none" else mode, write_log=args.write_log)
    if mode == "none":
        logging.getLogger().setLevel(logging.CRITICAL + 10)
    else:
        directives = os.environ.get("PSYCHE_LOG") or os.environ.get("RUST_LOG")
        if directives:
            apply_log_directives(directives)
    if args.metrics_local_port is not None:
        log.warning(
            "--metrics-local-port %s: local metrics are not built; ignored", args.metrics_local_port
        )
    if args.iroh_relay != "disabled":
        log.info("no relays in the Python client: peers connect directly")


def _preload() -> None:
    """Import torch, transformers and libp2p before joining, so the model loads quickly once
    the run's warmup starts (importing them takes seconds)."""
    from psyche.client.model_loading import preload_modeling

    preload_modeling()
    import psyche.network.connection  # noqa: F401


def run_init_config(args: argparse.Namespace, identity: Any, key: Any) -> Any:
    """The client's `RunInitConfig` from the train options (checks a hub repo is writable)."""
    from psyche.client.cooldown import CheckpointConfig, check_hub_repo_writable
    from psyche.client.init import RunInitConfig

    checkpoint = None
    if args.checkpoint_dir is not None:
        token = os.environ.get("HF_TOKEN")
        if args.hub_repo is not None:
            assert token is not None  # checked with the options
            check_hub_repo_writable(args.hub_repo, token)
        checkpoint = CheckpointConfig(
            checkpoint_dir=Path(args.checkpoint_dir),
            hub_repo=args.hub_repo,
            hub_token=token,
            delete_old_steps=bool(args.delete_old_steps),
            keep_steps=args.keep_steps,
        )
    return RunInitConfig(
        identity=identity,
        secret_key=key,
        device=args.device,
        micro_batch_size=args.micro_batch_size,
        grad_accum_in_fp32=bool(args.grad_accum_in_fp32),
        optim_stats_every_n_steps=args.optim_stats_steps,
        max_concurrent_parameter_requests=args.max_concurrent_parameter_requests,
        write_gradients_dir=args.write_gradients_dir,
        checkpoint=checkpoint,
    )


def run_client(
    args: argparse.Namespace, main: Callable[..., Awaitable[None]], *main_args: Any
) -> int:
    """Preload the heavy modules, check the device, run `main(*main_args)` under trio; the exit
    code: 0, 130 when interrupted, 2 for an unusable device, the failure's `exit_code` attribute
    if it has one, else 1 (the root cause is logged)."""
    import trio

    _preload()
    from psyche.client.model_loading import check_device
    from psyche.modeling.causal_lm import ModelLoadError

    try:
        check_device(args.device)
    except ModelLoadError as e:
        log.error("%s", e)
        return 2
    try:
        trio.run(main, *main_args)
    except KeyboardInterrupt:
        log.info("interrupted; exiting")
        return 130
    except BaseException as e:  # report the root cause, not the nursery's exception group
        root = _root_cause(e)
        if isinstance(root, KeyboardInterrupt):
            log.info("interrupted; exiting")
            return 130
        log.error("client stopped: %s: %s", type(root).__name__, root, exc_info=root)
        return int(getattr(root, "exit_code", 1))
    return 0


def train(args: argparse.Namespace) -> int:
    from psyche.cli.client.train_args import read_identity_secret_key
    from psyche.core.identity import SecretKey
    from psyche.core.node_identity import NodeIdentity

    setup_logging(args)
    key = read_identity_secret_key(args.identity_secret_key_path) or SecretKey.generate()
    identity = NodeIdentity.from_single_key(key.public_key)
    config = run_init_config(args, identity, key)
    log.info("client %s (public key %s) starting", identity, key.public_key.hex())
    return run_client(args, _run, args, key, config)


def _root_cause(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            if not isinstance(inner, KeyboardInterrupt):
                return _root_cause(inner)
    return error


async def _run(args: argparse.Namespace, key: Any, config: Any) -> None:
    from psyche.centralized.client import CentralizedBackend
    from psyche.client.client import Client
    from psyche.network.broadcast import Broadcast
    from psyche.network.connection import NetworkConfig, NetworkConnection
    from psyche.network.discovery import default_local_discovery_dir

    network_config = NetworkConfig(
        run_id=args.run_id,
        secret_key=key,
        interface=args.bind_p2p_interface,
        port=args.bind_p2p_port or 0,
        local_discovery_dir=(
            default_local_discovery_dir() if args.iroh_discovery == "local" else None
        ),
    )
    async with (
        CentralizedBackend.connect(
            args.server_addr,
            key,
            args.run_id,
            reconnect_timeout=args.server_reconnect_timeout or None,
        ) as backend,
        NetworkConnection.open(network_config, broadcast_type=Broadcast) as network,
    ):
        await Client(backend, network, config).run()
