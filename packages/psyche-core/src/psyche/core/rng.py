"""rand_chacha 0.9's `ChaCha8Rng` and the rand 0.9 algorithms upstream shuffles with (the data
providers' sequence order, the evaluations' few-shot examples).

Every node must order a dataset identically, so these reproduce upstream bit for bit:

* `ChaCha8Rng`: ChaCha with 8 rounds, the 32-byte seed as key, a 64-bit block counter from 0 and
  stream 0; its output is the keystream read as little-endian u32 words.
* `random_below(rng, bound)`: rand's `random_range(0..bound)` for u32 (Canon's widening multiply
  with one optional extra draw; rand's default, "biased" build).
* `shuffle_permutation(n, rng)`: the order `slice.shuffle(rng)` leaves `n` items in (rand 0.9's
  forward Fisher-Yates fed by `IncreasingUniform`, which packs several small draws into one u32).
* `backward_fisher_yates_permutation(n, rng)`: the classic loop `for i in (1..n).rev()
  { swap(i, random_range(0..=i)) }` that the weighted provider uses.

Datasets have millions of sequences, so both permutations are computed without a Python loop per
item: the random indices are drawn in vectorized windows (a draw that needs its extra word shifts
the words of every later draw by one), and the resulting chain of swaps is resolved into a final
order by pointer jumping instead of by performing the swaps one at a time.
"""

from __future__ import annotations

import numpy as np

_U32_MASK = 0xFFFF_FFFF
# "expand 32-byte k"
_SIGMA = np.array([0x61707865, 0x3320646E, 0x79622D32, 0x6B206574], dtype=np.uint32)
# Refill the keystream buffer in chunks big enough to amortize the per-call numpy overhead.
_MIN_REFILL_BLOCKS = 4096


def _rotl(v: np.ndarray, n: int) -> np.ndarray:
    return (v << np.uint32(n)) | (v >> np.uint32(32 - n))


def chacha8_blocks(key: bytes, first_block: int, count: int) -> np.ndarray:
    """`count` consecutive 64-byte ChaCha8 keystream blocks as little-endian u32 words."""
    if len(key) != 32:
        raise ValueError(f"a ChaCha8 key is 32 bytes, got {len(key)}")
    counters = np.arange(first_block, first_block + count, dtype=np.uint64)
    state = np.empty((16, count), dtype=np.uint32)
    state[0:4] = _SIGMA[:, None]
    state[4:12] = np.frombuffer(key, dtype="<u4").astype(np.uint32)[:, None]
    state[12] = (counters & np.uint64(_U32_MASK)).astype(np.uint32)
    state[13] = (counters >> np.uint64(32)).astype(np.uint32)
    state[14] = 0
    state[15] = 0
    x = state.copy()

    def quarter(a: int, b: int, c: int, d: int) -> None:
        x[a] += x[b]
        x[d] = _rotl(x[d] ^ x[a], 16)
        x[c] += x[d]
        x[b] = _rotl(x[b] ^ x[c], 12)
        x[a] += x[b]
        x[d] = _rotl(x[d] ^ x[a], 8)
        x[c] += x[d]
        x[b] = _rotl(x[b] ^ x[c], 7)

    for _ in range(4):  # 8 rounds = 4 double rounds
        quarter(0, 4, 8, 12)
        quarter(1, 5, 9, 13)
        quarter(2, 6, 10, 14)
        quarter(3, 7, 11, 15)
        quarter(0, 5, 10, 15)
        quarter(1, 6, 11, 12)
        quarter(2, 7, 8, 13)
        quarter(3, 4, 9, 14)
    x += state
    return np.ascontiguousarray(x.T).reshape(-1)


