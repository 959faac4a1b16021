"""Merkle tree over byte strings (Solana's layout): witnesses commit to a round's broadcasts.

Leaves are `sha256(0x00 ‖ item)` and inner nodes `sha256(0x01 ‖ left ‖ right)`, so a leaf can
never pass for an inner node; a level of odd length pairs its last node with itself. `nodes` holds
every level in turn, leaves first, the root last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from psyche.core.constants import INTERMEDIATE_PREFIX, LEAF_PREFIX
from psyche.core.serde import FixedBytes, struct
from psyche.core.sha256 import sha256v


@struct(frozen=True)
class HashWrapper:
    """A 32-byte hash (upstream's `MerkleRoot`); zeros by default."""

    inner: Annotated[bytes, FixedBytes(32)] = bytes(32)

    def fmt_short(self) -> str:
        return self.inner[:5].hex()

    def fmt_full(self) -> str:
        return self.inner.hex()

    def __bytes__(self) -> bytes:
        return self.inner

    def __repr__(self) -> str:
        return f"HashWrapper({self.fmt_full()})"


MerkleRoot = HashWrapper


def hash_leaf(item: bytes) -> HashWrapper:
    return HashWrapper(sha256v((LEAF_PREFIX, item)))


def hash_intermediate(left: HashWrapper, right: HashWrapper) -> HashWrapper:
    return HashWrapper(sha256v((INTERMEDIATE_PREFIX, left.inner, right.inner)))


def next_level_len(level_len: int) -> int:
    return 0 if level_len == 1 else (level_len + 1) // 2


@dataclass(frozen=True)
class ProofEntry:
    """One step up a path: the node reached and the sibling it was hashed with (on one side)."""

    target: HashWrapper
    left_sibling: HashWrapper | None
    right_sibling: HashWrapper | None

    def __post_init__(self) -> None:
        if (self.left_sibling is None) == (self.right_sibling is None):
            raise ValueError("a proof entry needs exactly one sibling, left or right")


@struct(frozen=True)
class OwnedProofEntry:
    """`ProofEntry` as it travels (no sibling check: the wire may carry anything)."""

    target: HashWrapper
    left_sibling: HashWrapper | None
    right_sibling: HashWrapper | None


def _verify(entries: Sequence[ProofEntry | OwnedProofEntry], candidate: HashWrapper) -> bool:
    for entry in entries:
        left = entry.left_sibling if entry.left_sibling is not None else candidate
        right = entry.right_sibling if entry.right_sibling is not None else candidate
        candidate = hash_intermediate(left, right)
        if candidate != entry.target:
            return False
    return True


class _Verifies:
    """Checking a candidate leaf hash against a proof's entries (`Proof` and `OwnedProof`)."""

    entries: Sequence[ProofEntry | OwnedProofEntry]

    def verify(self, candidate: HashWrapper) -> bool:
        return _verify(self.entries, candidate)

    def verify_item(self, item: bytes) -> bool:
        return self.verify(hash_leaf(item))

    def get_root(self) -> HashWrapper | None:
        return self.entries[-1].target if self.entries else None


@dataclass(frozen=True)
class Proof(_Verifies):
    """The path from a leaf to the root, as `MerkleTree.find_path` builds it."""

    entries: tuple[ProofEntry, ...] = ()


@struct(frozen=True)
class OwnedProof(_Verifies):
    """A serializable `Proof`.

    Upstream's `OwnedProof::verify` swaps the two siblings, so a converted proof of any
    non-trivial tree fails to verify there. That is a bug, not a protocol rule (nothing in the
    centralized path uses it), so here it verifies exactly like `Proof::verify`.
    """

    entries: list[OwnedProofEntry]

    @classmethod
    def from_proof(cls, proof: Proof) -> OwnedProof:
        return cls(
            [OwnedProofEntry(e.target, e.left_sibling, e.right_sibling) for e in proof.entries]
        )


class MerkleTree:
    __slots__ = ("leaf_count", "nodes")

    def __init__(self, items: Sequence[bytes]) -> None:
        self.leaf_count = len(items)
        nodes = [hash_leaf(bytes(item)) for item in items]
        prev_start, prev_len = 0, len(items)
        level_len = next_level_len(prev_len)
        while level_len > 0:
            for i in range(level_len):
                left_index = prev_start + 2 * i
                right_index = left_index + 1 if 2 * i + 1 < prev_len else left_index
                nodes.append(hash_intermediate(nodes[left_index], nodes[right_index]))
            prev_start, prev_len = prev_start + prev_len, level_len
            level_len = next_level_len(level_len)
        self.nodes = nodes

    def get_root(self) -> HashWrapper | None:
        """The root, or None for an empty tree (callers then use `MerkleRoot()`, zeros)."""
        return self.nodes[-1] if self.nodes else None

    def find_path(self, index: int) -> Proof | None:
        if not 0 <= index < self.leaf_count:
            return None
        entries = []
        level_start, level_len = 0, self.leaf_count
        left: HashWrapper | None = None
        right: HashWrapper | None = None
        while level_len > 0:
            level = self.nodes[level_start : level_start + level_len]
            if left is not None or right is not None:
                entries.append(ProofEntry(level[index], left, right))
            if index % 2 == 0:
                left = None
                right = level[index + 1] if index + 1 < len(level) else level[index]
            else:
                left, right = level[index - 1], None
            index //= 2
            level_start += level_len
            level_len = next_level_len(level_len)
        return Proof(tuple(entries))
