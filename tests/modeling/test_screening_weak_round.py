"""An honest DisTrO result that agrees weakly for one round (issue 25: 0 honest results refused).

In the all-honest real-process run (`tests/e2e/test_training.py`: three members, tiny-cpu's
model and data, batches of 3, 3 and 2 rows, one witness a round) witnesses refused continuing
members' honest results by the relative test alone (`t` 8.46 under 0.7 x 22.99 - 6, -3.08 under
0.7 x 16.08 - 6), each refused by every other member alike: with one witness a round the batch
lost its consensus and a health check dropped its honest trainer. The same three members in one
process (this test's run) refused 32 of 2,880 honest checks under that rule: about one result
in a hundred, from the sender's batch of either size, agrees with every witness at a fraction
of the level for one round (the sender's momentum moved against the round just applied), and
its next result agrees as before. The relative test now refuses only a sender whose last three
results here are all below the bar (`ScreeningSettings.relative_results`)."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from psyche.core.batch_id import BatchId
from psyche.core.data_shuffle import Shuffle
from psyche.core.definitions import CosineLR, LearningRateSchedule, OptimizerDefinition
from psyche.core.token_size import TokenSize
from psyche.modeling.hostile import Attack, HostileMember, make_hostile
from psyche.modeling.research import DistroSettings
from psyche.modeling.screening import DISTRO_SCREENING, Verdict, WitnessScreen
from psyche.modeling.serialized_distro import decode_transmittable
from psyche.modeling.trainer import Batch, Trainer

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu"
MEMBERS = 3
BATCH = 8  # the e2e run's global batch: 3, 3 and 2 rows
LAST = 27
OLD = dataclasses.replace(DISTRO_SCREENING, relative_results=1)
"""The relative test on each result alone (the rule before)."""


def _trainer() -> Trainer:
    """A tiny-cpu member as the client builds it (its model config, cosine LR, DisTrO c16 k8
    1-bit, clip 1), every member from the same random init."""
    from psyche.modeling.causal_lm import CausalLM, ModelOptions

    config = json.loads((TINY / "model" / "config.json").read_text())
    model = CausalLM.from_config(config, ModelOptions(architecture="HfLlama", seed=1000))
    schedule = LearningRateSchedule.Cosine(
        CosineLR(base_lr=3e-3, warmup_init_lr=0.0, final_lr=3e-4, warmup_steps=10, total_steps=200)
    )
    settings = DistroSettings(compression_chunk=16, compression_topk=8, clip_grad_norm=1.0)
    return Trainer(model, schedule, OptimizerDefinition.Distro(settings.definition()), 1)


def test_a_weak_honest_round_passes_and_random_signs_do_not(tmp_path: Path) -> None:
    """Three tiny-cpu members train 27 rounds on the tiny-cpu dataset, each round's 8 rows split
    3/3/2 in a shuffled order, results applied two rounds later as the client does. Every member
    screens the others' results twice: with the shipped settings (its votes) and with the old
    relative test (`relative_results` 1). At round 22 member 2's honest result (3 rows) agrees
    at `t` 4.07 and 5.98 where the witnesses' levels were 23.4 and 22.5, refused by both under
    the old rule; its next result agrees at 20.8 and 22.1. The shipped rule refuses no honest
    result. From round 25 member 2 sends random signs (`t` about 0): the old rule refused every
    lie, the shipped one the third (its results before agreed: two rounds' delay), and the
    first two set no level (`RoundScreen.lenient`: with them, the level of a three-member
    round fell to where the third lie passed)."""
    from psyche.centralized.tiny_run import write_tiny_dataset
    from psyche.data_provider.local import LocalDataProvider

    write_tiny_dataset(tmp_path, tokenizer_path=TINY / "model" / "tokenizer.json")
    rng = random.Random(0)
    shuffle = Shuffle.Seeded(bytes(rng.randrange(256) for _ in range(32)))
    data = LocalDataProvider.new_from_directory(tmp_path, TokenSize.TwoBytes, 128, shuffle)
    trainers = [_trainer() for _ in range(MEMBERS)]
    lies_from = 25
    make_hostile(trainers[2], HostileMember(Attack.RandomSigns, seed=2, start=lies_from - 1))
    screens = {
        kind: [WitnessScreen(t.screening_reader(), settings) for t in trainers]  # type: ignore[arg-type]
        for kind, settings in (("shipped", DISTRO_SCREENING), ("old", OLD))
    }
    prev: list[list] = [[] for _ in trainers]  # type: ignore[type-arg]
    applied: dict[int, list] = {}  # type: ignore[type-arg]
    open_rounds: dict[tuple[str, int], list] = {}  # type: ignore[type-arg]
    verdicts: dict[tuple[str, int, int, int], Verdict] = {}  # (kind, step, witness, sender)
    for step in range(1, LAST + 1):
        due = applied.pop(step - 2, None)
        if due is not None:
            for t in trainers:
                t.optimize(step, distro_results=due)
        order = list(range(MEMBERS))
        rng.shuffle(order)
        first = (step - 1) * BATCH
        rows: dict[int, tuple[int, int]] = {}
        for place, member in enumerate(order):
            size = 3 if place < 2 else 2
            rows[member] = (first, first + size - 1)
            first += size
        prepared, references = [], []
        for i, t in enumerate(trainers):
            batch = Batch.from_rows(data.read_batch(BatchId(*rows[i])))
            out = t.train_exact(
                step, batch, warmup_lr_between=None, zero_optim=False,
                prev_self_distro_results=prev[i],
            )  # fmt: skip
            t.decay_weights(step, warmup_lr_between=None)
            prepared.append(t.prepare_result(out, step=step, batch_id=BatchId(*rows[i])))
            references.append(t.screening_reference())
            prev[i] = [out.distro_results]
        received = [
            trainers[0].results_from_payload(decode_transmittable(p.payload.to_bytes()))
            for p in prepared
        ]
        votes = [1] * MEMBERS
        for kind, witnesses in screens.items():
            for w, screen in enumerate(witnesses):
                kept = open_rounds.setdefault((kind, w), [])
                if len(kept) == 2:  # a client closes round N - 1 when round N + 1 starts
                    kept.pop(0).close()
                rnd = screen.open_round()
                kept.append(rnd)
                rnd.set_reference(references[w], prepared[w].sent)
                checked = {i: rnd.check(i, received[i]) for i in range(MEMBERS) if i != w}
                for i, verdict in rnd.settle(checked).items():
                    verdicts[kind, step, w, i] = verdict
                    votes[i] += kind == "shipped" and verdict.passed
        applied[step] = [received[i] for i in range(MEMBERS) if votes[i] >= 2]

    def refused(kind: str, honest: bool) -> list[tuple[int, int, int]]:
        return [
            (step, w, i)
            for (k, step, w, i), v in verdicts.items()
            if k == kind and not v.passed and (i != 2 or step < lies_from) == honest
        ]

    assert refused("shipped", honest=True) == []
    assert (22, 0, 2) in refused("old", honest=True)
    assert (22, 1, 2) in refused("old", honest=True)
    lies = [(step, w) for step in range(lies_from, LAST + 1) for w in (0, 1)]
    assert sorted((step, w) for step, w, _ in refused("old", honest=False)) == lies
    assert sorted((step, w) for step, w, _ in refused("shipped", honest=False)) == lies[4:]
