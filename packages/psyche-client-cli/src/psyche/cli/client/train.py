"""`psyche-client train`: wire the centralized backend, the network and the client together.

The assembly every client binary shares (logging, `RunInitConfig` from the train options, the
trio run and its exit codes) is public here; `psyche-solana-client train` uses it too.

Start-up order: the client reaches its coordinator first, so that within a second it says what
it is waiting for, while torch and transformers load in a worker thread (seconds); it joins the
run once they are loaded (so it is ready when the warmup starts), then starts the network and
the training client."""

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


class Preload:
    """Torch, transformers and libp2p imported (and `--device` checked) in a worker thread,
    so the model loads quickly once the run's warmup starts (importing them takes seconds) and
    the trio loop keeps talking to the coordinator meanwhile. `wait()` returns once they are
    loaded; an unusable device is an `OptionError` (exit 2)."""

    def __init__(self, device: str) -> None:
        import trio

        self.device = device
        self._done = trio.Event()

    async def run(self) -> None:
        import trio

        await trio.to_thread.run_sync(self._load, abandon_on_cancel=True)
        self._done.set()

    def _load(self) -> None:
        from psyche.cli.client.train_args import OptionError
        from psyche.client.model_loading import check_device, preload_modeling
        from psyche.modeling.causal_lm import ModelLoadError

        log.debug("loading torch and transformers")
        preload_modeling()
        import psyche.network.connection  # noqa: F401

        try:
            check_device(self.device)
        except ModelLoadError as e:
            raise OptionError(str(e)) from None

    async def wait(self) -> None:
        if not self._done.is_set():
            log.info("loading torch and transformers before joining (a few seconds)")
        await self._done.wait()


def run_init_config(args: argparse.Namespace, identity: Any, key: Any) -> Any:
    """The client's `RunInitConfig` from the train options (checks a hub repo is writable)."""
    from psyche.client.cooldown import (
        CheckpointConfig,
        check_hub_repo_writable,
        remove_stale_staging,
    )
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
        remove_stale_staging(checkpoint.checkpoint_dir)
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
    """Run `main(preload, *main_args)` under trio while `Preload` loads the heavy modules
    (`main` awaits `preload.wait()` before it needs them). The exit code: 0; 130 (143 after
    SIGTERM) when interrupted; a failure with an `exit_code` attribute (another client version)
    is logged in one line and ends with that code; anything else is raised for the command to
    report (`psyche.core.cli`: one line for a user error, the traceback for a bug)."""
    import trio

    from psyche.core.cli import (
        interrupt_exit_code,
        interrupted_by,
        single_cause,
        user_error_message,
    )

    async def both() -> None:
        preload = Preload(args.device)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(preload.run)
            await main(preload, *main_args)
            nursery.cancel_scope.cancel()

    try:
        trio.run(both)
    except BaseException as e:  # judged by the root cause, not the nursery's exception group
        root = single_cause(e)
        if isinstance(root, KeyboardInterrupt):
            log.info("interrupted by %s; exiting", interrupted_by())
            return interrupt_exit_code()
        if user_error_message(root) is None and hasattr(root, "exit_code"):
            log.error("client stopped: %s", root)
            return int(root.exit_code)
        raise
    return 0


def train(args: argparse.Namespace) -> int:
    from psyche.cli.client.train_args import read_identity_secret_key
    from psyche.core.identity import SecretKey
    from psyche.core.node_identity import NodeIdentity

    key = read_identity_secret_key(args.identity_secret_key_path) or SecretKey.generate()
    setup_logging(args)
    identity = NodeIdentity.from_single_key(key.public_key)
    log.info("client %s (public key %s) starting", identity, key.public_key.hex())
    return run_client(args, _run, args, key, identity)


async def _run(preload: Preload, args: argparse.Namespace, key: Any, identity: Any) -> None:
    import trio

    from psyche.centralized.client import CentralizedBackend

    async with CentralizedBackend.connect(
        args.server_addr,
        key,
        args.run_id,
        connect_timeout=args.server_connect_timeout,
        reconnect_timeout=args.server_reconnect_timeout or None,
        before_join=preload.wait,
    ) as backend:
        config = await trio.to_thread.run_sync(run_init_config, args, identity, key)
        from psyche.client.broadcast import Broadcast
        from psyche.client.client import Client
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
        async with NetworkConnection.open(network_config, broadcast_type=Broadcast) as network:
            await Client(backend, network, config).run()
