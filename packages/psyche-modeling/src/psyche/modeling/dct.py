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
