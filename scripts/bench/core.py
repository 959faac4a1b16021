"""Benchmark psyche.core's hot paths against the server's 500 ms tick.

Each row is the median of several timed runs (time.perf_counter), shown as milliseconds, as a
share of one tick, and against a baseline measured in the same run:

* swap-or-not for 256 clients: the batch API against the per-index function;
* bloom add + contains of 256 items: all keys at once against per-key reference FNV-1a;
* postcard encode/decode of a coordinator-sized value: against pickle of the same value;
* Ed25519 verification of 256 signatures (`verify_signature`, dalek's `verify_strict` rules:
  a set lookup of the key and R, then OpenSSL) against OpenSSL's check alone, also shown as
  verifies per second.

Run: .venv/bin/python scripts/bench/core.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Annotated, Any

from psyche.core import (
    MerkleRoot,
    NodeIdentity,
    WitnessBloom,
    compute_shuffled_index,
    compute_shuffled_indices,
    fnv1a_64,
    sha256,
)
from psyche.core.ed25519_strict import verify_rfc8032
from psyche.core.identity import SecretKey, verify_signature
from psyche.core.serde import (
    U8,
    U16,
    U32,
    U64,
    Array,
    FixedStr,
    FixedVec,
    SmallBool,
    from_bytes,
    struct,
    to_bytes,
)

TICK_SECONDS = 0.5
CLIENTS = 256
WITNESSES = 32

# ---- a stand-in for the coordinator's shape (the real one lives in psyche.coordinator) ---------


@struct(frozen=True)
class BenchClient:
    id: NodeIdentity
    state: U8
    exited_height: U32


@struct(frozen=True)
class BenchWitnessProof:
    position: U64
    index: U64
    witness: SmallBool


@struct(frozen=True)
class BenchWitness:
    proof: BenchWitnessProof
    participant_bloom: WitnessBloom
    broadcast_bloom: WitnessBloom
    broadcast_merkle: MerkleRoot


@struct(frozen=True)
class BenchRound:
    witnesses: Annotated[list[BenchWitness], FixedVec(32)]
    data_index: U64
    random_seed: U64
    height: U32
    clients_len: U16
    tie_breaker_tasks: U16


@struct(frozen=True)
class BenchConfig:
    warmup_time: U64
    cooldown_time: U64
    max_round_train_time: U64
    round_witness_time: U64
    global_batch_size_warmup_tokens: U64
    epoch_time: U64
    total_steps: U32
    min_clients: U16
    init_min_clients: U16
    global_batch_size_start: U16
    global_batch_size_end: U16
    verification_percent: U8
    witness_nodes: U16
    waiting_for_members_extra_time: U8


@struct(frozen=True)
class BenchCoordinator:
    run_id: Annotated[str, FixedStr(64)]
    run_state: U8
    config: BenchConfig
    rounds: Annotated[list[BenchRound], Array(4)]
    rounds_head: U32
    clients: Annotated[list[BenchClient], FixedVec(256)]
    exited_clients: Annotated[list[BenchClient], FixedVec(256)]
    step: U32
    start_timestamp: U64


def full_bloom(items: list[bytes]) -> Any:
    bloom = WitnessBloom.random(len(items), 0.01)
    for item in items:
        bloom.add(item)
    return bloom


def build_coordinator() -> BenchCoordinator:
    ids = [NodeIdentity.from_single_key(os.urandom(32)) for _ in range(CLIENTS)]
    clients = [BenchClient(i, 1, 1000 + n) for n, i in enumerate(ids)]
    exited = [
        BenchClient(NodeIdentity.from_single_key(os.urandom(32)), 3, 7) for _ in range(CLIENTS)
    ]
    participants = [sha256(i.signer) for i in ids]
    batches = [os.urandom(32) for _ in range(CLIENTS)]
    rounds = [
        BenchRound(
            witnesses=[
                BenchWitness(
                    BenchWitnessProof(w, w * 7, True),
                    full_bloom(participants),
                    full_bloom(batches),
                    MerkleRoot(os.urandom(32)),
                )
                for w in range(WITNESSES)
            ],
            data_index=r * 4096,
            random_seed=int.from_bytes(os.urandom(8), "little"),
            height=r,
            clients_len=CLIENTS,
            tie_breaker_tasks=0,
        )
        for r in range(4)
    ]
    config = BenchConfig(30, 5, 30, 2, 0, 60, 25000, 2, 2, 4, 4, 0, 1, 3)
    return BenchCoordinator(
        "consilience-llama2-20m-fineweb", 2, config, rounds, 3, clients, exited, 1234, 1_700_000_000
    )


# ---- timing ----------------------------------------------------------------------------------


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm caches (compiled codecs, hashlib)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    repeats = args.repeats

    seed = os.urandom(32)
    items = [os.urandom(32) for _ in range(CLIENTS)]
    keys = WitnessBloom.random(CLIENTS, 0.01).keys

    def shuffle_per_index() -> list[int]:
        return [compute_shuffled_index(i, CLIENTS, seed) for i in range(CLIENTS)]

    def shuffle_batch() -> list[int]:
        return compute_shuffled_indices(CLIENTS, seed)

    assert shuffle_per_index() == shuffle_batch()

    def bloom_fast() -> None:
        bloom = WitnessBloom(keys)
        for item in items:
            bloom.add(item)
        for item in items:
            assert bloom.contains(item)

    def bloom_reference() -> None:
        words = [0] * 16
        for item in items:
            for key in keys:
                p = fnv1a_64(item, key) % 1024
                words[p // 64] |= 1 << (p % 64)
        for item in items:
            for key in keys:
                p = fnv1a_64(item, key) % 1024
                assert words[p // 64] >> (p % 64) & 1

    coordinator = build_coordinator()
    encoded = to_bytes(coordinator)
    pickled = pickle.dumps(coordinator, protocol=pickle.HIGHEST_PROTOCOL)
    assert from_bytes(encoded, BenchCoordinator) == coordinator

    signers = [SecretKey.generate() for _ in range(CLIENTS)]
    signed = [(k.public_key, item, k.sign(item)) for k, item in zip(signers, items, strict=True)]

    def verify_strict_all() -> None:
        for key, message, signature in signed:
            assert verify_signature(key, message, signature)

    def verify_openssl_all() -> None:
        for key, message, signature in signed:
            assert verify_rfc8032(key, message, signature)

    rows = [
        ("swap-or-not, 256 indices", shuffle_batch, "per-index fn", shuffle_per_index),
        ("bloom add+contains, 256 items", bloom_fast, "per-key FNV", bloom_reference),
        (
            f"postcard encode ({len(encoded)} B)",
            lambda: to_bytes(coordinator),
            "pickle.dumps",
            lambda: pickle.dumps(coordinator, protocol=pickle.HIGHEST_PROTOCOL),
        ),
        (
            "postcard decode",
            lambda: from_bytes(encoded, BenchCoordinator),
            "pickle.loads",
            lambda: pickle.loads(pickled),
        ),
        (f"ed25519 verify strict, {CLIENTS} sigs", verify_strict_all, "OpenSSL alone",
         verify_openssl_all),
    ]  # fmt: skip

    print(f"psyche.core hot paths, median of {repeats} runs; tick = {TICK_SECONDS * 1000:.0f} ms")
    header = f"{'operation':<34}{'ms':>9}{'% tick':>9}  {'baseline':<14}{'ms':>9}{'x faster':>10}"
    print(header)
    print("-" * len(header))
    for name, fn, base_name, base_fn in rows:
        ours = median_seconds(fn, repeats)
        base = median_seconds(base_fn, repeats)
        print(
            f"{name:<34}{ours * 1e3:>9.3f}{ours / TICK_SECONDS * 100:>8.2f}%  "
            f"{base_name:<14}{base * 1e3:>9.3f}{base / ours:>10.2f}"
        )
        if fn is verify_strict_all:
            print(
                f"{'  verifies per second':<34}{len(signed) / ours:>9.0f}{'':>9}  "
                f"{base_name:<14}{len(signed) / base:>9.0f}"
            )


if __name__ == "__main__":
    main()
