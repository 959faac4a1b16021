"""Hex keys typed by people (`RAW_IDENTITY_SECRET_KEY`, data-server allowlists, bootstrap peers'
endpoint ids) are parsed in one place: `0x` allowed, and a wrong length or a stray character is
named exactly, in one line."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from psyche.core.identity import SecretKey, parse_hex_key
from psyche.data_provider.server import parse_key

from .conftest import command

KEY_1 = f"{1:064x}"
KEY_1_PUBLIC = "4cb5abf6ad79fbf5abbccafcc269d85cd2651ed4b885b5869f241aedf0a5ba29"


@pytest.mark.parametrize("text", [KEY_1, "0x" + KEY_1, "0X" + KEY_1.upper(), f"  {KEY_1}\n"])
def test_accepted_forms(text: str) -> None:
    assert parse_hex_key(text) == (1).to_bytes(32, "big")
    assert SecretKey.from_hex(text).public_key.hex() == KEY_1_PUBLIC


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (KEY_1[1:], "the key must be 64 hex digits (32 bytes), got 63"),
        ("0x" + KEY_1[2:], "the key must be 64 hex digits (32 bytes), got 62"),
        (KEY_1 + "0", "the key must be 64 hex digits (32 bytes), got 65"),
        ("", "the key must be 64 hex digits (32 bytes), got 0"),
        ("0x", "the key must be 64 hex digits (32 bytes), got 0"),
        (KEY_1[:10] + "g" + KEY_1[11:], "'g' at position 11 is not a hex digit"),
        ("0x" + KEY_1[:-1] + "z", "'z' at position 66 is not a hex digit"),
        (KEY_1[:32] + " " + KEY_1[32:], "' ' at position 33 is not a hex digit"),
    ],
)
def test_wrong_keys_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        parse_hex_key(text)
    assert "\n" not in str(info.value)


def test_lengths_other_than_32_bytes() -> None:
    assert parse_hex_key("0xabcd", "a short id", 2) == b"\xab\xcd"
    with pytest.raises(ValueError, match=r"^a short id must be 4 hex digits \(2 bytes\), got 3$"):
        parse_hex_key("abc", "a short id", 2)


def test_every_hex_key_input_uses_the_same_parser() -> None:
    assert parse_key("0x" + KEY_1_PUBLIC) == bytes.fromhex(KEY_1_PUBLIC)
    with pytest.raises(ValueError, match=r"must be 64 hex digits \(32 bytes\), got 63"):
        parse_key(KEY_1_PUBLIC[1:])
    from psyche.cli.solana_client.train import parse_bootstrap_peer

    peer = parse_bootstrap_peer(f"0x{KEY_1_PUBLIC}@127.0.0.1:4001")
    assert peer.id == bytes.fromhex(KEY_1_PUBLIC)
    with pytest.raises(ValueError, match="'x' at position 3 is not a hex digit"):
        parse_bootstrap_peer(f"abx{KEY_1_PUBLIC[3:]}@127.0.0.1:4001")


def show_identity(key: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [command("psyche-client"), "show-identity"],
        env={**os.environ, "RAW_IDENTITY_SECRET_KEY": key},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("key", "line"),
    [
        (
            KEY_1[1:],
            "psyche-client: error: RAW_IDENTITY_SECRET_KEY must be 64 hex digits (32 bytes), "
            "got 63",
        ),
        (
            KEY_1[:-1] + "q",
            "psyche-client: error: RAW_IDENTITY_SECRET_KEY is not hexadecimal: 'q' at position "
            "64 is not a hex digit",
        ),
    ],
)
def test_client_refuses_a_bad_key_in_one_line(key: str, line: str) -> None:
    result = show_identity(key)
    assert result.returncode == 2
    assert result.stderr == line + "\n"


def test_client_accepts_a_0x_key() -> None:
    result = show_identity("0x" + KEY_1)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"Public key: {KEY_1_PUBLIC}"
