"""The language-model loss without the whole logits tensor: a fused linear + cross-entropy.

Upstream trains its large models with Liger's fused linear cross-entropy (Triton; the logits of
a chunk of tokens are made, used and dropped inside one kernel) and a compiled loss. Here
`CausalLM.forward` takes the fused path when `ModelOptions.fused_loss` asks for it and the
device can run it (`resolve`):

* `"off"` (the default): the model's own loss, as today;
* `"auto"`: Liger's `liger_fused_linear_cross_entropy` on CUDA when `liger_kernel` is installed,
  else this module's chunked loss on CUDA; the model's own loss on the CPU;
* `"chunked"`: this module's loss on CUDA, the model's own on the CPU;
* `"liger"`: Liger's on CUDA (an error naming the package when it is not installed), the
  model's own on the CPU.

The CPU always takes the model's own loss (the fallback): a client's payload bits on the CPU
are those of today whatever the option says. Why not the chunked loss there too: its loss is
the model's loss bit for bit (`chunked_linear_cross_entropy`), but the lm_head's weight
gradient is a sum over token chunks instead of one matmul, which rounds differently in the last
bits; on CUDA the matmuls are not bit-stable across shapes anyway, and the memory saved (the
[tokens x vocabulary] fp32 logits, 4 GiB for 8 x 4096 tokens of a 32k vocabulary) is what
matters there.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

FUSED_LOSS_CHOICES = ("off", "auto", "chunked", "liger")
IGNORE_INDEX = -100
CHUNK_ROWS = 1024
"""Tokens per chunk of the chunked loss: the fp32 logits of one chunk live at a time."""


class FusedLossError(ValueError):
    """A fused loss that cannot run here (the message names what is missing)."""


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def resolve(choice: str, device: torch.device) -> str:
    """The loss `CausalLM.forward` computes for `choice` on `device`: "model" (the model's
    own), "chunked" or "liger"."""
    if choice not in FUSED_LOSS_CHOICES:
        raise FusedLossError(
            f"fused loss {choice!r}: expected one of {', '.join(FUSED_LOSS_CHOICES)}"
        )
    if choice == "off" or device.type != "cuda":
        return "model"
    if choice == "liger" and not liger_available():
        raise FusedLossError(
            "fused loss 'liger' needs the liger-kernel package (pip install liger-kernel); "
            "'chunked' needs nothing"
        )
    if choice == "auto":
        return "liger" if liger_available() else "chunked"
    return choice


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Position t's target is token t + 1 (the last position has none), flattened: as
    transformers' `ForCausalLMLoss` shifts them."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)


def _target_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()
    picked = torch.log_softmax(logits, dim=-1).gather(1, targets.clamp(min=0).unsqueeze(1))
    return picked.squeeze(1)


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """The mean cross-entropy of `hidden @ weight.T` ([tokens, hidden] x [vocab, hidden]) against
    `targets` ([tokens], `IGNORE_INDEX` ignored), `chunk_rows` (`CHUNK_ROWS`) tokens at a time: each chunk's
    fp32 logits are made, reduced to the target's log-probability and dropped, and remade in
    the backward pass (activation checkpointing), so no [tokens x vocab] tensor is ever held.

    The loss is the model's loss bit for bit where each row's matmul and log-softmax are the
    same whatever the rows beside it (the CPU's): cross-entropy is `nll_loss(log_softmax(x))`,
    and the final reduction is the same `nll_loss` over the same values in the same order
    (one column: the target's log-probability, target 0, ignored rows ignored)."""
    from torch.utils.checkpoint import checkpoint

    chunk_rows = chunk_rows or CHUNK_ROWS
    pieces = []
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        pieces.append(
            checkpoint(_target_log_probs, hidden[rows], weight, targets[rows], use_reentrant=False)
        )
    picked = torch.cat(pieces).unsqueeze(1)
    column = torch.where(targets == IGNORE_INDEX, IGNORE_INDEX, 0)
    return F.nll_loss(picked, column, ignore_index=IGNORE_INDEX)


def liger_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Liger's fused linear cross-entropy (CUDA, Triton), mean over the targets not ignored."""
    functional: Any = importlib.import_module("liger_kernel.transformers.functional")
    out = functional.liger_fused_linear_cross_entropy(
        hidden, weight, targets, ignore_index=IGNORE_INDEX, reduction="mean"
    )
    loss: torch.Tensor = out[0] if isinstance(out, tuple) else out
    return loss


__all__ = [
    "CHUNK_ROWS",
    "FUSED_LOSS_CHOICES",
    "FusedLossError",
    "chunked_linear_cross_entropy",
    "liger_available",
    "liger_linear_cross_entropy",
    "resolve",
    "shifted_labels",
]