class ChaCha8Rng:
    """`rand_chacha::ChaCha8Rng::from_seed(seed)` (u32 output only, which is all upstream uses)."""

    __slots__ = ("_buf", "_key", "_next_block", "_pos")

    def __init__(self, seed: bytes) -> None:
        if len(seed) != 32:
            raise ValueError(f"a ChaCha8Rng seed is 32 bytes, got {len(seed)}")
        self._key = bytes(seed)
        self._buf = np.empty(0, dtype=np.uint32)
        self._pos = 0
        self._next_block = 0

    def _ensure(self, count: int) -> None:
        available = len(self._buf) - self._pos
        if available >= count:
            return
        blocks = max(_MIN_REFILL_BLOCKS, -(-(count - available) // 16))
        fresh = chacha8_blocks(self._key, self._next_block, blocks)
        self._next_block += blocks
        self._buf = np.concatenate([self._buf[self._pos :], fresh])
        self._pos = 0

    def next_u32(self) -> int:
        self._ensure(1)
        value = int(self._buf[self._pos])
        self._pos += 1
        return value

    def peek_words(self, count: int) -> np.ndarray:
        """The next `count` words, without consuming them."""
        self._ensure(count)
        return self._buf[self._pos : self._pos + count]

    def advance(self, count: int) -> None:
        self._ensure(count)
        self._pos += count

    def words(self, count: int) -> np.ndarray:
        out = self.peek_words(count).copy()
        self._pos += count
        return out


def random_range_inclusive(rng: ChaCha8Rng, low: int, high: int) -> int:
    """rand 0.9 `rng.random_range(low..=high)` for u32 (and for usize ranges that fit in u32)."""
    if not 0 <= low <= high <= _U32_MASK:
        raise ValueError(f"invalid u32 range {low}..={high}")
    span = (high - low + 1) & _U32_MASK
    if span == 0:
        return rng.next_u32()
    m = rng.next_u32() * span
    result, lo = m >> 32, m & _U32_MASK
    if lo > (-span & _U32_MASK):
        new_hi = (rng.next_u32() * span) >> 32
        if lo + new_hi > _U32_MASK:
            result += 1
    return low + result


def random_below(rng: ChaCha8Rng, bound: int) -> int:
    """rand 0.9 `rng.random_range(0..bound)` for u32."""
    if bound < 1:
        raise ValueError("empty range")
    return random_range_inclusive(rng, 0, bound - 1)


def random_below_many(rng: ChaCha8Rng, bounds: np.ndarray) -> np.ndarray:
    """`[random_below(rng, b) for b in bounds]`, drawn in vectorized windows (bounds < 2**32).

    Each draw takes one word, plus a second one when the first lands in the biased zone. Within a
    window every draw is computed as if it took one word; the first draw that needs a second word
    is finished by hand and the window restarts after it.
    """
    bounds = np.asarray(bounds, dtype=np.uint64)
    n = len(bounds)
    if n and (bounds.min() < 1 or bounds.max() > _U32_MASK):
        raise ValueError("bounds must lie in [1, 2**32 - 1]")
    out = np.empty(n, dtype=np.uint64)
    k = 0
    while k < n:
        # A draw needs a second word with probability about bound / 2**32: size the window to
        # about twice the expected distance to the next such draw.
        expected_gap = (1 << 32) // int(bounds[k])
        window = min(n - k, max(256, min(1 << 20, 2 * expected_gap)))
        words = rng.peek_words(window + 1).astype(np.uint64)
        b = bounds[k : k + window]
        m = words[:window] * b
        lo = m & np.uint64(_U32_MASK)
        biased = lo > (np.uint64(1 << 32) - b)
        hits = np.flatnonzero(biased)
        if len(hits) == 0:
            out[k : k + window] = m >> np.uint64(32)
            rng.advance(window)
            k += window
            continue
        e = int(hits[0])
        out[k : k + e] = m[:e] >> np.uint64(32)
        new_hi = (int(words[e + 1]) * int(b[e])) >> 32
        out[k + e] = (int(m[e]) >> 32) + (1 if int(lo[e]) + new_hi > _U32_MASK else 0)
        rng.advance(e + 2)
        k += e + 1
    return out


def calculate_bound_u32(m: int) -> tuple[int, int]:
    """rand's `calculate_bound_u32`: the longest product m·(m+1)·… that fits in u32, and its length."""
    product, current = m, m + 1
    while product * current <= _U32_MASK:
        product *= current
        current += 1
    return product, current - m


# From here on every chunk of IncreasingUniform holds a single index: (m)(m+1) overflows u32.
_SINGLE_INDEX_FROM = 65536


def increasing_uniform_indices(n: int, rng: ChaCha8Rng) -> np.ndarray:
    """The `index` rand 0.9's `shuffle` swaps position i with, for i in 0..n (index <= i)."""
    if n >= _U32_MASK:
        raise ValueError("slices of u32::MAX items or more use another algorithm upstream")
    out = np.empty(n, dtype=np.int64)
    count_so_far = 0
    chunk = 0
    chunk_remaining = 1  # IncreasingUniform::new(rng, 0): the first index is 0, drawn for free
    i = 0
    while i < n:
        next_n = count_so_far + 1
        if chunk_remaining == 0:
            if next_n >= _SINGLE_INDEX_FROM:
                break
            bound, chunk_len = calculate_bound_u32(next_n)
            chunk = random_below(rng, bound)
            next_remaining = chunk_len - 1
        else:
            next_remaining = chunk_remaining - 1
        if next_remaining == 0:
            index = chunk
        else:
            index = chunk % next_n
            chunk //= next_n
        chunk_remaining = next_remaining
        count_so_far = next_n
        out[i] = index
        i += 1
    if i < n:
        # One draw of random_range(0..i+1) per position.
        out[i:] = random_below_many(rng, np.arange(i + 1, n + 1, dtype=np.uint64)).astype(np.int64)
    return out


def _resolve_pointers(ptr: np.ndarray) -> np.ndarray:
    """Follow `ptr` from every node to its root (a node pointing at itself), by pointer jumping."""
    ptr = ptr.copy()
    active = np.flatnonzero(ptr != np.arange(len(ptr)))
    while active.size:
        nxt = ptr[ptr[active]]
        ptr[active] = nxt
        active = active[ptr[nxt] != nxt]
    return ptr


def _group_order(targets: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Indices into `steps` sorted by (target, step); `steps` is strictly increasing."""
    span = int(steps[-1]) + 1
    if span * span < (1 << 62):
        # Unique keys: an unstable sort gives the same answer as a stable one, faster.
        return np.argsort(targets * span + steps)
    return np.argsort(targets, kind="stable")


def apply_forward_swaps(index: np.ndarray) -> np.ndarray:
    """The order `for i in 0..n: swap(i, index[i])` (index[i] <= i) leaves `0..n` in.

    Before step i position i still holds i, so step i writes `i` into position index[i] and the
    old content of index[i] into position i. The final content of q is therefore the last step
    i > q with index[i] == q, if any; otherwise it is what step q copied in, which is either the
    latest step in (index[q], q) that wrote index[q], or (recursively) what step index[q] copied.
    That recursion is resolved for all q at once by pointer jumping.
    """
    index = np.asarray(index, dtype=np.int64)
    n = len(index)
    positions = np.arange(n, dtype=np.int64)
    if n == 0:
        return positions
    order = _group_order(index, positions)  # grouped by target, steps ascending within a group
    sorted_targets = index[order]
    same_as_prev = sorted_targets[1:] == sorted_targets[:-1]
    prev_in_group = np.full(n, -1, dtype=np.int64)
    prev_in_group[order[1:][same_as_prev]] = order[:-1][same_as_prev]
    is_last = np.ones(n, dtype=bool)
    is_last[:-1] = ~same_as_prev
    last_writer = np.full(n, -1, dtype=np.int64)
    last_writer[sorted_targets[is_last]] = order[is_last]

    stays = index == positions
    has_prev = prev_in_group > index
    terminal = stays | has_prev
    value = np.where(stays, positions, prev_in_group)
    root = _resolve_pointers(np.where(terminal, positions, index))
    copied_in = value[root]
    return np.where(last_writer > positions, last_writer, copied_in)


def apply_backward_swaps(index: np.ndarray) -> np.ndarray:
    """The order `for i in (1..n).rev(): swap(i, index[i])` (index[i] <= i) leaves `0..n` in.

    After step i position i never changes again and receives what position index[i] held then.
    A position q < i was last written by the most recent earlier step (smallest i' > i) with
    index[i'] == q, which moved in what position i' held just before its own step; with no such
    step q still holds q. Again resolved by pointer jumping.
    """
    index = np.asarray(index, dtype=np.int64)
    n = len(index)
    positions = np.arange(n, dtype=np.int64)
    if n <= 1:
        return positions
    steps = positions[1:]
    order = steps[_group_order(index[1:], steps)]
    sorted_targets = index[order]
    same_as_next = sorted_targets[:-1] == sorted_targets[1:]
    next_in_group = np.full(n, -1, dtype=np.int64)
    next_in_group[order[:-1][same_as_next]] = order[1:][same_as_next]
    is_first = np.ones(len(order), dtype=bool)
    is_first[1:] = ~same_as_next
    first_writer = np.full(n, -1, dtype=np.int64)
    first_writer[sorted_targets[is_first]] = order[is_first]
    # The first step after q's own step that writes q (its own step writes q only if index[q]==q).
    first_after = np.where(first_writer == positions, next_in_group, first_writer)
    held = _resolve_pointers(np.where(first_after > positions, first_after, positions))
    result = np.empty(n, dtype=np.int64)
    result[0] = held[0]
    succ = next_in_group[1:]
    result[1:] = np.where(succ >= 0, held[np.maximum(succ, 0)], index[1:])
    return result


def shuffle_permutation(n: int, rng: ChaCha8Rng) -> np.ndarray:
    """Item order after rand 0.9 `slice.shuffle(rng)` on `n` items: `shuffled[k] = items[perm[k]]`."""
    if n <= 1:
        return np.arange(n, dtype=np.int64)
    return apply_forward_swaps(increasing_uniform_indices(n, rng))


def backward_fisher_yates_permutation(n: int, rng: ChaCha8Rng) -> np.ndarray:
    """Item order after `for i in (1..n).rev() { swap(i, rng.random_range(0..=i)) }`."""
    if n <= 1:
        return np.arange(n, dtype=np.int64)
    if n - 1 > _U32_MASK:
        raise ValueError("ranges beyond u32 take another path upstream")
    index = np.zeros(n, dtype=np.int64)
    # Steps run i = n-1 down to 1, each drawing from 0..=i.
    draws = random_below_many(rng, np.arange(n, 1, -1, dtype=np.uint64)).astype(np.int64)
    index[1:] = draws[::-1]
    return apply_backward_swaps(index)
