"""The commands of `psyche-solana-client`: parse-free shells around `psyche.solana.admin`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import trio

from psyche.cli.solana_client.render import (
    format_runs_table,
    render_run,
    run_to_json,
    rust_f64,
    user_error,
    user_to_json,
)
from psyche.core.cli import UserError

Command = Callable[[argparse.Namespace], int]


def predownload(args: argparse.Namespace) -> int:
    from psyche.cli.solana_client.predownload import predownload as run

    return run(args)


def program_ids(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Any:
    from psyche.solana.program_ids import ProgramIds

    return ProgramIds.from_env(
        env,
        coordinator=getattr(args, "coordinator_program_id", None),
        authorizer=getattr(args, "authorizer_program_id", None),
        treasurer=getattr(args, "treasurer_program_id", None),
    )


def _backend(
    args: argparse.Namespace, wallet: bool = True, env: Mapping[str, str] | None = None
) -> Any:
    from solders.keypair import Keypair

    from psyche.solana.backend import Cluster, SolanaBackend
    from psyche.solana.keypair import load_wallet

    # Read-only commands sign nothing: a throwaway keypair, as upstream.
    payer = load_wallet(args.wallet_private_key_path, env) if wallet else Keypair()
    return SolanaBackend(Cluster(args.rpc, args.ws_rpc), payer, ids=program_ids(args, env))


def _run(
    args: argparse.Namespace,
    body: Callable[[Any], Awaitable[None]],
    *,
    wallet: bool = True,
    env: Mapping[str, str] | None = None,
) -> int:
    """Build the backend and run the command body under trio; a failure the user meets becomes
    a `UserError` (one line), a bug keeps its traceback (`psyche.core.cli`). `env`: the
    environment to read the wallet and program ids from (default: the process's)."""

    async def main() -> None:
        backend = _backend(args, wallet, env)
        async with backend:
            await body(backend)

    try:
        trio.run(main)
    except BrokenPipeError:  # the output was closed (e.g. piped into `head`)
        return 0
    except Exception as e:
        error = user_error(e, getattr(args, "rpc", None))
        if error is None:
            raise
        raise error from e
    return 0


async def _print_logs(backend: Any, signature: Any) -> None:
    print("\n===== Logs =====")
    for line in await backend.get_logs(signature):
        print(line)


def _pubkey(text: str | None) -> Any:
    from psyche.solana.admin import pubkey_arg

    return None if text is None else pubkey_arg(text)


# ---------------------------------------------------------------------------------------------


def create_run(args: argparse.Namespace) -> int:
    from psyche.solana import admin

    async def body(backend: Any) -> None:
        created = await admin.create_run(
            backend,
            args.run_id,
            args.client_version,
            treasurer_index=args.treasurer_index,
            treasurer_collateral_mint=_pubkey(args.treasurer_collateral_mint),
            join_authority=_pubkey(args.join_authority),
        )
        print(f"Created run {args.run_id} with transaction: {created.signature}")
        print(f"Instance account: {created.instance_address}")
        print(f"Coordinator account: {created.account_address}")
        print(f"Locked for storage: {admin.lamports_to_sol(created.locked_lamports):.9f} SOL")

    return _run(args, body)


def close_run(args: argparse.Namespace) -> int:
    from psyche.solana import admin

    async def body(backend: Any) -> None:
        signature, recovered = await admin.close_run(backend, args.run_id)
        print(f"Closed run {args.run_id} with transaction {signature}")
        print(f"Recovered {admin.lamports_to_sol(recovered):.9f} SOL")
        await _print_logs(backend, signature)

    return _run(args, body)


def update_config(args: argparse.Namespace) -> int:
    from psyche.solana import admin

    async def body(backend: Any) -> None:
        update = await admin.update_config(
            backend,
            args.run_id,
            treasurer_index=args.treasurer_index,
            config_path=args.config_path,
            restart_from_step=args.restart_from_step,
            switch_to_hub=args.switch_to_hub,
            name=args.name,
            description=args.description,
            num_parameters=args.num_parameters,
            vocab_size=args.vocab_size,
            client_version=args.client_version,
        )
        print(f"Updated config of {args.run_id} with transaction {update.signature}")
        print(f" - Metadata: {update.metadata}")
        print(f" - Config: {update.config}")
        print(f" - Model: {update.model}")
        print(f" - Progress: {update.progress}")
        print(f" - Client version: {update.client_version}")
        await _print_logs(backend, update.signature)

    return _run(args, body)


def set_paused(args: argparse.Namespace) -> int:
    from psyche.solana import admin

    paused = not args.resume

    async def body(backend: Any) -> None:
        signature = await admin.set_paused(backend, args.run_id, paused, args.treasurer_index)
        state = "true" if paused else "false"
        print(f"Set pause state to {state} on run {args.run_id} with transaction {signature}")
        await _print_logs(backend, signature)

    return _run(args, body)


def set_future_epoch_rates(args: argparse.Namespace) -> int:
    from psyche.solana import admin

    async def body(backend: Any) -> None:
        signature = await admin.set_future_epoch_rates(
            backend,
            args.run_id,
            treasurer_index=args.treasurer_index,
            earning_rate_total_shared=args.earning_rate_total_shared,
            slashing_rate_per_client=args.slashing_rate_per_client,
        )
        if args.earning_rate_total_shared is not None:
            print(
                f" - Set earning rate to {args.earning_rate_total_shared} (divided between clients)"
            )
        if args.slashing_rate_per_client is not None:
            print(f" - Set slashing rate to {args.slashing_rate_per_client} (per failing client)")
        print(f"On run {args.run_id} with transaction {signature}:")
        await _print_logs(backend, signature)

    return _run(args, body)


def tick(args: argparse.Namespace) -> int:
    from psyche.solana import admin

    async def body(backend: Any) -> None:
        run = await admin.load_run(backend, args.run_id)
        count = args.count
        sent = 0
        while count is None or sent < count:
            started = trio.current_time()
            signature = await admin.tick(backend, run)
            sent += 1
            print(f"Ticked run {args.run_id} with transaction {signature}")
            await _print_logs(backend, signature)
            print()
            if count is not None and sent >= count:
                break
            await trio.sleep_until(started + args.ms_interval / 1000)

    return _run(args, body)


def checkpoint(args: argparse.Namespace) -> int:
    from psyche.solana import admin

    async def body(backend: Any) -> None:
        signature, repo = await admin.checkpoint(backend, args.run_id, args.repo, args.revision)
        print(f"Checkpointed to repo {repo} on run {args.run_id} with transaction {signature}")

    return _run(args, body)


def _print_authorization(result: Any) -> None:
    print(f"Authorization Grantor: {result.grantor}")
    print(f"Authorization Grantee: {result.grantee}")
    print(f"Authorization Address: {result.address}")


def join_authorization_create(args: argparse.Namespace) -> int:
    from psyche.solana import admin

    async def body(backend: Any) -> None:
        result = await admin.join_authorization_create(backend, _pubkey(args.authorizer))
        _print_authorization(result)
        if result.created is not None:
            print(f"Created authorization in transaction: {result.created}")
        if result.changed is not None:
            print(f"Activated authorization in transaction: {result.changed}")
        print(f"Authorization Active: {'true' if result.authorization.active else 'false'}")

    return _run(args, body)


def join_authorization_set_delegates(args: argparse.Namespace) -> int:
    from psyche.solana import admin

    delegates = [_pubkey(d) for d in args.delegates_added]

    async def body(backend: Any) -> None:
        result = await admin.join_authorization_set_delegates(
            backend,
            _pubkey(args.join_authority),
            delegates_clear=args.delegates_clear,
            delegates_added=delegates,
        )
        _print_authorization(result)
        print(f"Delegates cleared: {'true' if args.delegates_clear else 'false'}")
        print(f"Delegates added count: {len(delegates)}")
        for delegate in delegates:
            print(f"- Delegate added: {delegate}")
        print(f"Updated authorization delegates in transaction: {result.changed}")

    return _run(args, body)


def join_authorization_read(args: argparse.Namespace) -> int:
    from solders.pubkey import Pubkey

    from psyche.solana import admin

    async def body(backend: Any) -> None:
        result = await admin.join_authorization_read(
            backend, _pubkey(args.join_authority), _pubkey(args.authorizer)
        )
        _print_authorization(result)
        authorization = result.authorization
        print(f"Authorization Active: {'true' if authorization.active else 'false'}")
        print(f"Authorization Delegate Count: {len(authorization.delegates)}")
        for i, delegate in enumerate(authorization.delegates, start=1):
            print(f" - Authorization delegate #{i}: {Pubkey.from_bytes(delegate)}")

    return _run(args, body, wallet=False)


def join_authorization_delete(args: argparse.Namespace) -> int:
    from psyche.solana import admin

    async def body(backend: Any) -> None:
        result = await admin.join_authorization_delete(backend, _pubkey(args.authorizer))
        _print_authorization(result)
        if result.changed is not None:
            print(f"Deactivated authorization in transaction: {result.changed}")
        print(f"Authorization Active: {'true' if result.authorization.active else 'false'}")

    return _run(args, body)


def can_join(args: argparse.Namespace) -> int:
    """Upstream's `can-join`: exit 0 when the address may join, 1 (one line) when not."""
    from psyche.solana import admin

    async def body(backend: Any) -> None:
        address = _pubkey(args.address)
        check = await admin.can_join(backend, args.run_id, address, _pubkey(args.authorizer))
        print(f"authorization valid for run id {args.run_id} using pubkey {address}")
        print(f"Coordinator: run_state: {check.run_state}")
        print(f"Coordinator: is_paused: {'true' if check.is_paused else 'false'}")
        if not check.can_join:
            raise admin.AdminError(
                f"A client with our pubkey {address} is in the current epoch, you can't join "
                "with this key!"
            )
        print(f"✓ Can join run {args.run_id} with pubkey {address}")

    return _run(args, body, wallet=False)


def _print_json(obj: Any) -> None:
    """As upstream's `serde_json::to_string_pretty` of a `json!` value: two-space indents and
    every object's keys in sorted order (serde_json's map is a BTreeMap there)."""
    print(json.dumps(obj, indent=2, sort_keys=True, allow_nan=False))


def show(args: argparse.Namespace) -> int:
    """`show`, `show --json` and upstream's `json-dump-run` (the same parser)."""
    from psyche.solana import snapshots

    as_json = args.json or args.command == "json-dump-run"

    async def body(backend: Any) -> None:
        snapshot = await snapshots.fetch_run(backend, args.run_id, args.treasurer_index)
        if as_json:
            _print_json(run_to_json(snapshot))
        else:
            print(render_run(snapshot))

    return _run(args, body, wallet=False)


def json_dump_user(args: argparse.Namespace) -> int:
    from psyche.solana import snapshots

    async def body(backend: Any) -> None:
        user = await snapshots.fetch_user(
            backend, args.run_id, _pubkey(args.address), args.treasurer_index
        )
        _print_json(user_to_json(user))

    return _run(args, body, wallet=False)


def treasurer_top_up_rewards(args: argparse.Namespace) -> int:
    from psyche.solana import treasury as treasury_ops
    from psyche.solana.admin import ui_amount_to_native_amount

    async def body(backend: Any) -> None:
        treasury = await treasury_ops.load_treasury(backend, args.run_id, args.treasurer_index)
        ui = _ui_amount(treasury.decimals)
        _print_treasury(treasury)
        amount = ui_amount_to_native_amount(args.collateral_amount, treasury.decimals)
        print(f"User: {backend.get_payer()}")
        plan = await treasury_ops.prepare_top_up(backend, treasury, amount)
        print(f"User collateral amount: {ui(plan.user_collateral_amount)}")
        signature = await treasury_ops.top_up(backend, treasury, plan)
        print(f"Transfered {ui(amount)} collateral to treasurer in transaction: {signature}")

    return _run(args, body)


def treasurer_claim_rewards(args: argparse.Namespace) -> int:
    from psyche.solana import treasury as treasury_ops

    async def body(backend: Any) -> None:
        treasury = await treasury_ops.load_treasury(backend, args.run_id, args.treasurer_index)
        ui = _ui_amount(treasury.decimals)
        _print_treasury(treasury)
        print(f"User: {backend.get_payer()}")
        plan = await treasury_ops.prepare_claim(backend, treasury)
        if plan.created_user_collateral is not None:
            print(
                "Created associated token account for user during transaction: "
                f"{plan.created_user_collateral}"
            )
        print(f"User collateral amount: {ui(plan.user_collateral_amount)}")
        if plan.created_participant is not None:
            print(f"Created the participant claim during transaction: {plan.created_participant}")
        print(f"Total earned points: {plan.earned_points}")
        print(f"Already claimed earned points: {plan.claimed_earned_points}")
        print(f"Claimable earned points: {plan.claimable_earned_points}")
        # 1:1 between earned points and collateral base units
        print(f"Claimable collateral amount: {ui(plan.claimable_earned_points)}")
        amount = plan.claim_amount(treasury.collateral_amount)
        print(f"Claim collateral amount: {ui(amount)}")
        signature = await treasury_ops.claim(backend, treasury, amount)
        print(f"Claimed {ui(amount)} collateral in transaction: {signature}")

    return _run(args, body)


def _ui_amount(decimals: int) -> Callable[[int], str]:
    from psyche.solana.admin import native_amount_to_ui_amount

    return lambda native: rust_f64(native_amount_to_ui_amount(native, decimals))


def _print_treasury(treasury: Any) -> None:
    print(f"Found treasurer at index: 0x{treasury.index:08x}")
    print(f"Treasurer collateral mint: {treasury.collateral_mint}")
    amount = _ui_amount(treasury.decimals)(treasury.collateral_amount)
    print(f"Treasurer collateral amount: {amount}")


def list_runs(args: argparse.Namespace) -> int:
    import os
    import time

    from psyche.solana import runs as runs_ops
    from psyche.solana.admin import pubkey_arg
    from psyche.solana.backend import LOCALNET_RPC, LOCALNET_WS_RPC

    try:
        env = runs_ops.env_with_file(args.env_file, os.environ)
    except Exception as e:
        error = user_error(e, None)
        if error is None:
            raise
        raise error from e
    args.rpc = args.rpc or env.get("RPC") or LOCALNET_RPC
    args.ws_rpc = args.ws_rpc or env.get("WS_RPC") or LOCALNET_WS_RPC
    args.wallet_private_key_path = args.wallet_private_key_path or env.get(
        "WALLET_PRIVATE_KEY_PATH"
    )

    async def body(backend: Any) -> None:
        runs = await runs_ops.get_all_runs(backend)
        if not runs:
            print(f"No runs found on coordinator program {backend.ids.coordinator}")
            return
        authorizer = None if args.authorizer is None else pubkey_arg(args.authorizer)
        delegate = env.get("AUTHORIZER")
        delegate_authorizer = pubkey_arg(delegate) if delegate else None
        joinable = await runs_ops.find_joinable_runs(
            backend, runs, backend.get_payer(), authorizer, delegate_authorizer
        )
        if not joinable:
            print("No available runs to join")
            return
        print(f"Found {len(joinable)} joinable run(s):")
        for line in format_runs_table([run for run, _ in joinable], int(time.time())):
            print(line)

    return _run(args, body, env=env)


def download_results(args: argparse.Namespace) -> int:
    import sys

    from psyche.solana import run_down

    output_dir: Path = args.output_dir
    try:
        occupied = output_dir.is_dir() and any(output_dir.iterdir())
    except OSError as e:
        raise UserError(f"Failed to read output directory {output_dir}: {e.strerror or e}") from e
    if occupied and not args.overwrite:
        print(f'Warning: Output directory "{output_dir}" already exists and contains files.')
        print("Files may be overwritten during download.")
        print("Continue? [y/N]: ", end="", flush=True)
        answer = sys.stdin.readline() if sys.stdin is not None else ""
        if answer.strip().lower() != "y":
            print("Download cancelled.")
            return 0

    async def body(backend: Any) -> None:
        await trio.Path(output_dir).mkdir(parents=True, exist_ok=True)
        nonce = run_down.random_nonce()
        signature = run_down.generate_signature(
            backend.sign_message, args.run_id, args.expires_in_seconds, nonce
        )
        async with run_down.new_http_client() as http:
            found = await run_down.get_download_urls(
                http,
                args.run_down_service_url or run_down.RUN_DOWN_SERVICE_BASE_URL,
                args.run_id,
                signature,
                args.expires_in_seconds,
                nonce,
            )
            count = len(found.urls)
            print(f"Found {count} files to download")
            for index, entry in enumerate(found.urls, start=1):
                print(f"Downloading file {index}/{count}: {entry.path}")
                path = run_down.output_path(output_dir, entry.path)
                await run_down.download_to(http, entry.url, path)
                print(f'  Saved to: "{path}"')
        print(f'Successfully downloaded {count} files to "{output_dir}"')

    return _run(args, body)


def upload_data(args: argparse.Namespace) -> int:
    from psyche.solana import run_down

    async def body(backend: Any) -> None:
        base_dir, files = run_down.files_to_upload(args.path)
        if not files:
            print("No files found to upload")
            return
        print(f"Found {len(files)} file(s) to upload")
        async with run_down.new_http_client() as http:
            for index, path in enumerate(files, start=1):
                relative = path.relative_to(base_dir).as_posix()
                print(f"\n[{index}/{len(files)}] Uploading: {relative}")
                nonce = run_down.random_nonce()
                signature = run_down.generate_signature(
                    backend.sign_message, args.run_id, args.expires_in_seconds, nonce
                )
                target = await run_down.get_upload_url(
                    http,
                    args.run_down_service_url or run_down.RUN_DOWN_SERVICE_BASE_URL,
                    args.run_id,
                    signature,
                    relative,
                    args.expires_in_seconds,
                    nonce,
                )
                size = path.stat().st_size
                print(f"  Uploading {size} bytes...")
                await run_down.upload_from(http, target.url, path, size)
                print("  ✓ Upload successful")
        print(f"\n✓ Successfully uploaded {len(files)} file(s)")

    return _run(args, body)


def show_identity(args: argparse.Namespace) -> int:
    from psyche.core.identity import SecretKey
    from psyche.solana.keypair import derive_p2p_secret_key, load_wallet

    try:
        wallet = load_wallet(args.wallet_private_key_path)
        print(f"Wallet (signer) public key: {wallet.pubkey()}")
        if args.identity_secret_key_path is not None:
            key = SecretKey.read_file(args.identity_secret_key_path)
            source = str(args.identity_secret_key_path)
        elif args.run_id is not None:
            key = SecretKey.from_bytes(derive_p2p_secret_key(args.run_id, wallet))
            source = f"derived from run {args.run_id!r} and the wallet"
        else:
            print("P2P identity: pass --run-id (derived key) or --identity-secret-key-path")
            return 0
        print(f"P2P identity public key: {key.public_key.hex()} ({source})")
    except Exception as e:
        error = user_error(e, None)
        if error is None:
            raise
        raise error from e
    return 0


def show_static_p2p_identity(args: argparse.Namespace) -> int:
    from psyche.core.identity import SecretKey

    path = args.identity_secret_key_path
    if path is None:
        print("No identity secret key path given: a fresh random identity would be used.")
        return 0
    try:
        key = SecretKey.read_file(path)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from e
    except ValueError as e:
        raise UserError(str(e)) from e
    print(f"Public key: {key.public_key.hex()}")
    return 0


def create_static_p2p_identity(args: argparse.Namespace) -> int:
    from psyche.core.identity import SecretKey

    key = SecretKey.generate()
    try:
        key.write_file(args.save_path)
    except OSError as e:
        raise UserError(f"cannot write {args.save_path}: {e.strerror or e}") from e
    print(f"Public key: {key.public_key.hex()}")
    print(f"Wrote secret key to {args.save_path}")
    return 0


def train(args: argparse.Namespace) -> int:
    from psyche.cli.solana_client.train import train as run_train

    return run_train(args)


def airdrop(args: argparse.Namespace) -> int:
    from psyche.solana.admin import lamports_to_sol

    lamports = round(args.sol * 1_000_000_000)

    async def body(backend: Any) -> None:
        address = _pubkey(args.address) if args.address else backend.get_payer()
        signature = await backend.rpc_with_fallback(
            "request_airdrop", lambda c: c.request_airdrop(address, lamports)
        )
        await backend.rpc_with_fallback(
            "confirm_airdrop", lambda c: c.confirm_transaction(signature)
        )
        balance = await backend.get_balance(address)
        print(f"Airdropped {lamports_to_sol(lamports):.9f} SOL to {address} in {signature}")
        print(f"Balance: {lamports_to_sol(balance):.9f} SOL")

    return _run(args, body, wallet=args.address is None)


def create_wallet(args: argparse.Namespace) -> int:
    from solders.keypair import Keypair

    from psyche.solana.keypair import write_keypair_file

    if args.save_path.exists() and not args.force:
        raise UserError(f"{args.save_path} exists (pass --force to replace it)")
    keypair = Keypair()
    try:
        args.save_path.parent.mkdir(parents=True, exist_ok=True)
        write_keypair_file(keypair, args.save_path)
    except OSError as e:
        raise UserError(f"cannot write {args.save_path}: {e.strerror or e}") from e
    print(f"Wrote new keypair to {args.save_path}")
    print(f"pubkey: {keypair.pubkey()}")
    return 0


def localnet(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM, which end it normally (exit 0)."""
    from psyche.core.cli import single_cause
    from psyche.solana.localnet.__main__ import run

    try:
        return run(args)
    except BaseException as e:
        if isinstance(single_cause(e), KeyboardInterrupt):
            return 0
        raise


HANDLERS: dict[str, Command] = {
    "create-run": create_run,
    "close-run": close_run,
    "update-config": update_config,
    "set-paused": set_paused,
    "set-future-epoch-rates": set_future_epoch_rates,
    "tick": tick,
    "checkpoint": checkpoint,
    "join-authorization-create": join_authorization_create,
    "join-authorization-set-delegates": join_authorization_set_delegates,
    "join-authorization-delegate": join_authorization_set_delegates,
    "join-authorization-read": join_authorization_read,
    "join-authorization-delete": join_authorization_delete,
    "can-join": can_join,
    "show": show,
    "json-dump-run": show,
    "json-dump-user": json_dump_user,
    "treasurer-top-up-rewards": treasurer_top_up_rewards,
    "treasurer-claim-rewards": treasurer_claim_rewards,
    "list-runs": list_runs,
    "download-results": download_results,
    "upload-data": upload_data,
    "show-identity": show_identity,
    "show-static-p2p-identity": show_static_p2p_identity,
    "create-static-p2p-identity": create_static_p2p_identity,
    "train": train,
    "airdrop": airdrop,
    "create-wallet": create_wallet,
    "localnet": localnet,
    "predownload": predownload,
}
