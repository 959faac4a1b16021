"""Wallet keys: solana-keygen JSON keypair files, `RAW_WALLET_PRIVATE_KEY`, and the P2P identity a
Solana client derives from its wallet.

A solana-keygen file is a JSON array of the 64 bytes of the keypair (32 secret, then 32 public).
`RAW_WALLET_PRIVATE_KEY` holds either that JSON array or the base58 spelling of the 64 bytes;
when set, it wins over `--wallet-private-key-path` (upstream's rule).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from solders.keypair import Keypair

from psyche.core.atomic_file import write_atomically

RAW_WALLET_PRIVATE_KEY = "RAW_WALLET_PRIVATE_KEY"
NO_WALLET_MESSAGE = (
    "No wallet private key! Must pass --wallet-private-key-path or set RAW_WALLET_PRIVATE_KEY"
)


class KeypairError(ValueError):
    """A keypair file or string that cannot be used."""


def keypair_from_json(text: str, source: str = "keypair") -> Keypair:
    try:
        values = json.loads(text)
    except ValueError as e:
        raise KeypairError(f"{source}: not a JSON array of 64 bytes ({e})") from None
    if (
        not isinstance(values, list)
        or len(values) != 64
        or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 256 for v in values)
    ):
        raise KeypairError(f"{source}: expected a JSON array of 64 integers in 0..=255")
    try:
        return Keypair.from_bytes(bytes(values))
    except Exception as e:
        raise KeypairError(f"{source}: not a valid ed25519 keypair ({e})") from None


def keypair_from_raw(text: str, source: str = RAW_WALLET_PRIVATE_KEY) -> Keypair:
    """A JSON byte array (`[...]`) or a base58 64-byte keypair."""
    text = text.strip()
    if text.startswith("["):
        return keypair_from_json(text, source)
    import based58

    try:
        raw = based58.b58decode(text.encode())
    except ValueError:
        raise KeypairError(f"{source}: not a base58 64-byte keypair") from None
    if len(raw) != 64:
        raise KeypairError(f"{source}: a base58 keypair is 64 bytes, got {len(raw)}")
    try:
        return Keypair.from_bytes(raw)
    except ValueError as e:
        raise KeypairError(f"{source}: not a valid ed25519 keypair ({e})") from None


def read_keypair_file(path: Path | str) -> Keypair:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise KeypairError(f"{path}: keypair file not found") from None
    except OSError as e:
        raise KeypairError(f"{path}: cannot read keypair file ({e})") from None
    return keypair_from_json(text, str(path))


def write_keypair_file(keypair: Keypair, path: Path | str) -> None:
    """Write a solana-keygen style file atomically (the temporary file is owner-only)."""
    write_atomically(Path(path), json.dumps(list(bytes(keypair))))


def read_or_create_keypair_file(path: Path | str) -> Keypair:
    path = Path(path)
    if path.exists():
        return read_keypair_file(path)
    keypair = Keypair()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_keypair_file(keypair, path)
    return keypair


def load_wallet(
    wallet_private_key_path: Path | str | None, env: Mapping[str, str] | None = None
) -> Keypair:
    """The wallet: `RAW_WALLET_PRIVATE_KEY` if set, else the keypair file."""
    env = os.environ if env is None else env
    raw = env.get(RAW_WALLET_PRIVATE_KEY)
    if raw:
        return keypair_from_raw(raw)
    if wallet_private_key_path is None:
        raise KeypairError(NO_WALLET_MESSAGE)
    return read_keypair_file(wallet_private_key_path)


def derive_p2p_secret_key(run_id: str, wallet: Keypair) -> bytes:
    """The 32-byte P2P (iroh) secret key a Solana client uses when given none: the first 32
    bytes of `ChaCha20Rng::from_seed(sha256(run_id ‖ wallet secret))`, i.e. of the ChaCha20
    keystream with that key, a zero nonce and counter 0."""
    import hashlib

    seed = hashlib.sha256(run_id.encode("utf-8") + bytes(wallet.secret())).digest()
    return chacha20_keystream(seed, 32)


def chacha20_keystream(key: bytes, length: int) -> bytes:
    """The ChaCha20 (20 rounds) keystream for `key`, a zero nonce, from block 0."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    encryptor = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
    return encryptor.update(bytes(length))
