"""Chunked 2-D DCT used by DisTrO to move momentum into a sparse frequency domain.

Every peer must build bit-identical basis matrices and contract them in the same order, because
the decoded update of every peer's payload goes through them. So the bases are built the way
upstream builds them (an FFT route in float32, then a cast), not from the analytic cosine formula,
and every contraction goes through `torch._VF.einsum` without a contraction path, which contracts
left to right like libtorch's `at::einsum` (Python's `torch.einsum` may reorder three-operand
contractions through opt_einsum, which changes bf16 bits).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

# --------------------------------------------------------------------------------------------
# Chunk sizes


def get_prime_divisors(n: int) -> list[int]:
    """Prime factors of `n` in ascending order, with multiplicity (empty for 0 and 1)."""
    if n == 0:
        return []
    divisors: list[int] = []
    while n % 2 == 0:
        divisors.append(2)
        n //= 2
    while n % 3 == 0:
        divisors.append(3)
        n //= 3
    i = 5
    while i * i <= n:
        for k in (i, i + 2):
            while n % k == 0:
                divisors.append(k)
                n //= k
        i += 6
    if n > 1:
        divisors.append(n)
    return divisors


def get_divisors(n: int) -> list[int]:
    """All divisors of `n`, ascending (empty for n < 1)."""
    if n < 1:
        return []
    if n == 1:
        return [1]
    divisors = [1]
    last_prime = 0
    factor = 0
    slice_len = 0
    for prime in get_prime_divisors(n):
        if last_prime != prime:
            slice_len = len(divisors)
            factor = prime
        else:
            factor *= prime
        for i in range(slice_len):
            divisors.append(divisors[i] * factor)
        last_prime = prime
    divisors.sort()
    return divisors


def get_smaller_split(n: int, close_to: int) -> int:
    """The largest divisor of `n` that is at most `close_to` (`n` itself when n <= close_to)."""
    divisors = get_divisors(n)
    for ix, val in enumerate(divisors):
        if val == close_to:
            return val
        if val > close_to:
            return val if ix == 0 else divisors[ix - 1]
    return n


# --------------------------------------------------------------------------------------------
# DCT-II / DCT-III through the FFT (Makhoul), float32


def dct(x: torch.Tensor, ortho: bool = True) -> torch.Tensor:
    """Orthonormal DCT-II along the last dimension, computed exactly as upstream does."""
    x_shape = x.shape
    n = x_shape[-1]
    x = x.contiguous().view(-1, n)
    v = torch.cat([x[:, 0::2], x[:, 1::2].flip([1])], 1)
    vc = torch.view_as_real(torch.fft.fft(v, dim=1, norm="backward"))
    k = -(
        torch.arange(n, dtype=torch.float32, device=x.device).unsqueeze(0) * (math.pi / (2.0 * n))
    )
    w_r = k.cos()
    w_i = k.sin()
    out = vc[:, :, 0] * w_r - vc[:, :, 1] * w_i
    if ortho:
        out[:, 0].div_(math.sqrt(n) * 2.0)
        out[:, 1:].div_(math.sqrt(n / 2.0) * 2.0)
    return out.mul_(2.0).view(x_shape)


def idct(x: torch.Tensor, ortho: bool = True) -> torch.Tensor:
    """Inverse of `dct` (orthonormal DCT-III along the last dimension), as upstream computes it."""
    x_shape = x.shape
    n = x_shape[-1]
    x_v = x.contiguous().view(-1, n) / 2.0
    if ortho:
        x_v[:, 0:1].mul_(math.sqrt(n) * 2.0)
        x_v[:, 1:n].mul_(math.sqrt(n / 2.0) * 2.0)
    k = (torch.arange(n, dtype=torch.float32, device=x.device) * (math.pi / (2.0 * n))).unsqueeze(0)
    w_r = k.cos()
    w_i = k.sin()
    v_t_r = x_v
    v_t_i = torch.cat([x_v[:, 0:1] * 0.0, -(x_v.flip([1])[:, 0 : n - 1])], 1)
    v_r = v_t_r * w_r - v_t_i * w_i
    v_i = v_t_r * w_i + v_t_i * w_r
    v = torch.cat([v_r.unsqueeze(2), v_i.unsqueeze(2)], 2)
    v = torch.fft.irfft(torch.view_as_complex(v), n=v.shape[1], dim=1, norm="backward")
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    out[:, 0::2].add_(v[:, 0 : n - n // 2])
    out[:, 1::2].add_(v.flip([1])[:, 0 : n // 2])
    return out.view(x_shape)


def _einsum(equation: str, operands: list[torch.Tensor]) -> torch.Tensor:
    # No path argument: libtorch contracts left to right, as upstream's tch call does.
    # torch._VF (the bindings behind torch.einsum) has no type stubs: the binding by name.
    einsum: Callable[[str, list[torch.Tensor]], torch.Tensor] = getattr(torch._VF, "einsum")  # noqa: B009
    return einsum(equation, operands)


def decode_reads_transposed(xshape: Sequence[int]) -> bool:
    """Whether `TransformDCT.decode` of coefficients shaped `xshape` is cheaper, and exactly the
    same computation, when each block is stored column-major (last two dims swapped in memory).

    The decode einsum first contracts a block's rows (`k`), so libtorch permutes the input to
    `[..., j, l, k]` and copies it to contiguous memory before its first `bmm`. Coefficients
    already stored in that order make the copy a view, and the `bmm` receives the same values
    with the same shape and strides: the same call, so the same bits on any backend. That holds
    whenever there is more than one block; for a single block (every leading dim 1) libtorch
    swaps the `bmm` operands and would then see different strides, and for a block dim of 1 the
    two layouts coincide, so both keep the plain layout. `test_distro_fast_paths` records the
    `bmm` calls for every combination of unit and non-unit dims.
    """
    return len(xshape) > 2 and xshape[-2] > 1 and xshape[-1] > 1 and math.prod(xshape[:-2]) > 1


# --------------------------------------------------------------------------------------------
# The transform


class TransformDCT:
    """Per-dimension chunk sizes and cached DCT bases for a set of parameter shapes.

    `shapes` gives, in the optimizer's variable order, each parameter's full shape, dtype and
    device: a basis is built once per chunk size, on the device and in the dtype of the first
    parameter that needs it (as upstream does). Copies for other devices or dtypes are cached.
    """

    def __init__(
        self,
        shapes: Iterable[tuple[Sequence[int], torch.dtype, torch.device]],
        target_chunk: int,
    ) -> None:
        self.target_chunk = target_chunk
        self.shape_dict: dict[int, int] = {}
        self._f: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        self._b: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        self._home: dict[int, tuple[torch.dtype, torch.device]] = {}
        with torch.no_grad():
            for shape, dtype, device in shapes:
                for s in shape:
                    sc = self.shape_dict.get(s)
                    if sc is None:
                        sc = get_smaller_split(s, target_chunk)
                        self.shape_dict[s] = sc
                    if sc in self._home:
                        continue
                    eye = torch.eye(sc, dtype=torch.float32, device=device)
                    self._home[sc] = (dtype, torch.device(device))
                    key = (sc, dtype, torch.device(device))
                    self._f[key] = dct(eye, True).to(dtype).to(device)
                    self._b[key] = idct(eye, True).to(dtype).to(device)

    def chunk_size(self, dim: int) -> int:
        return self.shape_dict[dim]

    def _basis(
        self,
        table: dict[tuple[int, torch.dtype, torch.device], torch.Tensor],
        sc: int,
        like: torch.Tensor,
    ) -> torch.Tensor:
        key = (sc, like.dtype, like.device)
        basis = table.get(key)
        if basis is None:
            home = self._home.get(sc)
            if home is None:
                raise KeyError(f"no DCT basis of size {sc}: that size was not in the model")
            # Upstream builds each basis once in the first user's dtype and moves it to the
            # tensor's device; a different dtype (mixed-precision models) is cast from it.
            basis = table[(sc, *home)].to(like.device).to(like.dtype)
            table[key] = basis
        return basis

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., R, C]` -> `[..., R/n1, C/n2, n1, n2]`; a 1-D `[N]` -> `[N/n1, n1]`."""
        shape = list(x.shape)
        if len(shape) > 1:
            n1 = self.shape_dict[shape[-2]]
            n2 = self.shape_dict[shape[-1]]
            f1 = self._basis(self._f, n1, x)
            f2 = self._basis(self._f, n2, x)
            x = x.view(*shape[:-2], shape[-2] // n1, n1, shape[-1] // n2, n2)
            return _einsum("...ijkl, jb, ld -> ...ikbd", [x, f1, f2])
        n1 = self.shape_dict[shape[0]]
        f1 = self._basis(self._f, n1, x)
        return _einsum("...ij, jb -> ...ib", [x.view(-1, n1), f1])

    def encode_separable(
        self, x: torch.Tensor, contiguous: bool = True, scratch: Scratch | None = None
    ) -> torch.Tensor:
        """`encode` (any leading dims, a stack too) as two plain matrix products, the columns'
        first: one transposing copy instead of libtorch einsum's two, about half the time on a
        CPU. The same values up to float rounding, not upstream's bits (another contraction
        order): the sparse route's encode, whose payload only this node computes. Without
        `contiguous`, a 2-D+ result is a view of the block rows (`[..., I, n1, J, n2]` in
        memory), which `compression.compress` reads without the copy. With `scratch`, the
        products are written into its buffers (the result is valid until their next use)."""
        shape = list(x.shape)
        if len(shape) < 2:
            return self.encode(x)
        n1 = self.shape_dict[shape[-2]]
        n2 = self.shape_dict[shape[-1]]
        f1 = self._basis(self._f, n1, x)
        f2 = self._basis(self._f, n2, x)
        rows, cols = shape[-2] // n1, shape[-1] // n2
        flat = x.reshape(-1, n2)
        if scratch is None:
            columns = flat @ f2  # [..., I, n1, J, n2]: each block row's DCT
            both = torch.matmul(f1.t(), columns.view(-1, n1, cols * n2))  # [..., I, n1, J * n2]
        else:
            columns = torch.mm(flat, f2, out=scratch.get("columns", flat.shape, x))
            per_row = columns.view(-1, n1, cols * n2)
            both = torch.matmul(f1.t(), per_row, out=scratch.get("both", per_row.shape, x))
        blocks = both.view(*shape[:-2], rows, n1, cols, n2).transpose(-3, -2)
        return blocks.contiguous() if contiguous else blocks

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of `encode` (given the encoded layout)."""
        shape = list(x.shape)
        if len(shape) > 2:
            n1, n2 = shape[-2], shape[-1]
            b1 = self._basis(self._b, n1, x)
            b2 = self._basis(self._b, n2, x)
            y = _einsum("...ijkl, kb, ld -> ...ibjd", [x, b1, b2])
            ys = list(y.shape)
            return y.reshape(*ys[:-4], ys[-4] * ys[-3], ys[-2] * ys[-1])
        n1 = shape[1]
        b1 = self._basis(self._b, n1, x)
        y = _einsum("...ij, jb -> ...ib", [x, b1])
        return y.reshape(y.shape[0] * y.shape[1])

    def encode_stacked(self, x: torch.Tensor) -> torch.Tensor:
        """`encode` of every `x[g]` of a stack `[G, *shape]` in one call, as `[G, *encoded]`:
        the same contractions per block, with one more leading dimension (a 1-D parameter's
        blocks are rows, so a stack of them is more rows)."""
        if x.dim() == 2:
            n1 = self.shape_dict[x.shape[1]]
            f1 = self._basis(self._f, n1, x)
            return _einsum("...ij, jb -> ...ib", [x.reshape(-1, n1), f1]).view(x.shape[0], -1, n1)
        return self.encode(x)

    def decode_stacked(self, x: torch.Tensor) -> torch.Tensor:
        """`decode` of every `x[g]` of a stack `[G, *encoded]` in one call, as `[G, *shape]`."""
        if x.dim() == 3:
            n1 = x.shape[-1]
            b1 = self._basis(self._b, n1, x)
            return _einsum("...ij, jb -> ...ib", [x.reshape(-1, n1), b1]).view(x.shape[0], -1)
        return self.decode(x)

    def encoded_shape(self, shape: Sequence[int]) -> tuple[list[int], int]:
        """`(xshape, totalk)` that `encode` + `compress` produce for a parameter of `shape`."""
        shape = list(shape)
        if len(shape) > 1:
            n1 = self.shape_dict[shape[-2]]
            n2 = self.shape_dict[shape[-1]]
            return [*shape[:-2], shape[-2] // n1, shape[-1] // n2, n1, n2], n1 * n2
        n1 = self.shape_dict[shape[0]]
        return [shape[0] // n1, n1], n1


class Scratch:
    """Flat buffers reused for the large transient tensors of a CPU's encode (each fresh tensor
    of that size costs the faults and the zeroing of its pages: about half of the encode's time
    in the 20M model). `get(slot, shape, like)` is a view of the slot's buffer, valid until the
    next `get` of that slot; the buffer grows to the largest request (one parameter)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, slot: str, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        n = math.prod(shape)
        buffer = self._buffers.get(slot)
        if (
            buffer is None
            or buffer.numel() < n
            or buffer.dtype != like.dtype
            or buffer.device != like.device
        ):
            buffer = self._buffers[slot] = torch.empty(n, dtype=like.dtype, device=like.device)
        return buffer[:n].view(*shape)


