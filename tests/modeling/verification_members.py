"""The members of the verification tests (test_verification.py, test_verification_shadow.py):
`MEMBERS` tiny trainers fed their own rows of a bigram corpus (`corpus_batches`), a trainer's
whole state to check a verification left alone (`state`, compared bit for bit by `same_bits`),
and a verifier with a history (`trained_one_step`)."""

from __future__ import annotations

from typing import Any

import torch

from psyche.modeling.trainer import Batch, Trainer
from psyche.modeling.verification_sim import tiny_trainer

from .conftest import bigram_corpus

MEMBERS = 4
ROWS = 4  # per member per round: two micro-batches of two rows


def corpus_batches(rounds: int, seed: int = 5):  # type: ignore[no-untyped-def]
    """`batch(step, i)`: member `i`'s rows of `step`; `i == MEMBERS`: rows no one is assigned."""
    data = bigram_corpus((rounds + 1) * (MEMBERS + 1) * ROWS, seed=seed)

    def batch(step: int, i: int) -> Batch:
        start = ((step - 1) * (MEMBERS + 1) + i) * ROWS
        return Batch(data[start : start + ROWS])

    return batch


def state(trainer: Trainer) -> list[torch.Tensor]:
    """Everything a verification must leave alone: weights, gradients, optimizer state."""
    out = [p.detach().clone() for _, p in trainer.model.variables()]
    out += [p.grad.clone() for _, p in trainer.model.variables() if p.grad is not None]
    if trainer.distro is not None:
        out += [d.clone() for d in trainer.distro.deltas]
    if trainer.adamw is not None:
        out += [
            t.clone() for t in trainer.adamw.exp_avg + trainer.adamw.exp_avg_sq if t is not None
        ]
    if trainer.diloco is not None and trainer.diloco.residuals is not None:
        out += [r.clone() for r in trainer.diloco.residuals]
    return out


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(a, b)
    )


def trained_one_step(form: str, batch: Any) -> tuple[Any, Any]:
    """A trainer of `form` that trained and applied its own first step (a verifier with a
    history: optimizer state, a pending own update), and that step's output."""
    trainer = tiny_trainer(form)
    out = trainer.train_exact(
        1, batch(1, 0), warmup_lr_between=None, zero_optim=False, prev_self_distro_results=[]
    )
    trainer.optimize(1, distro_results=[out.distro_results or []])
    return trainer, out
