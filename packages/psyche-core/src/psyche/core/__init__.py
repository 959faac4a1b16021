"""Deterministic primitives shared by every Psyche component.

What every honest client must compute identically lives here (the main names exported below):
identities and signatures, batch intervals, the LCG, ChaCha and swap-or-not shuffles, bloom
filters, merkle trees, similarity distances, LR schedules, fixed-capacity strings and vectors,
small containers (a bounded queue, running averages, a cancellable barrier),
and (`psyche.core.serde`) the one type declaration read and written as postcard, TOML or JSON.

Beside them, in their own modules and not exported here, are the few process helpers every
package needs: `atomic_file`, `safe_path`, `drop_log` (a log peers cannot flood), `lazy`
(PEP 562 exports) and `cli` (signals, exit codes and one-line errors for every command, and
the option declarations the libraries own their commands' options with). Authenticated TCP is
`psyche.transport`, experiment trackers `psyche.metrics`.

Importing this package loads neither torch nor numpy.
"""

from psyche.core.batch_id import BatchId
from psyche.core.bloom import Bloom, WitnessBloom, fnv1a_64
from psyche.core.bounded_queue import BoundedQueue
from psyche.core.cancellable_barrier import (
    Barrier,
    BarrierState,
    CancellableBarrier,
    CancelledBarrier,
    TrioCancellableBarrier,
)
from psyche.core.constants import (
    INTERMEDIATE_PREFIX,
    LCG_A,
    LCG_C,
    LEAF_PREFIX,
    SHUFFLE_ROUND_COUNT,
    SOLANA_MAX_PROOFS_LEN,
)
from psyche.core.data_shuffle import Shuffle
from psyche.core.definitions import (
    ConstantLR,
    CosineLR,
    LearningRateSchedule,
    LinearLR,
    OptimizerDefinition,
    WarmupStableDecayLR,
)
from psyche.core.deterministic_shuffle import deterministic_shuffle
from psyche.core.fixed import (
    FixedStringError,
    FixedVecError,
    fixed_str_debug,
    fixed_str_display,
    fixed_str_from_str_truncated,
    fixed_str_try_from,
    fixed_vec_extend,
    fixed_vec_insert,
    fixed_vec_push,
    fixed_vec_remove,
    fixed_vec_try_from,
)
from psyche.core.identity import SecretKey, verify_signature
from psyche.core.interval_tree import ClosedInterval, IntervalTree
from psyche.core.lcg import LCG
from psyche.core.log_markers import IntegrationTestLogMarker
from psyche.core.merkle_tree import (
    HashWrapper,
    MerkleRoot,
    MerkleTree,
    OwnedProof,
    OwnedProofEntry,
    Proof,
    ProofEntry,
)
from psyche.core.node_identity import NodeIdentity
from psyche.core.running_average import RunningAverage
from psyche.core.sha256 import sha256, sha256v
from psyche.core.similarity import (
    DistanceThresholds,
    hamming_distance,
    is_similar,
    jaccard_distance,
    manhattan_distance,
)
from psyche.core.swap_or_not import compute_shuffled_index, compute_shuffled_indices
from psyche.core.token_size import TokenSize

__all__ = [
    "INTERMEDIATE_PREFIX",
    "LCG",
    "LCG_A",
    "LCG_C",
    "LEAF_PREFIX",
    "SHUFFLE_ROUND_COUNT",
    "SOLANA_MAX_PROOFS_LEN",
    "Barrier",
    "BarrierState",
    "BatchId",
    "Bloom",
    "BoundedQueue",
    "CancellableBarrier",
    "CancelledBarrier",
    "ClosedInterval",
    "ConstantLR",
    "CosineLR",
    "DistanceThresholds",
    "FixedStringError",
    "FixedVecError",
    "HashWrapper",
    "IntegrationTestLogMarker",
    "IntervalTree",
    "LearningRateSchedule",
    "LinearLR",
    "MerkleRoot",
    "MerkleTree",
    "NodeIdentity",
    "OptimizerDefinition",
    "OwnedProof",
    "OwnedProofEntry",
    "Proof",
    "ProofEntry",
    "RunningAverage",
    "SecretKey",
    "Shuffle",
    "TokenSize",
    "TrioCancellableBarrier",
    "WarmupStableDecayLR",
    "WitnessBloom",
    "compute_shuffled_index",
    "compute_shuffled_indices",
    "deterministic_shuffle",
    "fixed_str_debug",
    "fixed_str_display",
    "fixed_str_from_str_truncated",
    "fixed_str_try_from",
    "fixed_vec_extend",
    "fixed_vec_insert",
    "fixed_vec_push",
    "fixed_vec_remove",
    "fixed_vec_try_from",
    "fnv1a_64",
    "hamming_distance",
    "is_similar",
    "jaccard_distance",
    "manhattan_distance",
    "sha256",
    "sha256v",
    "verify_signature",
]
