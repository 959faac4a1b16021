"""The DisTrO optimizer: momentum in the DCT domain, top-k of each block sent, sign-SGD on the mean.

Split in two the way Psyche uses it:

* `generate` (after this node's backward pass) folds the gradient into the momentum `delta`,
  removes what this node already transmitted last round, and compresses `delta` into one
  `DistroResult` per parameter;
* `apply` (at the start of the next round) averages every accepted peer's results per
  coefficient, decodes them, and takes a sign-SGD step.

`error_correction` applies a lookahead (`sign(delta) * prev_lr`) before the forward pass that
stands in for this node's own still-unapplied contribution; `generate` undoes it.

Every in-place op below is written in the same form as upstream (`add_(g * lr)` rather than
`add_(g, alpha=lr)`, for instance): the two forms round differently in bf16, and all clients
must end with the same bits. The sparse route (a run setting, `OptimizerDefinition.
DistroSparse`) takes the one-pass forms for what only this node's own state depends on (the
lookahead and its undo, the momentum's update): its applied update is defined by the exact
synthesis, not by upstream's op order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

import torch
from torch import nn

from psyche.modeling.compression import (
    _EXACT_INTEGERS,
    clamp_topk,
    compress,
    compress_idx,
    decompress,
    decompress_idx,
    index_width,
)
from psyche.modeling.dct import (
    SYNTHESIS_CHUNK,
    Scratch,
    SignSynthesis,
    SparseSynthesis,
    TransformDCT,
    ValueSynthesis,
    decode_reads_transposed,
    get_smaller_split,
)
from psyche.modeling.sharding import full_tensor, is_sharded, local_tensor, shard_like

if TYPE_CHECKING:
    from psyche.core import definitions


# Which route `Distro` takes when its caller does not say: None is the batched route on CUDA and
# the per-parameter route (upstream's op order, bit for bit) elsewhere. Tests set it to run the
# batched route on the CPU through code that builds its own `Distro` (the sharded-rank scenarios).
BATCHED_ROUTE: bool | None = None

# The most elements one stack of the batched route holds (256 MiB in bf16): a group of
# same-shaped parameters larger than this is split into consecutive stacks, so that the route's
# transient memory (the stack, its coefficients and their magnitudes) stays a few times this
# whatever the model's size, as the per-parameter route's stays a few times one parameter.
MAX_STACK_NUMEL = 1 << 27

# Whether `Distro` decodes from the kept coefficients (`psyche.modeling.dct.SparseSynthesis`)
# when its caller does not say. Off: upstream's dense route, upstream's bits. A run takes the
# sparse route on every client or on none (its update's signs differ from upstream's in a few
# coordinates in 10^4): clients take the run's route (`OptimizerDefinition.DistroSparse`,
# through `Distro.from_definition`), never this default.
SPARSE_ROUTE = False

# Blocks of a plain matrix parameter per pass of the sparse route's momentum steps in `generate`
# (`Distro._step_momentum`): 32 blocks of 64 x 64 are 128 K elements, so the parameter's, the
# momentum's and the gradient's slices stay in cache across the five elementwise steps.
MOMENTUM_CHUNK = 32


@dataclass
class DistroResult:
    """One parameter's compressed momentum: index bytes, values, encoded shape, block size."""

    sparse_idx: torch.Tensor
    sparse_val: torch.Tensor
    xshape: list[int]
    totalk: int
    stats: dict[str, float] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ResultLayout:
    """What a valid result for one parameter must look like (used to vet incoming payloads)."""

    name: str
    xshape: tuple[int, ...]
    totalk: int
    topk: int
    index_bytes: int
    dtype: torch.dtype

    @property
    def idx_shape(self) -> tuple[int, ...]:
        return (*self.block_shape, self.topk * self.index_bytes)

    @property
    def val_shape(self) -> tuple[int, ...]:
        return (*self.block_shape, self.topk)

    @property
    def block_shape(self) -> tuple[int, ...]:
        # 2-D+ parameters: blocks are [..., y, x]; 1-D: [N/n1].
        return self.xshape[:-2] if len(self.xshape) > 2 else self.xshape[:-1]


