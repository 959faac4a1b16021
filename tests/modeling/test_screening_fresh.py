"""A fresh member's honest result beside a momentum-laden run (issue 25: 0 honest results
refused). In an all-honest real-process run (`tests/e2e/test_training.py` on a loaded 2-core
machine) witnesses refused honest DisTrO results by the level rule alone, at `t` 0.27 to 0.42 of
the level (4.47 under 0.7 x 16.25 - 6, 9.03 under 0.7 x 21.84 - 6: the joiner's second result,
9.41 under 0.7 x 22.31 - 6); with one witness a round (`witness_nodes = 1`) one refusal left
the honest joiner's batch without consensus and a health check dropped it. A member whose
momentum is fresh (a joiner, one back after a drop) and whose batch is small agrees with a
continuing witness's update far less than the continuing members do."""

from __future__ import annotations

import copy

import pytest
import torch

from psyche.modeling.hostile import DistroFormat
from psyche.modeling.research import PeerSimulation
from psyche.modeling.screening import DISTRO_SCREENING

from .conftest import SEQ, bigram_corpus
from .screening_rounds import constant, witness_simulation

pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_joiners_first_small_batch_passes_and_its_lies_do_not() -> None:
    """Three DisTrO members (tiny-cpu's c16 k8) train five rounds on four rows each; in the
    sixth a fourth member joins with the first one's weights and a fresh momentum and trains
    one row (a round's batches split unevenly: the e2e run's were one to four rows). A
    continuing witness's levels are about 28; the joiner's honest result agrees at `t` 12.7,
    0.46 of the level: the old rule (`0.7 x level - 6` = 13.4) refused it; judged as a fresh sender
    (`fresh_sender_share`, a half: a fresh momentum agrees about half as strongly) it passes. Its
    sign flip and a random-sign copy of it in the same round (new senders too) are still refused
    (the floor; the round's consensus), and no honest result is."""
    ws = witness_simulation()
    settings, sim, sent_by_round, witness = ws.settings, ws.sim, ws.sent_by_round, ws.witness
    reader, witness_distro = ws.reader, ws.witness_distro
    rows, join_at = 4, 6
    data = bigram_corpus(29 * rows, SEQ, seed=1)  # the corpus depends on its length
    flip = DistroFormat(witness_distro, quantize_1bit=True)
    verdicts = {}
    levels: list[float] = []
    for step in range(1, join_at + 1):
        if step == join_at:
            joiner = PeerSimulation([copy.deepcopy(sim.models[0])], settings, lr=constant(3e-3))
            sim.peers.append(joiner.peers[0])
        sim.zero_grad(step)
        for i, m in enumerate(sim.models):
            start = ((step - 1) * 4 + i) * rows
            ids = data[start : start + (1 if i == 3 else rows)]
            m(ids, labels=ids, use_cache=False).loss.backward()
        sim.step(step)
        sent = sent_by_round[-1]
        screen = witness.open_round()
        screen.set_reference(reader.reference(witness_distro), sent[0])
        levels = witness._level_list(screen)
        checked = {i: screen.check(i, sent[i]) for i in range(1, len(sent))}
        if step == join_at:
            negated = [flip.negate(r, k) for k, r in enumerate(sent[3])]
            checked["flip"] = screen.check("flip", negated)
            g = torch.Generator().manual_seed(5)
            scrambled = [flip.random_signs(r, k, g) for k, r in enumerate(sent[3])]
            checked["random"] = screen.check("random", scrambled)
        for i, verdict in screen.settle(checked).items():
            verdicts[(step, i)] = verdict
        screen.close()
    hostile = ("flip", "random")
    honest = {
        key: v.problem for key, v in verdicts.items() if key[1] not in hostile and not v.passed
    }
    assert honest == {}, honest
    # a hostile joiner's lies (its honest result's signs flipped, or random) are new senders too
    assert not verdicts[(join_at, "flip")].passed
    assert not verdicts[(join_at, "random")].passed, verdicts[(join_at, "random")]
    # the old rule would have refused the joiner's honest result
    a, b = DISTRO_SCREENING.relative_agreement or (0.0, 0.0)
    t = verdicts[(join_at, 3)].measure.agreement
    assert t < a * min(levels) - b, (t, levels)
