"""Constants of upstream's `psyche-core` that decide results (hashes, shuffles, filters)."""

from __future__ import annotations

from typing import Final

# Linear congruential generator (Knuth's MMIX multiplier and increment), `u64` wrapping.
LCG_A: Final = 6364136223846793005
LCG_C: Final = 1442695040888963407

# Rounds of the swap-or-not shuffle used for committee selection.
SHUFFLE_ROUND_COUNT: Final = 90

# Merkle nodes are domain separated so a leaf can never pass for an inner node.
LEAF_PREFIX: Final = b"\x00"
INTERMEDIATE_PREFIX: Final = b"\x01"
# Most entries an `OwnedProof` may hold on chain (space reservation only).
SOLANA_MAX_PROOFS_LEN: Final = 100

# 64-bit FNV prime of the `fnv` crate; the bloom filter seeds FNV-1a with its own keys.
FNV_PRIME: Final = 0x100000001B3
# A bloom filter with at most this many bits prints them one by one in its debug form.
BLOOM_MAX_PRINT_BITS: Final = 10
# bitvec's name for the bit order of a bloom's words; part of the bloom's wire form.
BITVEC_LSB0: Final = "bitvec::order::Lsb0"
