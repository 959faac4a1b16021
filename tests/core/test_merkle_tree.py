from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.core.merkle_tree import (
    HashWrapper,
    MerkleRoot,
    MerkleTree,
    OwnedProof,
    OwnedProofEntry,
    Proof,
    ProofEntry,
    hash_intermediate,
    hash_leaf,
    next_level_len,
)
from psyche.core.serde import from_bytes, to_bytes, to_obj
from psyche.core.sha256 import sha256v

TEST = [b"my", b"very", b"eager", b"mother", b"just", b"served", b"us", b"nine", b"pizzas",
        b"make", b"prime"]  # fmt: skip
BAD = [b"bad", b"missing", b"false"]


def test_tree_from_empty() -> None:
    assert MerkleTree([]).get_root() is None


def test_tree_from_one() -> None:
    root = MerkleTree([b"test"]).get_root()
    assert root == HashWrapper(sha256v([b"\x00", b"test"]))
    assert root.fmt_full() == "dbebd10e61bc8c28591273feafbbef95d544f874693301d8f7f8e54c6e30058e"


def test_path_creation() -> None:
    tree = MerkleTree(TEST)
    for i in range(len(TEST)):
        assert tree.find_path(i) is not None


def test_path_creation_bad_index() -> None:
    assert MerkleTree(TEST).find_path(len(TEST)) is None


def test_path_verify_good() -> None:
    tree = MerkleTree(TEST)
    for i, item in enumerate(TEST):
        assert tree.find_path(i).verify(hash_leaf(item))


def test_path_verify_bad() -> None:
    tree = MerkleTree(TEST)
    for i, item in enumerate(BAD):
        assert not tree.find_path(i).verify(hash_leaf(item))


def test_proof_entry_instantiation_lsib_set() -> None:
    sibling, me = hash_leaf(b"left"), hash_leaf(b"me")
    entry = ProofEntry(hash_intermediate(sibling, me), sibling, None)
    assert entry.left_sibling == sibling
    assert entry.right_sibling is None
    assert Proof((entry,)).verify(me)
    # the side matters: the same sibling on the other side proves nothing
    assert not Proof((ProofEntry(entry.target, None, sibling),)).verify(me)
    # in a tree, an odd leaf's first sibling is on its left
    first = MerkleTree(TEST).find_path(1).entries[0]
    assert first.left_sibling == hash_leaf(TEST[0])
    assert first.right_sibling is None


def test_proof_entry_instantiation_rsib_set() -> None:
    sibling, me = hash_leaf(b"right"), hash_leaf(b"me")
    entry = ProofEntry(hash_intermediate(me, sibling), None, sibling)
    assert entry.right_sibling == sibling
    assert entry.left_sibling is None
    assert Proof((entry,)).verify(me)
    assert not Proof((ProofEntry(entry.target, sibling, None),)).verify(me)
    # in a tree, an even leaf's first sibling is on its right
    first = MerkleTree(TEST).find_path(0).entries[0]
    assert first.right_sibling == hash_leaf(TEST[1])
    assert first.left_sibling is None


def test_proof_entry_instantiation_both_clear() -> None:
    with pytest.raises(ValueError, match="exactly one sibling"):
        ProofEntry(HashWrapper(), None, None)


def test_proof_entry_instantiation_both_set() -> None:
    with pytest.raises(ValueError, match="exactly one sibling"):
        ProofEntry(HashWrapper(), HashWrapper(), HashWrapper())


def test_node_layout_matches_level_lengths() -> None:
    # upstream checks its preallocation formula; here: every level is stored, leaves first
    def level_sum(n: int) -> int:
        total = 0
        while n > 0:
            total += n
            n = next_level_len(n)
        return total

    for leaf_count in range(0, 200):
        tree = MerkleTree([i.to_bytes(2, "little") for i in range(leaf_count)])
        assert len(tree.nodes) == level_sum(leaf_count)