# --------------------------------------------------------------------------------------------
# Sparse synthesis: decoding from the kept coefficients alone (the sparse route, opt-in)
#
# A decoded result is the inverse DCT of a block that holds at most `peers x top-k` non-zero
# coefficients of `n1 x n2` (8 of 4096 per peer for chunk 64, top-k 8): the dense route spends
# two full `n^3` matrix products per block on it. Synthesis from the kept coefficients is one
# product of `n1 x T` by `T x n2` per block (`T` the entries of the block: a quarter of the
# multiply-adds at T = 32, in float64 for exactness), with no dense coefficient tensor, same-
# shaped parameters in one call, and the signs added into the parameter a few block rows at a
# time.
#
# The determinism argument (`synthesize_signs`: the apply of 1-bit results, what every client
# must agree on bit for bit). The route defines the update as the sign of an exact integer,
# `Y[b, d] = sum_e W_e * Q1[k_e, b] * Q2[l_e, d]` over a block's entries `e` at `(k_e, l_e)`:
#
# * `Q` is the orthonormal inverse-DCT basis times 2^SYNTHESIS_BITS / c_0, rounded to integers
#   (at most 5793, 13 bits). It is computed from the cosine in float64 on the host and refused
#   where that value lies within 1e-6 of a rounding midpoint (none does for the sizes tested),
#   so any libm whose error is below 1e-6 gives the same integers, on any machine.
# * `W_e = +-round(2^WEIGHT_BITS / c)` is a 1-bit entry's share of the mean of the `c` entries
#   that land on its coefficient (at most 1024), from integer division.
# * The product runs in float64, where every operand and every partial sum is an integer below
#   2^53 (`sum_e |W_e| * max|Q1| * max|Q2| < 2^53` is checked; it holds up to 2^18 entries a
#   block, i.e. peers x top-k), so every product and sum is exact: the result is `Y` itself
#   whatever the summation order, blocking, FMA use, thread count, device or library. No
#   float64 matrix product on CPU or CUDA runs in reduced precision (TF32 is float32's).
# * The signs are then exact too; written in the parameter's dtype they are -1, 0 or 1, and
#   the step is upstream's own `p.add_(sign, alpha=-lr)`, elementwise, so exact per element.
#
# Sharding (FSDP) takes a slice of the same full tensor, and a data-parallel rank decodes the
# same results, so every rank and every client holds the same bits.
#
# The decode of this node's own unquantized results in `generate` (`prepare_values`) is a
# float product (the values are arbitrary floats): deterministic on one device and thread
# count, not across devices; it only moves this node's own momentum, which nobody else
# computes (a verifier compares statistically, `psyche.modeling.verification`).
#
# What changes against upstream: the update's signs are those of this integer synthesis, not of
# upstream's rounded dense decode. They differ only where the decoded value is within rounding
# of zero: about 1 coordinate in 10^4 against upstream's float32 decode, about 1 in 100 against
# its bfloat16 decode (which rounds the decoded value to 8 bits before its sign is taken; the
# integer synthesis is the more accurate of the two). `tests/modeling/test_distro_sparse.py`
# bounds it and `scripts/bench/distro.py --only fastpath` prints it. The route's `generate` also
# encodes with `TransformDCT.encode_separable` (another contraction order, the same values up to
# rounding). Upstream's route is itself not the same across devices (cuBLAS and MKL pick their
# summation order, and its basis comes from the device's FFT). A run takes this route on every
# client or on none: a run names it with its optimizer (`OptimizerDefinition.DistroSparse`, a
# run setting, docs/coordinator.md); a run that must match upstream's bits keeps upstream's
# dense route (`Distro`, the default).

