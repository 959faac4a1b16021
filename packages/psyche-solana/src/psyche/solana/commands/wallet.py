"""Keys (upstream run-manager `wallet.rs` and solana-client's identity commands): a new wallet,
SOL from the cluster's faucet, the wallet's public key and the P2P identity it trains with, a
static P2P identity. Each command is its options and a `run_*` function that prints what it did
and returns the exit status."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psyche.core.cli import UserError
from psyche.solana.commands.args import SignedCommand, arg, wallet_arg
from psyche.solana.commands.shell import pubkey, raise_user_error, run_on_cluster


@dataclass(frozen=True, kw_only=True)
class ShowIdentityOptions:
    wallet_private_key_path: Path | None = wallet_arg()
    run_id: str | None = arg(
        "-r",
        "--run-id",
        env="RUN_ID",
        default=None,
        help="the P2P key is derived from the run id and the wallet",
    )
    identity_secret_key_path: Path | None = arg(
        "-i", "--identity-secret-key-path", type=Path, env="IDENTITY_SECRET_KEY_PATH", default=None
    )


def run_show_identity(options: ShowIdentityOptions) -> int:
    """The wallet's public key, and the P2P identity: the key file's, else the one derived
    from the run id and the wallet."""
    from psyche.core.identity import SecretKey
    from psyche.solana.keypair import derive_p2p_secret_key, load_wallet

    try:
        wallet = load_wallet(options.wallet_private_key_path)
        print(f"Wallet (signer) public key: {wallet.pubkey()}")
        if options.identity_secret_key_path is not None:
            key = SecretKey.read_file(options.identity_secret_key_path)
            source = str(options.identity_secret_key_path)
        elif options.run_id is not None:
            key = SecretKey.from_bytes(derive_p2p_secret_key(options.run_id, wallet))
            source = f"derived from run {options.run_id!r} and the wallet"
        else:
            print("P2P identity: pass --run-id (derived key) or --identity-secret-key-path")
            return 0
        print(f"P2P identity public key: {key.public_key.hex()} ({source})")
    except Exception as e:
        raise_user_error(e, None)
    return 0


@dataclass(frozen=True, kw_only=True)
class ShowStaticP2pIdentityOptions:
    identity_secret_key_path: Path | None = arg(
        "identity_secret_key_path", type=Path, nargs="?", default=None
    )


def run_show_static_p2p_identity(options: ShowStaticP2pIdentityOptions) -> int:
    from psyche.core.identity import SecretKey

    path = options.identity_secret_key_path
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


@dataclass(frozen=True, kw_only=True)
class CreateStaticP2pIdentityOptions:
    save_path: Path = arg("save_path", type=Path)


def run_create_static_p2p_identity(options: CreateStaticP2pIdentityOptions) -> int:
    from psyche.core.identity import SecretKey

    key = SecretKey.generate()
    try:
        key.write_file(options.save_path)
    except OSError as e:
        raise UserError(f"cannot write {options.save_path}: {e.strerror or e}") from e
    print(f"Public key: {key.public_key.hex()}")
    print(f"Wrote secret key to {options.save_path}")
    return 0


@dataclass(frozen=True, kw_only=True)
class AirdropOptions(SignedCommand):
    sol: float = arg(type=float, default=10.0, help="amount in SOL")
    address: str | None = arg(default=None, help="recipient (default: the wallet)")


def run_airdrop(options: AirdropOptions) -> int:
    """Request `sol` SOL from the cluster's faucet for `address`, else for the wallet."""
    from psyche.solana.admin import lamports_to_sol

    lamports = round(options.sol * 1_000_000_000)

    async def body(backend: Any) -> None:
        address = pubkey(options.address) if options.address else backend.get_payer()
        signature = await backend.rpc_with_fallback(
            "request_airdrop", lambda c: c.request_airdrop(address, lamports)
        )
        await backend.rpc_with_fallback(
            "confirm_airdrop", lambda c: c.confirm_transaction(signature)
        )
        balance = await backend.get_balance(address)
        print(f"Airdropped {lamports_to_sol(lamports):.9f} SOL to {address} in {signature}")
        print(f"Balance: {lamports_to_sol(balance):.9f} SOL")

    return run_on_cluster(
        options.cluster, options.wallet_private_key_path, body, wallet=options.address is None
    )


@dataclass(frozen=True, kw_only=True)
class CreateWalletOptions:
    save_path: Path = arg("save_path", type=Path)
    force: bool = arg(action="store_true", default=False, help="replace an existing file")


def run_create_wallet(options: CreateWalletOptions) -> int:
    """Write a new solana-keygen style keypair to `save_path` (`force`: over an existing one)."""
    from solders.keypair import Keypair

    from psyche.solana.keypair import write_keypair_file

    save_path = options.save_path
    if save_path.exists() and not options.force:
        raise UserError(f"{save_path} exists (pass --force to replace it)")
    keypair = Keypair()
    try:
        save_path.parent.mkdir(parents=True, exist_ok=True)
        write_keypair_file(keypair, save_path)
    except OSError as e:
        raise UserError(f"cannot write {save_path}: {e.strerror or e}") from e
    print(f"Wrote new keypair to {save_path}")
    print(f"pubkey: {keypair.pubkey()}")
    return 0


__all__ = [
    "AirdropOptions",
    "CreateStaticP2pIdentityOptions",
    "CreateWalletOptions",
    "ShowIdentityOptions",
    "ShowStaticP2pIdentityOptions",
    "run_airdrop",
    "run_create_static_p2p_identity",
    "run_create_wallet",
    "run_show_identity",
    "run_show_static_p2p_identity",
]
