"""Managing a run (upstream run-manager `commands/run/`): create it, close it, update its config,
pause or resume it, set its reward rates, tick it, point its checkpoint at a repo. Each command
is its options and a `run_*` function that prints what it did and returns the exit status (the
signing wallet: `wallet_private_key_path`, or `RAW_WALLET_PRIVATE_KEY`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psyche.solana.commands.args import (
    RunCommand,
    arg,
    env_arg,
    env_flag,
    non_negative_float,
    treasurer_index_arg,
)
from psyche.solana.commands.shell import print_logs, pubkey, run_signed


@dataclass(frozen=True, kw_only=True)
class CreateRunOptions(RunCommand):
    client_version: str = env_arg("CLIENT_VERSION", "-c", "--client-version", required=True)
    treasurer_index: int | None = treasurer_index_arg()
    treasurer_collateral_mint: str | None = arg(env="TREASURER_COLLATERAL_MINT", default=None)
    join_authority: str | None = arg(default=None, help="default: the wallet")


def run_create_run(options: CreateRunOptions) -> int:
    from psyche.solana import admin

    async def body(backend: Any) -> None:
        created = await admin.create_run(
            backend,
            options.run_id,
            options.client_version,
            treasurer_index=options.treasurer_index,
            treasurer_collateral_mint=pubkey(options.treasurer_collateral_mint),
            join_authority=pubkey(options.join_authority),
        )
        print(f"Created run {options.run_id} with transaction: {created.signature}")
        print(f"Instance account: {created.instance_address}")
        print(f"Coordinator account: {created.account_address}")
        print(f"Locked for storage: {admin.lamports_to_sol(created.locked_lamports):.9f} SOL")

    return run_signed(options, body)


@dataclass(frozen=True, kw_only=True)
class CloseRunOptions(RunCommand):
    """Only which run (halted) and who signs."""


def run_close_run(options: CloseRunOptions) -> int:
    from psyche.solana import admin

    async def body(backend: Any) -> None:
        signature, recovered = await admin.close_run(backend, options.run_id)
        print(f"Closed run {options.run_id} with transaction {signature}")
        print(f"Recovered {admin.lamports_to_sol(recovered):.9f} SOL")
        await print_logs(backend, signature)

    return run_signed(options, body)


@dataclass(frozen=True, kw_only=True)
class UpdateConfigOptions(RunCommand):
    treasurer_index: int | None = treasurer_index_arg()
    config_path: Path | None = env_arg(
        "CONFIG_PATH", type=Path, default=None, help="TOML with [config] and [model]"
    )
    restart_from_step: int | None = arg(
        type=int, env="RESTART_FROM_STEP", from_env=int, default=None
    )
    switch_to_hub: bool = arg(
        action="store_true", env="SWITCH_TO_HUB", from_env=env_flag, default=False
    )
    name: str | None = arg(default=None)
    description: str | None = arg(default=None)
    num_parameters: int | None = arg(type=int, default=None)
    vocab_size: int | None = arg(type=int, default=None)
    client_version: str | None = arg(env="CLIENT_VERSION", default=None)


def run_update_config(options: UpdateConfigOptions) -> int:
    from psyche.solana import admin

    async def body(backend: Any) -> None:
        update = await admin.update_config(
            backend,
            options.run_id,
            treasurer_index=options.treasurer_index,
            config_path=options.config_path,
            restart_from_step=options.restart_from_step,
            switch_to_hub=options.switch_to_hub,
            name=options.name,
            description=options.description,
            num_parameters=options.num_parameters,
            vocab_size=options.vocab_size,
            client_version=options.client_version,
        )
        print(f"Updated config of {options.run_id} with transaction {update.signature}")
        print(f" - Metadata: {update.metadata}")
        print(f" - Config: {update.config}")
        print(f" - Model: {update.model}")
        print(f" - Progress: {update.progress}")
        print(f" - Client version: {update.client_version}")
        await print_logs(backend, update.signature)

    return run_signed(options, body)


@dataclass(frozen=True, kw_only=True)
class SetPausedOptions(RunCommand):
    treasurer_index: int | None = treasurer_index_arg()
    resume: bool = arg(action="store_true", env="RESUME", from_env=env_flag, default=False)


def run_set_paused(options: SetPausedOptions) -> int:
    from psyche.solana import admin

    paused = not options.resume

    async def body(backend: Any) -> None:
        signature = await admin.set_paused(backend, options.run_id, paused, options.treasurer_index)
        state = "true" if paused else "false"
        print(f"Set pause state to {state} on run {options.run_id} with transaction {signature}")
        await print_logs(backend, signature)

    return run_signed(options, body)


@dataclass(frozen=True, kw_only=True)
class SetFutureEpochRatesOptions(RunCommand):
    treasurer_index: int | None = treasurer_index_arg()
    earning_rate_total_shared: float | None = env_arg(
        "EARNING_RATE_TOTAL_SHARED", type=non_negative_float, from_env=float, default=None
    )
    slashing_rate_per_client: float | None = env_arg(
        "SLASHING_RATE_PER_CLIENT", type=non_negative_float, from_env=float, default=None
    )


def run_set_future_epoch_rates(options: SetFutureEpochRatesOptions) -> int:
    from psyche.solana import admin

    earning, slashing = options.earning_rate_total_shared, options.slashing_rate_per_client

    async def body(backend: Any) -> None:
        signature = await admin.set_future_epoch_rates(
            backend,
            options.run_id,
            treasurer_index=options.treasurer_index,
            earning_rate_total_shared=earning,
            slashing_rate_per_client=slashing,
        )
        if earning is not None:
            print(f" - Set earning rate to {earning} (divided between clients)")
        if slashing is not None:
            print(f" - Set slashing rate to {slashing} (per failing client)")
        print(f"On run {options.run_id} with transaction {signature}:")
        await print_logs(backend, signature)

    return run_signed(options, body)


@dataclass(frozen=True, kw_only=True)
class TickOptions(RunCommand):
    ms_interval: int = env_arg(
        "MS_INTERVAL", type=int, default=1000, help="milliseconds between ticks"
    )
    count: int | None = env_arg(
        "COUNT", type=int, default=None, help="ticks to send (default: until stopped)"
    )


def run_tick(options: TickOptions) -> int:
    """Tick the run every `ms_interval` ms, `count` times (None: until stopped)."""
    import trio

    from psyche.solana import admin

    async def body(backend: Any) -> None:
        run = await admin.load_run(backend, options.run_id)
        count = options.count
        sent = 0
        while count is None or sent < count:
            started = trio.current_time()
            signature = await admin.tick(backend, run)
            sent += 1
            print(f"Ticked run {options.run_id} with transaction {signature}")
            await print_logs(backend, signature)
            print()
            if count is not None and sent >= count:
                break
            await trio.sleep_until(started + options.ms_interval / 1000)

    return run_signed(options, body)


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions(RunCommand):
    repo: str = arg(env="REPO", required=True)
    revision: str | None = arg(env="REVISION", default=None)


def run_checkpoint(options: CheckpointOptions) -> int:
    from psyche.solana import admin

    async def body(backend: Any) -> None:
        signature, repo = await admin.checkpoint(
            backend, options.run_id, options.repo, options.revision
        )
        print(f"Checkpointed to repo {repo} on run {options.run_id} with transaction {signature}")

    return run_signed(options, body)


__all__ = [
    "CheckpointOptions",
    "CloseRunOptions",
    "CreateRunOptions",
    "SetFutureEpochRatesOptions",
    "SetPausedOptions",
    "TickOptions",
    "UpdateConfigOptions",
    "run_checkpoint",
    "run_close_run",
    "run_create_run",
    "run_set_future_epoch_rates",
    "run_set_paused",
    "run_tick",
    "run_update_config",
]