def test_golden_roots() -> None:
    assert (
        MerkleTree(TEST).get_root().fmt_full()
        == "b40c847546fdceea166f927fc46c5ca33c3638236a36275c1346d3dffb84e1bc"
    )
    assert (
        MerkleTree([b"a", b"b"]).get_root().fmt_full()
        == "b137985ff484fb600db93107c77b0365c80d78f5b429ded0fd97361d077999eb"
    )
    assert (
        MerkleTree([b"a", b"b", b"c"]).get_root().fmt_full()
        == "e9636069c740c9ff51625b01a0b040396d265a9b920cc6febdfa5ecc9f58ecce"
    )


def test_odd_level_duplicates_last_node() -> None:
    a, b, c = (hash_leaf(x) for x in (b"a", b"b", b"c"))
    expected = hash_intermediate(hash_intermediate(a, b), hash_intermediate(c, c))
    assert MerkleTree([b"a", b"b", b"c"]).get_root() == expected


def test_level_sizes_and_path_length() -> None:
    sizes, n = [], len(TEST)
    while n:
        sizes.append(n)
        n = next_level_len(n)
    assert sizes == [11, 6, 3, 2, 1]
    proof = MerkleTree(TEST).find_path(0)
    assert len(proof.entries) == 4
    assert proof.get_root() == MerkleTree(TEST).get_root()


def _upstream_owned_verify(proof: OwnedProof, candidate: HashWrapper) -> bool:
    """Upstream's `OwnedProof::verify`, which swaps the siblings."""
    for entry in proof.entries:
        left = entry.right_sibling or candidate
        right = entry.left_sibling or candidate
        candidate = hash_intermediate(left, right)
        if candidate != entry.target:
            return False
    return True


def test_owned_proof_verifies_correctly() -> None:
    tree = MerkleTree(TEST)
    for i, item in enumerate(TEST):
        owned = OwnedProof.from_proof(tree.find_path(i))
        assert owned.verify_item(item)
        assert owned.get_root() == tree.get_root()
        assert not owned.verify_item(b"not in the tree")
    # upstream's swapped version rejects genuine proofs, which is why this port fixes it
    assert not _upstream_owned_verify(OwnedProof.from_proof(tree.find_path(0)), hash_leaf(TEST[0]))


def test_owned_proof_serde_and_tampering() -> None:
    tree = MerkleTree(TEST)
    owned = OwnedProof.from_proof(tree.find_path(5))
    decoded = from_bytes(to_bytes(owned), OwnedProof)
    assert decoded == owned
    assert decoded.verify_item(TEST[5])
    first = decoded.entries[0]
    sibling = first.left_sibling or first.right_sibling
    flipped = HashWrapper(bytes([sibling.inner[0] ^ 1]) + sibling.inner[1:])
    tampered_entry = (
        OwnedProofEntry(first.target, flipped, None)
        if first.left_sibling is not None
        else OwnedProofEntry(first.target, None, flipped)
    )
    tampered = OwnedProof([tampered_entry, *decoded.entries[1:]])
    assert not tampered.verify_item(TEST[5])


def test_hash_wrapper() -> None:
    root = MerkleRoot()
    assert root.inner == bytes(32)
    assert to_bytes(root) == bytes(32)
    assert to_obj(root) == {"inner": [0] * 32}
    h = MerkleTree([b"a"]).get_root()
    assert h.fmt_short() == h.inner[:5].hex()
    assert repr(h) == f"HashWrapper({h.inner.hex()})"
    assert bytes(h) == h.inner


@settings(max_examples=40, deadline=None)
@given(st.lists(st.binary(max_size=16), min_size=1, max_size=40), st.data())
def test_every_path_verifies(items: list[bytes], data: st.DataObject) -> None:
    tree = MerkleTree(items)
    i = data.draw(st.integers(0, len(items) - 1))
    proof = tree.find_path(i)
    assert proof.verify_item(items[i])
    assert OwnedProof.from_proof(proof).verify_item(items[i])
    if len(items) > 1:
        assert proof.get_root() == tree.get_root()
