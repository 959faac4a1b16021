from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.core.sha256 import sha256, sha256v


def test_sha256() -> None:
    assert (
        sha256(b"Hello, world!").hex()
        == "315f5bdb76d078c43b8ac0064e4a0164612b1fce77c869345bfc94c75894edd3"
    )


def test_sha256_empty() -> None:
    assert sha256(b"").hex() == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=5))
def test_sha256v_is_hash_of_concatenation(parts: list[bytes]) -> None:
    assert sha256v(parts) == sha256(b"".join(parts))