SYNTHESIS_BITS = 12
"""The integer basis: the inverse-DCT basis times 2^12 (its k = 0 row 2^12 exactly)."""
WEIGHT_BITS = 10
"""An entry's share of its coefficient's mean: +-round(2^10 / count)."""
_MIDPOINT_MARGIN = 1e-6
SYNTHESIS_CHUNK = 256
"""Blocks per float64 product (2 MiB of output): the product, its sign and the copy into the
result stay in cache."""


def _largest(basis: torch.Tensor) -> int:
    return int(basis.abs().max())


def _integer_basis_rows(n: int) -> list[list[int]]:
    scale = float(1 << SYNTHESIS_BITS)
    rows = []
    for k in range(n):
        a = 1.0 if k == 0 else math.sqrt(2.0)
        row = []
        for j in range(n):
            x = scale * a * math.cos(math.pi * (2 * j + 1) * k / (2 * n))
            if abs(abs(x - math.floor(x)) - 0.5) < _MIDPOINT_MARGIN:
                raise ValueError(f"the integer DCT basis of size {n} has an ambiguous entry")
            row.append(math.floor(x + 0.5))
        rows.append(row)
    return rows


class SparseSynthesis:
    """Inverse DCT from the kept coefficients of each block (see the notes above).

    `transform` gives the float bases for `prepare_values` (the decode of this node's own
    unquantized results in `generate`, which only this node's momentum depends on)."""

    def __init__(self, transform: TransformDCT) -> None:
        self.transform = transform
        self._int: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._exact: dict[tuple[int, torch.device], torch.Tensor] = {}

    def integer_basis(self, n: int, device: torch.device) -> torch.Tensor:
        """`Q` of size `n` as int64 on `device` (rows: coefficient index)."""
        key = (n, device)
        basis = self._int.get(key)
        if basis is None:
            basis = torch.tensor(_integer_basis_rows(n), dtype=torch.int64, device=device)
            self._int[key] = basis
        return basis

    def _exact_float(self, n: int, device: torch.device) -> torch.Tensor:
        """`Q` as float64 (its integers are exact there)."""
        key = (n, device)
        basis = self._exact.get(key)
        if basis is None:
            basis = self._exact[key] = self.integer_basis(n, device).to(torch.float64)
        return basis

    def prepare_signs(
        self, idx: torch.Tensor, negative: torch.Tensor, n1: int, n2: int
    ) -> SignSynthesis:
        """The synthesis of the signs of the mean of 1-bit entries, decoded, ready to be read a
        range of blocks at a time (`SignSynthesis.signs`).

        `idx` `[B, T]` int64: each block's `T` entries, positions in the flattened `n1 x n2`
        block (`n2 == 1` for 1-D parameters); `negative` `[B, T]`: the 1-bit values (True is
        -1). The same bits on every device (see the notes above)."""
        device = idx.device
        counts = _entry_counts(idx)
        top = int(counts.max()) if counts.numel() else 1
        # an entry's row of `W * Q1`, read from a table of every weight a count can give
        shares = _shares(top, device)
        q1 = self._exact_float(n1, device)
        table = (shares.view(-1, 1, 1) * q1).view(-1, n1)
        key = (counts - 1).mul_(2).add_(negative.to(torch.int64))
        rows, cols = (idx, None) if n2 == 1 else (idx.div(n2, rounding_mode="floor"), idx % n2)
        key = key.mul_(n1).add_(rows)
        q2 = self._exact_float(n2, device) if cols is not None else None
        # every partial sum is at most sum_e |W_e| x max|Q1| x max|Q2| <= 1024 T x ...
        largest = int(shares.abs().max()) * idx.shape[1]
        if largest * _largest(q1) * (_largest(q2) if q2 is not None else 1) >= 2**53:
            raise ValueError("too many entries per block for the exact synthesis (> 2^18)")
        return SignSynthesis(table, key, q2, cols, n1, n2)

    def synthesize_signs(
        self, idx: torch.Tensor, negative: torch.Tensor, n1: int, n2: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """`prepare_signs` read whole: `[B, n1, n2]` in `dtype`."""
        synthesis = self.prepare_signs(idx, negative, n1, n2)
        blocks = idx.shape[0]
        parts = [
            synthesis.signs(start, min(start + SYNTHESIS_CHUNK, blocks), dtype)
            for start in range(0, blocks, SYNTHESIS_CHUNK)
        ]
        if not parts:
            return torch.empty((0, n1, n2), dtype=dtype, device=idx.device)
        return torch.cat(parts)

    def prepare_values(
        self, idx: torch.Tensor, values: torch.Tensor, n1: int, n2: int, like: torch.Tensor
    ) -> ValueSynthesis:
        """The decoded mean of entries with any values, ready to be read a range of blocks at a
        time (`ValueSynthesis.values`), in `like`'s dtype: float32 products with upstream's
        float basis. Deterministic on one device and thread count, not across devices: only for
        what one node keeps to itself (its momentum)."""
        counts = _entry_counts(idx)
        proto = like.new_empty((), dtype=torch.float32)
        share = values.to(torch.float32) / counts.to(torch.float32)
        rows, cols = (idx, None) if n2 == 1 else (idx.div(n2, rounding_mode="floor"), idx % n2)
        b1 = self.transform._basis(self.transform._b, n1, proto)
        b2 = None if cols is None else self.transform._basis(self.transform._b, n2, proto)
        return ValueSynthesis(b1, rows, share, b2, cols, like.dtype)


@dataclass(frozen=True)
class ValueSynthesis:
    """One group's prepared decode of entries with any values (`SparseSynthesis.prepare_values`).

    Each block is its own product (a batched `bmm` of one block per batch entry, or a sum over
    the block's entries), so a range of blocks read alone is the same computation as the whole
    read: the same bits, with the product's output in cache (`tests/modeling/
    test_distro_sparse.py` checks the ranges against the whole read)."""

    b1: torch.Tensor
    rows: torch.Tensor
    """`[B, T]`: each entry's row in its block (its coefficient's index for 1-D blocks)."""
    share: torch.Tensor
    """`[B, T]` float32: each entry's value over the count of entries on its coefficient."""
    b2: torch.Tensor | None
    cols: torch.Tensor | None
    dtype: torch.dtype

    def values(self, start: int, end: int) -> torch.Tensor:
        """The decoded blocks `start:end`, `[end - start, n1, n2]` in the prepared dtype."""
        a = _rows(self.b1, self.rows[start:end]).mul_(self.share[start:end].unsqueeze(-1))
        if self.b2 is None or self.cols is None:
            y = a.sum(1).unsqueeze(-1)
        else:
            y = torch.bmm(a.transpose(1, 2), _rows(self.b2, self.cols[start:end]))
        return y.to(self.dtype)


@dataclass(frozen=True)
class SignSynthesis:
    """One group's prepared sign synthesis (`SparseSynthesis.prepare_signs`)."""

    table: torch.Tensor
    """`W * Q1` for every weight a count gives, float64, rows keyed by `key`."""
    key: torch.Tensor
    """`[B, T]`: each entry's row of `table`."""
    q2: torch.Tensor | None
    cols: torch.Tensor | None
    n1: int
    n2: int

    def signs(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """The signs of blocks `start:end`, `[end - start, n1, n2]` in `dtype` (-1, 0, 1)."""
        # exact: an 11-bit weight times a 13-bit basis entry, then integer sums < 2^53
        a = _rows(self.table, self.key[start:end])
        if self.q2 is None or self.cols is None:
            y = a.sum(1).unsqueeze(-1)
        else:
            y = torch.bmm(a.transpose(1, 2), _rows(self.q2, self.cols[start:end]))
        # a non-zero integer keeps its sign and stays non-zero in any float dtype
        return y.to(dtype).sign_()


def _rows(basis: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`basis[index]` (`[B, T]` -> `[B, T, n]`) through `index_select`, faster than indexing."""
    return basis.index_select(0, index.reshape(-1)).view(*index.shape, basis.shape[1])


def _entry_counts(idx: torch.Tensor) -> torch.Tensor:
    """How many entries of its block land on each entry's coefficient, `[B, T]` int64."""
    blocks, entries = idx.shape
    if entries <= 64:  # a few thousand comparisons a block: cheaper than sorting
        # counted in uint8 (at most 64), a quarter of the memory of int64's sum of the matches
        same = (idx.unsqueeze(-1) == idx.unsqueeze(-2)).view(torch.uint8)
        return same.sum(-1, dtype=torch.uint8).to(torch.int64)
    span = int(idx.max()) + 1 if idx.numel() else 1
    keys = torch.arange(blocks, device=idx.device).unsqueeze(1) * span + idx
    unique: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = torch.unique(
        keys, return_inverse=True, return_counts=True
    )
    return unique[2][unique[1]]


def _shares(top: int, device: torch.device) -> torch.Tensor:
    """`[+round(2^WEIGHT_BITS / c), -round(2^WEIGHT_BITS / c)]` for c = 1..top, float64: a 1-bit
    entry's integer share of the mean of the `c` entries on its coefficient (integer division,
    the same everywhere)."""
    c = torch.arange(1, top + 1, dtype=torch.int64)
    share = torch.div((1 << WEIGHT_BITS) + c // 2, c, rounding_mode="floor")
    return torch.stack([share, -share], 1).reshape(-1).to(device, torch.float64)