def result_layouts(
    variables: Iterable[tuple[str, Sequence[int], torch.dtype]], chunk: int, topk: int
) -> list[ResultLayout]:
    """Result layouts from parameter shapes alone (no tensors needed), in the given order."""
    out = []
    for name, shape, dtype in variables:
        shape = list(shape)
        if len(shape) > 1:
            n1 = get_smaller_split(shape[-2], chunk)
            n2 = get_smaller_split(shape[-1], chunk)
            xshape = (*shape[:-2], shape[-2] // n1, shape[-1] // n2, n1, n2)
            totalk = n1 * n2
        else:
            n1 = get_smaller_split(shape[0], chunk)
            xshape, totalk = (shape[0] // n1, n1), n1
        out.append(
            ResultLayout(
                name=name,
                xshape=xshape,
                totalk=totalk,
                topk=clamp_topk(totalk, topk),
                index_bytes=index_width(totalk),
                dtype=dtype,
            )
        )
    return out


@overload
def sorted_variables(source: nn.Module) -> list[tuple[str, nn.Parameter]]: ...
@overload
def sorted_variables(
    source: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]: ...
def sorted_variables(
    source: nn.Module | Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, Any]]:
    """Named parameters in upstream's variable order: ascending byte-wise by name.

    Wrapper prefixes from activation checkpointing and `torch.compile` are stripped so that the
    names (and so the order) are those of the plain model.
    """
    items = source.named_parameters() if isinstance(source, nn.Module) else source
    cleaned = [(_clean_name(name), p) for name, p in items]
    names = [n for n, _ in cleaned]
    if len(set(names)) != len(names):
        raise ValueError("parameter names are not unique after stripping wrapper prefixes")
    return sorted(cleaned, key=lambda item: item[0].encode("utf-8"))


def _clean_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def quantize_nozeros_tensor_to_boolean_sign(tensor: torch.Tensor) -> torch.Tensor:
    """1-bit quantization: True where the sign bit is set (so -0.0 and negative NaN map to -1)."""
    return tensor.signbit()


def unpack_tensor_sign_from_boolean(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """True -> -1, False -> +1, in `dtype`."""
    return tensor.to(dtype) * -2 + 1


def _cat_to(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if all(t.device == tensors[0].device for t in tensors):
        return torch.cat(list(tensors), -1).to(device, non_blocking=True)
    return torch.cat([t.to(device, non_blocking=True) for t in tensors], -1)


def _values_for(sparse_val: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    val = sparse_val.to(device, non_blocking=True)
    if val.dtype == torch.bool:
        return unpack_tensor_sign_from_boolean(val, dtype)
    return val


class Distro:
    """DisTrO state for one model replica: one momentum tensor per parameter, and the DCT bases.

    `variables` are `(name, parameter)` pairs or a module; they are put in upstream's order
    (sorted by name), and every result list is indexed in that order.
    """

    def __init__(
        self,
        variables: nn.Module | Iterable[tuple[str, torch.Tensor]],
        compression_decay: float,
        compression_chunk: int,
        compression_topk: int,
        weight_decay: float = 0.0,
        batched: bool | None = None,
        sparse: bool | None = None,
    ) -> None:
        self.variables = sorted_variables(variables)
        if not self.variables:
            raise ValueError("DisTrO needs at least one parameter")
        for name, p in self.variables:
            if p.dim() == 0:
                raise ValueError(f"parameter {name!r} is a scalar; DisTrO needs 1-D or larger")
        if compression_chunk < 1:
            raise ValueError(f"compression_chunk must be >= 1, got {compression_chunk}")
        self.compression_decay = float(compression_decay)
        self.compression_chunk = int(compression_chunk)
        self.compression_topk = int(compression_topk)
        self.weight_decay = float(weight_decay)
        self.keep_encoded = False
        """Keep the momentum's DCT (`encoded`) at each `generate`: a witness's reference
        (`psyche.modeling.screening`); off by default (it holds a copy of the model)."""
        self.encoded: list[torch.Tensor] | None = None
        self.applied: list[torch.Tensor] | None = None
        """With `keep_encoded` (a witness): the coefficients the last `apply` stepped with, one
        tensor per parameter (the results' per-coefficient mean as `decompress` built them, a
        2-D parameter's blocks possibly stored column-major; kept, not copied), the witness's
        recent aggregate (`psyche.modeling.screening`). None where that apply built none (the
        batched and sparse routes) or before any."""
        with torch.no_grad():
            # Upstream's native models get uninitialised memory here; real zeros are what its
            # Python models (and every test) use, and what a fresh joiner must agree on.
            self.deltas = [torch.zeros_like(p) for _, p in self.variables]
            for _, p in self.variables:
                if p.grad is not None:
                    p.grad.zero_()
        self.transform = TransformDCT(
            ((tuple(p.shape), p.dtype, p.device) for _, p in self.variables), compression_chunk
        )
        if batched is None:
            batched = BATCHED_ROUTE
        if batched is None:
            batched = all(p.device.type == "cuda" for _, p in self.variables)
        self.groups = _same_shape_groups(self.variables, self.transform) if batched else None
        if sparse is None:
            sparse = SPARSE_ROUTE
        self.synthesis = SparseSynthesis(self.transform) if sparse else None
        """The sparse route (`SPARSE_ROUTE`): `apply` of 1-bit results takes the exact integer
        synthesis's signs, `generate` decodes its own results from their kept coefficients."""
        self.sparse_groups = _same_shape_groups(self.variables, self.transform) if sparse else None
        self._scratch = Scratch()

    @classmethod
    def from_definition(
        cls,
        variables: nn.Module | Iterable[tuple[str, torch.Tensor]],
        definition: definitions.Distro,
        sparse: bool = False,
    ) -> Distro:
        """Build from `psyche.core.definitions.Distro` (its f32 fields are already f32 values);
        `sparse` is the run's route (`OptimizerDefinition.DistroSparse`), never a client's own
        choice: upstream's dense route unless the run names the sparse one."""
        d = definition
        return cls(
            variables,
            compression_decay=float(d.compression_decay),
            compression_chunk=int(d.compression_chunk),
            compression_topk=int(d.compression_topk),
            weight_decay=float(d.weight_decay or 0.0),
            sparse=sparse,
        )

    # ----------------------------------------------------------------------------------------

    def layouts(self) -> list[ResultLayout]:
        """Expected shape of every parameter's result, in variable order."""
        return result_layouts(
            ((name, tuple(p.shape), p.dtype) for name, p in self.variables),
            self.compression_chunk,
            self.compression_topk,
        )

    def zero_optim(self) -> None:
        for delta in self.deltas:
            delta.zero_()

    @torch.no_grad()
    def error_correction(self, prev_lr: float) -> None:
        """Lookahead before the forward pass: `p -= sign(delta) * prev_lr` (upstream's form; the
        sparse route's, `p.sub_(sign, alpha=prev_lr)`, is one pass less and mirrors its undo in
        `generate`)."""
        for (_, p), delta in zip(self.variables, self.deltas):
            if self.synthesis is None:
                p.sub_(delta.sign().mul_(prev_lr))
            else:
                p.sub_(delta.sign(), alpha=prev_lr)

    @torch.no_grad()
    def generate(
        self,
        prev_self_results: Sequence[Sequence[DistroResult]],
        prev_lr: float,
        lr: float,
        stats: bool = False,
    ) -> list[DistroResult]:
        """Fold the current gradients into the momentum and compress it (one result per var).

        `prev_self_results` are this node's own *unquantized* results of the previous round (all
        of them, if it trained more than one batch); their decoded sum leaves the momentum.
        """
        self._check_results(prev_self_results)
        if self.groups is not None and not stats:
            return self._generate_batched(prev_self_results, prev_lr, lr)
        out: list[DistroResult] = []
        encoded: list[torch.Tensor] = []
        own = self._prepare_own(prev_self_results) if prev_self_results else None
        for index, ((name, p), delta) in enumerate(zip(self.variables, self.deltas)):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            grad_energy = (
                torch.linalg.vector_norm(full_tensor(grad), 1, dtype=torch.float32).item()
                if stats
                else None
            )
            if self.synthesis is not None:
                self._step_momentum(index, grad, own[index] if own else None, prev_lr, lr)
            else:
                self._step_momentum_upstream(index, grad, prev_self_results, prev_lr, lr)

            # A sharded momentum is gathered first (upstream `gather_full_tensor`): the payload
            # is computed on the full tensor, the same bits as on a one-device client.
            full = full_tensor(delta)
            magnitudes = None
            if self.synthesis is None:
                coefficients = self.transform.encode(full)
            else:
                # on a CPU, the encode's large transients reuse buffers (`Scratch`), except what
                # a witness keeps (`keep_encoded`)
                scratch = (
                    self._scratch if full.device.type == "cpu" and not self.keep_encoded else None
                )
                coefficients = self.transform.encode_separable(
                    full, contiguous=self.keep_encoded, scratch=scratch
                )
                if scratch is not None:
                    magnitudes = scratch.get("magnitudes", coefficients.shape, coefficients)
            sparse_idx, sparse_val, xshape, totalk = compress(
                coefficients, self.compression_topk, magnitudes
            )
            if self.keep_encoded:
                encoded.append(coefficients)
            result_stats = None
            if stats:
                delta_energy = torch.linalg.vector_norm(full, 1, dtype=torch.float32).item()
                result_stats = {
                    f"{name}.delta_energy": delta_energy,
                    f"{name}.grad_energy": float(grad_energy or 0.0),  # set whenever stats is
                }
            out.append(DistroResult(sparse_idx, sparse_val, xshape, totalk, result_stats))
        self.encoded = encoded if self.keep_encoded else None
        return out

    def _step_momentum_upstream(
        self,
        index: int,
        grad: torch.Tensor,
        prev_self_results: Sequence[Sequence[DistroResult]],
        prev_lr: float,
        lr: float,
    ) -> None:
        """Upstream's steps of `generate` before the encode, for parameter `index`, in its
        forms: undo the lookahead, remove this node's own last results, weight decay, momentum
        decay, and the gradient's add."""
        (_, p), delta = self.variables[index], self.deltas[index]
        p.add_(delta.sign().mul_(prev_lr))
        if prev_self_results:
            decoded = self._decode_results(prev_self_results, index, p)
            delta.sub_(shard_like(decoded, delta))
        if self.weight_decay != 0.0:
            p.mul_(1.0 - lr * self.weight_decay)
        if self.compression_decay != 1.0:
            delta.mul_(self.compression_decay)
        delta.add_(grad * lr)

    def _step_momentum(
        self,
        index: int,
        grad: torch.Tensor,
        own: tuple[ValueSynthesis, int] | None,
        prev_lr: float,
        lr: float,
    ) -> None:
        """The sparse route's steps of `generate` before the encode, for parameter `index`:
        upstream's, in one-pass forms (see `error_correction`), with this node's own last
        results decoded from their kept coefficients (`own`: the group's prepared decode and
        the parameter's first block; None: no own results). A plain matrix parameter takes
        every step a few block rows at a time, in cache: each step is elementwise, so each
        element gets the same ops in the same order, the same bits as the whole-tensor passes
        that the other parameters take."""
        (_, p), delta = self.variables[index], self.deltas[index]
        xshape = self.layouts_xshape(index)
        n1, n2 = _block_dims(xshape)
        plain = len(xshape) == 4 and all(
            not is_sharded(t) and t.is_contiguous() for t in (p, delta, grad)
        )
        if plain:
            per_row, ranges = xshape[-3], _block_row_ranges(xshape, MOMENTUM_CHUNK)
        else:  # one range: the whole parameter
            per_row, ranges = math.prod(_block_view(xshape)[:-1]), [(0, 1)]
        for row, end in ranges:
            pc, dc, gc = (t[row * n1 : end * n1] if plain else t for t in (p, delta, grad))
            pc.add_(dc.sign(), alpha=prev_lr)
            if own is not None:
                synthesis, first = own
                blocks = synthesis.values(first + row * per_row, first + end * per_row)
                if plain:
                    view = dc.view(end - row, n1, per_row, n2).transpose(1, 2)
                    view.add_(blocks.view(end - row, per_row, n1, n2), alpha=-1.0)
                else:
                    blocks = blocks.view(*_block_view(xshape)[:-1], n1, n2)
                    _update_blocks(dc, blocks, -1.0, xshape)
            if self.weight_decay != 0.0:
                pc.mul_(1.0 - lr * self.weight_decay)
            if self.compression_decay != 1.0:
                dc.mul_(self.compression_decay)
            dc.add_(gc, alpha=lr)

    @torch.no_grad()
    def apply(self, results: Sequence[Sequence[DistroResult]], lr: float) -> None:
        """Sign-SGD step on the per-coefficient mean of every result list in `results`.

        An empty `results` is a no-op (no step, no weight decay), as upstream.
        """
        if not results:
            return
        self._check_results(results)
        self.applied = None
        done = self._apply_sparse(results, lr) if self.synthesis is not None else set()
        if self.groups is not None and not done:
            self._apply_batched(results, lr)
            return
        kept: list[torch.Tensor] | None = [] if self.keep_encoded and not done else None
        # Upstream copies the decoded update into `.grad`, takes its sign and lets SGD do
        # `p.add_(grad, alpha=-lr)`; the decoded tensor already has the parameter's dtype, so
        # stepping with it directly gives the same bits without the copy.
        for index, (_, p) in enumerate(self.variables):
            if index in done:
                continue
            # A sharded parameter takes its slice of the decoded aggregate (upstream `set_grad`).
            decoded = self._decode_results(results, index, p, kept)
            p.add_(shard_like(decoded, p).sign_(), alpha=-lr)
        self.applied = kept
        for _, p in self.variables:
            if p.grad is not None:
                p.grad.zero_()

    # ---- the batched route (CUDA) ------------------------------------------------------------
    #
    # On a GPU the per-parameter loop above is bound by the host: a 1B Llama's 201 parameters
    # cost about 15,000 kernel launches and 1,250 host synchronisations per step (generate +
    # apply) against a fraction of that in kernel time. The batched route computes the same
    # values with one call per group of same-shaped parameters (`self.groups`) and `_foreach`
    # ops for the elementwise steps:
    #
    # * elementwise ops are exact per element, so `torch._foreach_*` gives the bits of the
    #   per-tensor op in the same form (`_foreach_mul_(x, s)` is `x.mul_(s)`; the add of
    #   `sign * -lr` is exact before its one rounding, with or without an FMA);
    # * the DCT of a stack of parameters is the same einsum with one more leading dimension:
    #   every block is the same 64-long contractions (no split over the contracted dims);
    # * the top-k runs per parameter on its slice of the stacked coefficients (the selection
    #   among equal magnitudes, and the order of an unsorted top-k, depend on the kernel's
    #   choice, which depends on the number of slices);
    # * decoding uses upstream's own dense scatter-mean, without host synchronisation, only
    #   where it is deterministic on CUDA: 1-bit values (the sums of +-1 are exact integers
    #   while at most `_EXACT_INTEGERS` results land on a coefficient) or a single result list
    #   (distinct indices per block: nothing collides); anything else takes the per-parameter
    #   route (`_decode_results`), as do sharded parameters and single-block groups.
    #
    # Indices are not range-checked here: peers' payloads are checked on the host when they are
    # deserialized (`distro_results_from_transmittable`), own results are in range by
    # construction, and an out-of-range index must never reach a GPU anyway.

    def _generate_batched(
        self, prev_self_results: Sequence[Sequence[DistroResult]], prev_lr: float, lr: float
    ) -> list[DistroResult]:
        assert self.groups is not None
        params = [local_tensor(p) for _, p in self.variables]
        deltas = [local_tensor(d) for d in self.deltas]
        grads = [
            local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p))
            for _, p in self.variables
        ]
        signs = torch._foreach_sign(deltas)
        if self.synthesis is None:
            torch._foreach_mul_(signs, prev_lr)
            torch._foreach_add_(params, signs)
        else:
            torch._foreach_add_(params, signs, alpha=prev_lr)
        del signs
        if prev_self_results and self.synthesis is not None:
            for index, (synthesis, first) in enumerate(self._prepare_own(prev_self_results) or []):
                xshape = self.layouts_xshape(index)
                blocks = _block_view(xshape)[:-1]
                own_blocks = synthesis.values(first, first + math.prod(blocks))
                own_blocks = own_blocks.view(*blocks, *_block_dims(xshape))
                _update_blocks(self.deltas[index], own_blocks, -1.0, xshape)
        elif prev_self_results:
            torch._foreach_sub_(deltas, self._decode_all(prev_self_results))
        if self.weight_decay != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * self.weight_decay)
        if self.compression_decay != 1.0:
            torch._foreach_mul_(deltas, self.compression_decay)
        if self.synthesis is None:
            torch._foreach_add_(deltas, torch._foreach_mul(grads, lr))
        else:
            torch._foreach_add_(deltas, grads, alpha=lr)
        out: list[DistroResult | None] = [None] * len(params)
        encoded: list[torch.Tensor | None] = [None] * len(params)
        for group in self.groups:
            # a sharded momentum is gathered first (a collective, in group order on every rank)
            stacked = torch.stack([full_tensor(self.deltas[i]) for i in group])
            xshape, totalk = self.transform.encoded_shape(stacked.shape[1:])
            blocks = _block_view(xshape)
            if self.synthesis is None or stacked.dim() < 3:
                encoded_stack = self.transform.encode_stacked(stacked)
            else:
                encoded_stack = self.transform.encode_separable(stacked)
            coefficients = encoded_stack.reshape(len(group), *blocks)
            magnitudes = coefficients.abs()
            k = clamp_topk(totalk, self.compression_topk)
            for j, index in enumerate(group):
                idx = magnitudes[j].topk(k, dim=-1, largest=True, sorted=False).indices
                val = coefficients[j].gather(-1, idx)
                out[index] = DistroResult(compress_idx(totalk, idx), val, list(xshape), totalk)
                if self.keep_encoded:  # a witness's reference, as the per-parameter route keeps it
                    encoded[index] = coefficients[j].view(xshape)
        self.encoded = [e for e in encoded if e is not None] if self.keep_encoded else None
        return [r for r in out if r is not None]

    def _apply_batched(self, results: Sequence[Sequence[DistroResult]], lr: float) -> None:
        params = [local_tensor(p) for _, p in self.variables]
        decoded = self._decode_all(results)
        torch._foreach_sign_(decoded)
        torch._foreach_add_(params, decoded, alpha=-lr)
        grads = [local_tensor(p.grad) for _, p in self.variables if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    def _decode_all(self, results: Sequence[Sequence[DistroResult]]) -> list[torch.Tensor]:
        """Every parameter's decoded mean of `results`, in the parameter's dtype, as this rank's
        part of it (the whole tensor unless the parameter is sharded)."""
        assert self.groups is not None
        decoded: list[torch.Tensor | None] = [None] * len(self.variables)
        for group in self.groups:
            like = self.variables[group[0]][1]
            stacked = self._decode_stacked_if_exact(results, group, like)
            for j, index in enumerate(group):
                p = self.variables[index][1]
                full = self._decode_results(results, index, p) if stacked is None else stacked[j]
                decoded[index] = local_tensor(shard_like(full, p))
        return [d for d in decoded if d is not None]

    def _decode_stacked_if_exact(
        self, results: Sequence[Sequence[DistroResult]], group: list[int], like: torch.Tensor
    ) -> torch.Tensor | None:
        """The group's decoded means stacked, through upstream's dense scatter-mean; None where
        that op is not deterministic on this device (see the notes above)."""
        device, dtype = like.device, like.dtype
        if len(group) == 1 and not is_sharded(like):
            return None  # nothing to batch: the per-parameter route (with its fast decode)
        vals = [r[i].sparse_val for i in group for r in results]
        one_bit = all(v.dtype == torch.bool for v in vals)
        exact = len(results) <= _EXACT_INTEGERS.get(dtype, 0)
        if not ((one_bit and exact) or len(results) == 1):
            return None
        first = results[0][group[0]]
        xshape, totalk = list(first.xshape), abs(first.totalk)
        blocks = _block_view(xshape)
        count, peers = len(group), len(results)
        # each parameter's peers side by side along the block's last dim, in result order, as
        # `_decode_results` concatenates them (index bytes are viewed as integers after that)
        idx = _stack_peers([r[i].sparse_idx for i in group for r in results], count, peers, device)
        idx = decompress_idx(totalk, idx)
        val = _stack_peers(vals, count, peers, device)
        val = unpack_tensor_sign_from_boolean(val, dtype) if one_bit else val.to(dtype)
        dense = torch.zeros((len(group), *blocks), dtype=dtype, device=device)
        dense.scatter_reduce_(-1, idx, val, reduce="mean", include_self=False)
        return self.transform.decode_stacked(dense.view(len(group), *xshape))

    # ---- the sparse route --------------------------------------------------------------------

    def layouts_xshape(self, index: int) -> list[int]:
        """Parameter `index`'s encoded shape (`[..., I, J, n1, n2]`, 1-D `[N / n1, n1]`)."""
        return self.transform.encoded_shape(tuple(self.variables[index][1].shape))[0]

    def _sparse_entries(
        self, results: Sequence[Sequence[DistroResult]], group: list[int]
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """A group's entries, one row per block (the group's parameters one after the other,
        each peer's entries side by side in result order): `(xshape, idx [B, T], values)`."""
        like = self.variables[group[0]][1]
        first = results[0][group[0]]
        xshape, totalk = list(first.xshape), abs(first.totalk)
        count, peers = len(group), len(results)
        idx = _stack_peers(
            [r[i].sparse_idx for i in group for r in results], count, peers, like.device
        )
        idx = decompress_idx(totalk, idx)
        flat = idx.reshape(-1, idx.shape[-1])
        vals = [r[i].sparse_val for i in group for r in results]
        return xshape, flat, _stack_peers(vals, count, peers, like.device).reshape(flat.shape)

    def _apply_sparse(self, results: Sequence[Sequence[DistroResult]], lr: float) -> set[int]:
        """The sparse route's apply of every group whose results are all 1-bit: upstream's
        `p.add_(sign, alpha=-lr)` with the exact synthesis's signs, a range of blocks at a time
        straight into the parameter. Returns the parameters it stepped (the others take
        upstream's route)."""
        assert self.synthesis is not None
        assert self.sparse_groups is not None
        done: set[int] = set()
        for group in self.sparse_groups:
            if not all(r[i].sparse_val.dtype == torch.bool for i in group for r in results):
                continue
            xshape, idx, negative = self._sparse_entries(results, group)
            n1, n2 = _block_dims(xshape)
            synthesis = self.synthesis.prepare_signs(idx, negative, n1, n2)
            per_param = idx.shape[0] // len(group)
            for j, index in enumerate(group):
                p = self.variables[index][1]
                first = j * per_param
                if is_sharded(p) or not p.is_contiguous():
                    signs = synthesis.signs(first, first + per_param, p.dtype)
                    signs = signs.view(*_block_view(xshape)[:-1], n1, n2)
                    _update_blocks(p, signs, -lr, xshape)
                else:
                    _apply_in_ranges(p, synthesis, first, per_param, xshape, lr)
                done.add(index)
        return done

    def _prepare_own(
        self, results: Sequence[Sequence[DistroResult]]
    ) -> list[tuple[ValueSynthesis, int]] | None:
        """The sparse route's decode of this node's own results of the last round (any values),
        prepared one call per group: for each parameter, its group's `ValueSynthesis` and the
        parameter's first block in it (blocks `[..., n1, n2]`, 1-D `[N / n1, n1, 1]`). None
        without the route."""
        if self.synthesis is None or self.sparse_groups is None:
            return None
        out: list[tuple[ValueSynthesis, int] | None] = [None] * len(self.variables)
        for group in self.sparse_groups:
            like = self.variables[group[0]][1]
            xshape, idx, val = self._sparse_entries(results, group)
            n1, n2 = _block_dims(xshape)
            if val.dtype == torch.bool:
                val = unpack_tensor_sign_from_boolean(val, like.dtype)
            synthesis = self.synthesis.prepare_values(idx, val, n1, n2, like)
            per_param = idx.shape[0] // len(group)
            for j, index in enumerate(group):
                out[index] = (synthesis, j * per_param)
        return [entry for entry in out if entry is not None]

    # ----------------------------------------------------------------------------------------

    def _decode_results(
        self,
        results: Sequence[Sequence[DistroResult]],
        index: int,
        p: torch.Tensor,
        kept: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Concatenate every result's entry for parameter `index`, mean-scatter and decode.

        Equivalent to upstream's per-result device copy, unpack and `cat`, but concatenates on
        the source device first so that P peers cost one host-to-device copy (and 1-bit values
        travel as bytes, unpacked on the device); the values are the same, so are the bits.
        The dense coefficients are built in the layout `decode` reads without a copy, from the
        touched coefficients alone where that gives the same bits (see `decompress`), and
        appended to `kept` when given (`applied`).
        """
        device = p.device
        entries = [r[index] for r in results]
        idx = _cat_to([e.sparse_idx for e in entries], device)
        vals = [e.sparse_val for e in entries]
        if all(v.dtype == torch.bool for v in vals):
            val = unpack_tensor_sign_from_boolean(_cat_to(vals, device), p.dtype)
        else:
            val = torch.cat([_values_for(v, p.dtype, device) for v in vals], -1)
        first = entries[0]
        dense = decompress(
            idx,
            val,
            first.xshape,
            first.totalk,
            p.dtype,
            device,
            transposed=decode_reads_transposed(first.xshape),
        )
        if kept is not None:
            kept.append(dense)
        return self.transform.decode(dense)

    def _check_results(self, results: Sequence[Sequence[DistroResult]]) -> None:
        check_result_lists(results, len(self.variables), "peer or batch")


def check_result_lists(
    results: Sequence[Sequence[DistroResult]], parameters: int, per: str
) -> None:
    """Raise unless `results` is a list of result lists (one per `per`), each with one entry per
    parameter of a model of `parameters` parameters: a bare result list (a common slip) is a
    `TypeError`, a list of the wrong length a `ValueError` naming its index."""
    for i, r in enumerate(results):
        if isinstance(r, DistroResult):
            raise TypeError(f"expected a list of result lists (one list per {per})")
        if len(r) != parameters:
            raise ValueError(
                f"result list {i} has {len(r)} entries; the model has {parameters} parameters"
            )


def _stack_peers(
    tensors: Sequence[torch.Tensor], count: int, peers: int, device: torch.device
) -> torch.Tensor:
    """`count * peers` tensors `[*lead, n]` (parameter-major) -> `[count, *lead, peers * n]` on
    `device`: per parameter, its peers' tensors concatenated along the last dim. Stacked where
    they are (host tensors travel in one copy), then moved."""
    if all(t.device == tensors[0].device for t in tensors):
        stacked = torch.stack(list(tensors)).to(device, non_blocking=True)
    else:
        stacked = torch.stack([t.to(device, non_blocking=True) for t in tensors])
    lead = stacked.shape[1:-1]
    stacked = stacked.view(count, peers, *lead, stacked.shape[-1]).movedim(1, -2)
    return stacked.reshape(count, *lead, -1)


def _update_blocks(
    target: torch.Tensor, blocks: torch.Tensor, alpha: float, xshape: Sequence[int]
) -> None:
    """`target.add_(decoded, alpha=alpha)` for a decoded tensor given as blocks (`_prepare_own`),
    in `target`'s dtype: through a strided view of `target` when it is one plain tensor (the same
    elementwise op on each element, so the same bits, without moving the blocks into the
    parameter's layout), else through the layout (a sharded parameter takes its slice)."""
    blocks = blocks.to(target.dtype)
    if len(xshape) > 2:
        *lead, i, j, n1, n2 = xshape
        if not is_sharded(target) and target.is_contiguous():
            view = target.view(*lead, i, n1, j, n2).transpose(-3, -2)
            view.add_(blocks, alpha=alpha)
            return
        full = blocks.transpose(-3, -2).reshape(*lead, i * n1, j * n2)
    else:
        full = blocks.reshape(-1)
        if not is_sharded(target) and target.is_contiguous():
            target.add_(full.view(target.shape), alpha=alpha)
            return
    target.add_(shard_like(full, target), alpha=alpha)


def _block_dims(xshape: Sequence[int]) -> tuple[int, int]:
    """A block's `(n1, n2)` (`n2 == 1` for a 1-D parameter's blocks)."""
    return (xshape[-2], xshape[-1]) if len(xshape) > 2 else (xshape[-1], 1)


def _apply_in_ranges(
    p: torch.Tensor,
    synthesis: SignSynthesis,
    first: int,
    blocks: int,
    xshape: Sequence[int],
    lr: float,
) -> None:
    """`p.add_(signs, alpha=-lr)` for one plain parameter whose blocks are `first:first +
    blocks` of `synthesis`, a few block rows at a time, through a strided view of `p` (the same
    elementwise op on each element): the signs never exist at the parameter's size."""
    n1, n2 = _block_dims(xshape)
    per_row = xshape[-3] if len(xshape) > 2 else 1  # blocks in a row of blocks
    rows = blocks // per_row
    view = p.view(rows, n1, per_row, n2).transpose(1, 2)  # [rows, J, n1, n2]
    for row, end in _block_row_ranges(xshape, SYNTHESIS_CHUNK, rows):
        signs = synthesis.signs(first + row * per_row, first + end * per_row, p.dtype)
        view[row:end].add_(signs.view(end - row, per_row, n1, n2), alpha=-lr)


def _block_row_ranges(
    xshape: Sequence[int], chunk: int, rows: int | None = None
) -> list[tuple[int, int]]:
    """Consecutive ranges `(start, end)` of rows of blocks, about `chunk` blocks each (at least
    one row), over `rows` rows (default: every row of `xshape`'s blocks)."""
    per_row = xshape[-3] if len(xshape) > 2 else 1
    if rows is None:
        rows = math.prod(_block_view(xshape)[:-1]) // per_row
    step = max(1, chunk // per_row)
    return [(row, min(row + step, rows)) for row in range(0, rows, step)]


def _block_view(xshape: Sequence[int]) -> list[int]:
    """The encoded shape with each block flattened to its last dim (what top-k and the
    scatter-mean run along): `[..., I, K, n1, n2]` -> `[..., I, K, n1 * n2]`; 1-D unchanged."""
    xshape = list(xshape)
    return [*xshape[:-2], xshape[-2] * xshape[-1]] if len(xshape) > 2 else xshape


def _same_shape_groups(
    variables: Sequence[tuple[str, torch.Tensor]], transform: TransformDCT
) -> list[list[int]]:
    """Indices of `variables` grouped by (shape, dtype, device), in order of first appearance,
    at most `MAX_STACK_NUMEL` elements a group (at least one parameter).

    Single-block parameters (for which libtorch's einsum swaps its operands, see
    `decode_reads_transposed`) stay alone."""
    groups: dict[tuple[object, ...], list[list[int]]] = {}
    for index, (_, p) in enumerate(variables):
        xshape, _totalk = transform.encoded_shape(p.shape)
        alone = len(xshape) > 2 and math.prod(xshape[:-2]) == 1
        key: tuple[object, ...] = (index,) if alone else (tuple(p.shape), p.dtype, p.device)
        stacks = groups.setdefault(key, [[]])
        if stacks[-1] and (len(stacks[-1]) + 1) * p.numel() > MAX_STACK_NUMEL:
            stacks.append([])
        stacks[-1].append(index)
    return [stack for stacks in groups.values() for stack in stacks]


def quantize_results(results: Sequence[DistroResult]) -> list[DistroResult]:
    """The 1-bit copy of a result list that is transmitted when `quantize_1bit` is set."""
    return [
        DistroResult(
            sparse_idx=r.sparse_idx.clone(),
            sparse_val=quantize_nozeros_tensor_to_boolean_sign(r.sparse_val),
            xshape=list(r.xshape),
            totalk=r.totalk,
            stats=r.stats,
        )
        for r in results
    ]
