"""Wallet keypairs, the derived P2P identity, and the retry rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from solders.keypair import Keypair
from solders.signature import Signature

from psyche.solana.keypair import (
    NO_WALLET_MESSAGE,
    KeypairError,
    chacha20_keystream,
    derive_p2p_secret_key,
    keypair_from_raw,
    load_wallet,
    read_keypair_file,
    write_keypair_file,
)
from psyche.solana.retry import RetryFailed, RetryKind, RetryPolicy, classify, retry_with_backoff
from psyche.solana.rpc import (
    AccountNotFound,
    ConfirmationTimeout,
    RpcResponseError,
    RpcTransportError,
    TransactionError,
)


def test_keypair_file_round_trip(tmp_path: Path) -> None:
    keypair = Keypair()
    path = tmp_path / "id.json"
    write_keypair_file(keypair, path)
    values = json.loads(path.read_text())
    assert len(values) == 64
    assert values[32:] == list(bytes(keypair.pubkey()))
    assert read_keypair_file(path).pubkey() == keypair.pubkey()


def test_keypair_file_errors(tmp_path: Path) -> None:
    with pytest.raises(KeypairError, match="not found"):
        read_keypair_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2, 3]")
    with pytest.raises(KeypairError, match="64 integers"):
        read_keypair_file(bad)
    bad.write_text("not json")
    with pytest.raises(KeypairError, match="JSON"):
        read_keypair_file(bad)
    # 64 bytes whose public half does not match the secret
    keypair = list(bytes(Keypair()))
    keypair[40] ^= 1
    bad.write_text(json.dumps(keypair))
    with pytest.raises(KeypairError, match="valid ed25519"):
        read_keypair_file(bad)


def test_raw_wallet_private_key_wins(tmp_path: Path) -> None:
    from_file, from_env = Keypair(), Keypair()
    path = tmp_path / "id.json"
    write_keypair_file(from_file, path)
    assert load_wallet(path, env={}).pubkey() == from_file.pubkey()
    as_json = json.dumps(list(bytes(from_env)))
    assert load_wallet(path, env={"RAW_WALLET_PRIVATE_KEY": as_json}).pubkey() == from_env.pubkey()
    as_base58 = str(from_env)
    assert load_wallet(None, env={"RAW_WALLET_PRIVATE_KEY": as_base58}).pubkey() == (
        from_env.pubkey()
    )
    with pytest.raises(KeypairError, match="base58"):
        keypair_from_raw("0OIl not base58")
    with pytest.raises(KeypairError) as info:
        load_wallet(None, env={})
    assert str(info.value) == NO_WALLET_MESSAGE


def test_p2p_identity_derivation() -> None:
    # ChaCha20 with an all-zero key, zero nonce, block 0 (RFC 7539 §2.3.2 / rand_chacha's
    # `test_chacha_true_values_a`).
    assert chacha20_keystream(bytes(32), 32).hex() == (
        "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
    )
    wallet = Keypair.from_seed(bytes(range(32)))
    key = derive_p2p_secret_key("run", wallet)
    assert key == chacha20_keystream(
        __import__("hashlib").sha256(b"run" + bytes(range(32))).digest(), 32
    )
    assert derive_p2p_secret_key("other", wallet) != key


SIGNATURE = Signature.default()


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (RpcTransportError("u", "refused", kind="connect"), RetryKind.Retryable),
        (RpcTransportError("u", "timeout", kind="timeout"), RetryKind.Retryable),
        (RpcTransportError("u", "502", kind="status"), RetryKind.Retryable),
        (RpcResponseError(-32602, "Invalid params"), RetryKind.NonRetryable),
        (RpcResponseError(-32600, "Invalid request"), RetryKind.NonRetryable),
        (
            RpcResponseError(-32002, "Transaction simulation failed", {"err": "X", "logs": []}),
            RetryKind.NonRetryable,
        ),
        (RpcResponseError(-32002, "InvalidRunState happened"), RetryKind.Fatal),
        (RpcResponseError(-32002, "InvalidWitness happened"), RetryKind.Fatal),
        (RpcResponseError(-32005, "Failed to tick"), RetryKind.Retryable),
        (
            RpcResponseError(-32002, "This transaction has already been processed"),
            RetryKind.NonRetryable,
        ),
        (RpcResponseError(-32005, "Node is behind"), RetryKind.Retryable),
        (TransactionError(SIGNATURE, "BlockhashNotFound"), RetryKind.Retryable),
        (
            TransactionError(SIGNATURE, {"InstructionError": [0, {"Custom": 6000}]}),
            RetryKind.NonRetryable,
        ),
        (ConfirmationTimeout(SIGNATURE, 30), RetryKind.Retryable),
        (AccountNotFound(Keypair().pubkey()), RetryKind.NonRetryable),
        (KeypairError("no"), RetryKind.NonRetryable),
        (RuntimeError("something else"), RetryKind.Retryable),
    ],
)
def test_classify(error: Exception, kind: RetryKind) -> None:
    assert classify(error) is kind


def test_retry_policy_delays_match_upstream() -> None:
    assert list(RetryPolicy().delays()) == [0.5, 0.75, 1.125]
    assert list(RetryPolicy(4.0, 2.0, 4, 10.0).delays()) == [4.0, 8.0, 10.0, 10.0]


def test_retry_with_backoff() -> None:
    policy = RetryPolicy(0.01, 1.5, 3, 0.05)

    async def main() -> None:
        calls: list[int] = []

        async def flaky() -> str:
            calls.append(1)
            if len(calls) < 3:
                raise RpcTransportError("u", "refused", kind="connect")
            return "ok"

        assert await retry_with_backoff("flaky", flaky, policy) == "ok"
        assert len(calls) == 3

        calls.clear()

        async def always_down() -> str:
            calls.append(1)
            raise RpcTransportError("u", "refused", kind="connect")

        with pytest.raises(RetryFailed) as info:
            await retry_with_backoff("down", always_down, policy)
        assert info.value.kind is RetryKind.Retryable
        assert len(calls) == 4

        calls.clear()

        async def rejected() -> str:
            calls.append(1)
            raise RpcResponseError(-32602, "Invalid params")

        with pytest.raises(RetryFailed) as info:
            await retry_with_backoff("bad", rejected, policy)
        assert info.value.kind is RetryKind.NonRetryable
        assert len(calls) == 1

    trio.run(main)
