"""The witnesses' checks (`psyche.modeling.screening`) against hostile members beside honest ones:
real training of tiny Llamas through the research simulations (every payload through postcard,
its commitment hash and the receiver's checks), every member a witness, a result applied when a
quorum of witnesses vouch for it. Each check refuses the attack it is for, from the round the
attack starts, and refuses no honest result; the bounded aggregate bounds what gets through."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Callable, Hashable, Sequence

import pytest
import torch

from psyche.core.definitions import DilocoTransmission
from psyche.modeling.diloco import Diloco, DilocoPeerSimulation, DilocoSettings
from psyche.modeling.distro import DistroResult
from psyche.modeling.hostile import Attack, DilocoFormat, HostileMember, HostileMembers
from psyche.modeling.research import DistroSettings, PeerSimulation
from psyche.modeling.screening import (
    DILOCO_SCREENING,
    DISTRO_SCREENING,
    Reference,
    ResultReader,
    RoundScreen,
    Tally,
    Verdict,
    WitnessPanel,
    WitnessScreen,
)

from .conftest import SEQ, bigram_corpus
from .screening_rounds import ROWS, constant, honest_results, model, witness_simulation

T = DilocoTransmission


pytestmark = pytest.mark.usefixtures("single_thread")


def run(
    form: str,
    members: int,
    hostile: dict[int, HostileMember],
    steps: int,
    *,
    bounded: float = 0.0,
    prepare: Callable[[WitnessPanel], None] | None = None,
) -> tuple[Tally, list[torch.nn.Module]]:
    """`steps` training steps of `members` tiny Llamas, each on its own bigram rows
    (`prepare`: called with the witnesses before the first)."""
    models = [model() for _ in range(members)]
    tamper = HostileMembers(hostile) if hostile else None
    sim: PeerSimulation | DilocoPeerSimulation
    if form == "distro":
        settings = DistroSettings(compression_chunk=16, compression_topk=4, clip_grad_norm=1.0)
        sim = PeerSimulation(
            models, settings, lr=constant(1e-2), through_wire=True, hostile=tamper,
            screening=DISTRO_SCREENING,
        )  # fmt: skip
    else:
        transmission = {"bf16": T.Bf16, "int8": T.Int8, "sparse": T.Sparse}[form]
        settings_d = DilocoSettings(
            inner_steps=2, transmission=transmission, compression_chunk=16, compression_topk=8,
            outer_lr=0.7, outer_momentum=0.5, peer_clip_multiple=bounded,
        )  # fmt: skip
        sim = DilocoPeerSimulation(
            models, settings_d, lr=constant(3e-3), through_wire=True, hostile=tamper,
            screening=DILOCO_SCREENING,
        )  # fmt: skip
    assert sim.witnesses is not None
    if prepare is not None:
        prepare(sim.witnesses)
    data = bigram_corpus(steps * members * ROWS, SEQ, seed=1)
    for step in range(1, steps + 1):
        sim.zero_grad(step)
        for i, m in enumerate(sim.models):
            start = ((step - 1) * members + i) * ROWS
            ids = data[start : start + (tamper.lazy_rows(i, ROWS) if tamper else ROWS)]
            m(ids, labels=ids, use_cache=False).loss.backward()
        sim.step(step)
    assert sim.witnesses is not None
    return sim.witnesses.tally, sim.models


FORMS = ("distro", "bf16", "int8", "sparse")


@pytest.mark.parametrize("form", FORMS)
def test_a_sign_flipping_member_is_refused_from_the_round_it_starts(form: str) -> None:
    """It plays honest for 3 rounds (its witnesses know it), then flips its update: no result
    of it is applied from that round on, and no honest result is refused."""
    tally, _ = run(form, 4, {3: HostileMember(Attack.SignFlip, start=3)}, steps=16)
    assert tally.hostile_applied == [(0, 3), (1, 3), (2, 3)]  # its honest rounds
    assert tally.honest_refused == 0, tally.refusals
    assert tally.honest_checks > 0


def test_the_checks_work_on_distros_batched_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched route (the default on CUDA) keeps the coefficients a witness reads as its
    reference, as the per-parameter route does (found on an H200: without them no result could
    be checked on a GPU client)."""
    from psyche.modeling import distro as distro_module

    monkeypatch.setattr(distro_module, "BATCHED_ROUTE", True)
    tally, _ = run("distro", 4, {3: HostileMember(Attack.SignFlip, start=3)}, steps=8)
    assert tally.hostile_applied == [(0, 3), (1, 3), (2, 3)]
    assert tally.honest_refused == 0, tally.refusals
    assert tally.honest_checks > 0


# what each attack is refused by: the format bound and the zero update by the norm check (DiLoCo;
# a 1-bit result has no norm to lie with), random signs and a fixed push by the agreement while
# the run's results agree, copies and replays by the fingerprints
ATTACKS = {
    "distro": (Attack.Zero, Attack.Copy, Attack.Replay, Attack.Targeted),
    "bf16": (Attack.RandomSigns, Attack.Scaled, Attack.Zero, Attack.Copy, Attack.Targeted),
    "int8": (Attack.Scaled, Attack.Zero, Attack.Replay),
    "sparse": (Attack.RandomSigns, Attack.Scaled, Attack.Copy, Attack.Targeted),
}


@pytest.mark.parametrize(
    ("form", "attack"), [(f, a) for f, attacks in ATTACKS.items() for a in attacks]
)
def test_each_attack_is_refused_beside_honest_members(form: str, attack: Attack) -> None:
    """Two colluding hostile members of six, lying from the start (their witnesses vouch for
    everything): from the second round on (the first a witness can compare with) none of their
    lies is applied; random signs from the fourth (they are refused relative to how strongly
    the previous round's results agreed, which grows over the first rounds of this run). No
    honest result is refused."""
    members = {4: HostileMember(attack, seed=4), 5: HostileMember(attack, seed=5, copy_from=1)}
    tally, _ = run(form, 6, members, steps=10 if form == "distro" else 12)
    assert all(m.lies for m in members.values())
    first = 3 if attack is Attack.RandomSigns else 1
    applied = [(r, i) for r, i in tally.hostile_applied if r >= first and r in members[i].lies]
    assert applied == [], applied
    assert tally.honest_refused == 0, tally.refusals


def test_a_lazy_member_passes_and_costs_little() -> None:
    """Training on a quarter of its batch is an honest update with more noise: the first-order
    checks cannot tell, and pass it (a verifier recomputing the batch could)."""
    tally, _ = run("bf16", 4, {3: HostileMember(Attack.Lazy)}, steps=8)
    assert tally.hostile_refused == 0
    assert tally.honest_refused == 0


@pytest.mark.parametrize("form", ["bf16", "int8", "sparse"])
def test_the_bounded_aggregate_bounds_one_members_share_and_leaves_honest_rounds_alone(
    form: str,
) -> None:
    diloco, sent = honest_results(form)
    bounded = Diloco(
        [(n, p.detach().clone()) for n, p in diloco.variables],
        dataclasses.replace(diloco.settings, peer_clip_multiple=2.0),
    )
    plain = Diloco([(n, p.detach().clone()) for n, p in diloco.variables], diloco.settings)
    # honest payloads are within 2x the median: the same bits as the plain mean
    for a, b in zip(bounded.mean_pseudo_gradient(sent), plain.mean_pseudo_gradient(sent)):
        assert torch.equal(a, b)
    # one payload at the format's bound: its share is scaled to 2x the median norm, whatever
    # the order the payloads come in, and the mean's norm stays within 2.5x an honest mean's
    fmt = DilocoFormat(diloco.layouts())
    poisoned = [*sent[:3], [fmt.at_bound(r, i) for i, r in enumerate(sent[3])]]
    norms = [bounded.payload_norm(p) for p in poisoned]
    scales = bounded.peer_scales(poisoned)
    median = sorted(norms)[1]
    assert scales[:3] == [1.0, 1.0, 1.0]
    assert scales[3] < 1.0
    assert norms[3] * scales[3] == pytest.approx(2.0 * median, rel=1e-3)
    means = [bounded.mean_pseudo_gradient(list(p)) for p in itertools.permutations(poisoned)]
    for other in means[1:]:
        assert all(torch.equal(a, b) for a, b in zip(means[0], other))
    total = sum(float((g * g).sum()) for g in means[0]) ** 0.5
    unbounded = sum(float((g * g).sum()) for g in plain.mean_pseudo_gradient(poisoned)) ** 0.5
    assert total < 0.01 * unbounded


def test_a_copy_is_refused_in_whichever_round_it_comes() -> None:
    """Fingerprints: an exact copy of a result this witness saw earlier in the round (its own
    first) or in the last rounds is refused; distinct honest results are not."""
    diloco, sent = honest_results("bf16")
    screen = WitnessScreen(ResultReader.of(diloco), DILOCO_SCREENING)
    first = screen.open_round()
    first.set_reference(ResultReader.of(diloco).reference(diloco), sent[0])
    assert all(first.check(i, sent[i]).passed for i in (1, 2, 3))
    copied = first.check(9, sent[2])
    assert not copied.passed
    assert "copy" in str(copied.problem)
    mine = first.check(9, sent[0])
    assert not mine.passed
    assert "copy" in str(mine.problem)
    first.close()
    later = screen.open_round()
    replayed = later.check(3, sent[3])  # no reference this round: judged against the others
    assert replayed.checked  # along the first round's accepted results
    assert not replayed.passed
    assert "copy" in str(replayed.problem)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["bf16", "int8", "sparse"])
def test_the_bounded_aggregate_takes_the_same_bits_on_cpu_and_cuda(form: str) -> None:
    """The payload norms (`deterministic_norm` of the payloads' values), the median and the
    per-payload scale are the same on every device, so is the clipped mean."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    diloco, sent = honest_results(form)
    fmt = DilocoFormat(diloco.layouts())
    poisoned = [*sent[:3], [fmt.at_bound(r, i) for i, r in enumerate(sent[3])]]
    settings = dataclasses.replace(diloco.settings, peer_clip_multiple=2.0)
    means = []
    for device in ("cpu", "cuda"):
        replica = Diloco(
            [(n, p.detach().clone().to(device)) for n, p in diloco.variables], settings
        )
        means.append([m.cpu() for m in replica.mean_pseudo_gradient(poisoned)])
    assert all(torch.equal(a, b) for a, b in zip(*means))


@pytest.mark.parametrize(("chunk", "one_bit"), [(16, True), (16, False), (32, True)])
def test_a_distro_result_reads_the_same_whole_as_part_by_part(chunk: int, one_bit: bool) -> None:
    """The whole-result reading of a DisTrO result (kept block starts, one index conversion)
    gives the positions and values the per-parameter reading gives; chunk 32 mixes 1-byte
    (1-D, 32 coefficients a block) and 2-byte (2-D, 1,024) indices."""
    from psyche.modeling.distro import Distro

    m = model()
    ids = bigram_corpus(ROWS, SEQ, seed=3)
    m(ids, labels=ids, use_cache=False).loss.backward()
    distro = Distro(m, 0.999, chunk, 4)
    results = distro.generate([], 0.0, 1e-3)
    if one_bit:
        results = [dataclasses.replace(r, sparse_val=r.sparse_val < 0) for r in results]
    reader = ResultReader(distro=distro)
    whole = reader.flat(results)
    parts = [reader._entry(r, i) for i, r in enumerate(results)]
    for _ in range(2):  # the second read takes the kept block starts
        assert whole.positions is not None
        expected = torch.cat([p + o for (p, _), o in zip(parts, reader.offsets) if p is not None])
        assert torch.equal(whole.positions, expected)
        assert torch.equal(whole.values, torch.cat([v for _, v in parts]))
        for (p, v), (q, w) in zip(whole.parts, parts, strict=True):
            assert p is not None
            assert q is not None
            assert torch.equal(p, q)
            assert torch.equal(v, w)
        whole = reader.flat(results)
    assert any(r.totalk > 256 for r in results) == (chunk == 32)


def test_the_applied_coefficients_are_read_at_a_results_positions_whatever_their_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DisTrO witness's aggregate is the coefficients its optimizer last applied, as
    `decompress` stored them (a 2-D parameter's blocks column-major): gathered at a result's
    positions they are the values at those logical positions, and two witnesses given the same
    applied round measure every result to the same bits."""
    from psyche.modeling import compression
    from psyche.modeling.distro import Distro

    # the tiny model's tensors take the column-major layout a 20M model's do
    monkeypatch.setattr(compression, "FAST_ROUTE_MIN_NUMEL", 0)
    m = model()
    distro = Distro(m, 0.999, 16, 4)
    distro.keep_encoded = True
    reader = ResultReader(distro=distro)
    sent = []
    for seed in (3, 4, 5):
        ids = bigram_corpus(ROWS, SEQ, seed=seed)
        m(ids, labels=ids, use_cache=False).loss.backward()
        sent.append(distro.generate([], 0.0, 1e-3))
    distro.apply(sent[:2], 1e-3)
    assert distro.applied is not None
    assert any(not a.is_contiguous() for a in distro.applied)  # some stored column-major
    reference = reader.reference(distro)
    assert reference.applied is not None
    logical = [a.reshape(-1) for a in reference.applied]  # a copy in logical order
    verdicts = []
    for _ in range(2):
        screen = WitnessScreen(copy.deepcopy(reader), DISTRO_SCREENING)
        rnd = screen.open_round()
        rnd.set_reference(reference, sent[0])
        applied = screen._applied
        assert applied is not None
        flat = reader.flat(sent[2])
        # whole-result storage positions, and part by part (a result read without them)
        for read in (flat, dataclasses.replace(flat, local=None)):
            got_parts = applied.at(read)
            for got, want, (positions, _) in zip(got_parts, logical, flat.parts, strict=True):
                assert positions is not None
                assert torch.equal(got, want[positions.long()])
        verdicts.append(rnd.check(1, sent[2]).measure.agreement.hex())
    assert verdicts[0] == verdicts[1]


def test_a_member_back_at_a_new_epoch_passes_after_a_round_that_agreed_strongly() -> None:
    """Three DisTrO members train 12 rounds; then a new epoch: two go on with their momenta,
    which still hold what they sent last (as a client that crossed the epoch boundary without
    taking its last result out left them), and the third is back with the first one's weights
    and a fresh momentum (dropped by a health check, it reloaded the model from its peers). The
    continuing members' first results agree with a continuing witness's direction about twice
    as strongly as before, and the returning member's first result came too late for that
    witness. Its honest next result agrees about half as strongly as the round before: judged
    against that one round's median (0.7 x 35 - 6 = 18.6, its t 11.9) it was refused (the
    in-process rejoin test's `payload_refused`, then no consensus for its batch and a health
    check on an honest client); against the lower median of the last two rounds, every honest
    result passes."""
    ws = witness_simulation()
    settings, sim, sent_by_round, witness = ws.settings, ws.sim, ws.sent_by_round, ws.witness
    reader, witness_distro = ws.reader, ws.witness_distro
    back_at, rounds = 12, 15
    data = bigram_corpus(rounds * 3, SEQ, seed=1)
    verdicts = []
    for step in range(1, rounds + 1):
        if step == back_at:
            for continuing in sim.peers[:2]:
                continuing.prev_results = None
            fresh = PeerSimulation([copy.deepcopy(sim.models[0])], settings, lr=constant(3e-3))
            sim.peers[2] = fresh.peers[0]
        sim.zero_grad(step)
        for i, m in enumerate(sim.models):
            ids = data[(step - 1) * 3 + i : (step - 1) * 3 + i + 1]
            m(ids, labels=ids, use_cache=False).loss.backward()
        sim.step(step)
        sent = sent_by_round[-1]
        screen = witness.open_round()
        screen.set_reference(reader.reference(witness_distro), sent[0])
        late = {2} if step == back_at else set()
        verdicts += [(step, i, screen.check(i, sent[i])) for i in (1, 2) if i not in late]
        screen.close()
    refused = [(step, i, v.problem) for step, i, v in verdicts if not v.passed]
    assert refused == [], refused
    # the round the members came back in did agree about twice as strongly as the one before
    t = {(step, i): v.measure.agreement for step, i, v in verdicts}
    assert t[(back_at, 1)] > 1.5 * t[(back_at - 1, 1)]
    assert t[(back_at + 1, 2)] < 0.7 * t[(back_at, 1)] - 6.0


Pairs = list[tuple[Verdict, Verdict]]


def _settle_both(
    rounds: tuple[RoundScreen, RoundScreen],
    checked: tuple[dict[Hashable, Verdict], dict[Hashable, Verdict]],
    pairs: Pairs,
    threads: int = 1,
) -> dict[Hashable, Verdict]:
    """Two twin rounds' votes (`RoundScreen.settle`; the second at `threads` torch threads):
    each held check's two judgements join `pairs`; the first's answer."""
    a = rounds[0].settle(checked[0])
    torch.set_num_threads(threads)
    try:
        b = rounds[1].settle(checked[1])
    finally:
        torch.set_num_threads(1)
    pairs.extend((a[k], b[k]) for k, v in checked[0].items() if v.index is not None)
    return a


class _TwinRound:
    """One round checked by two witnesses with the same memory, one gathering the direction at
    each result's positions, one reading it from the combined direction; each verdict of the
    two is kept, the gathered one's answers."""

    def __init__(self, gathered: RoundScreen, combined: RoundScreen, pairs: Pairs) -> None:
        self.rounds = (gathered, combined)
        self.pairs = pairs
        self.combined: dict[Hashable, Verdict] = {}

    def set_reference(self, reference: Reference, own_sent: Sequence[DistroResult]) -> None:
        # a folded aggregate (with DisTrO's applied coefficients there is no combined direction)
        reference = dataclasses.replace(reference, applied=None)
        for rnd in self.rounds:
            rnd.set_reference(reference, own_sent)

    def check(self, sender: Hashable, results: Sequence[DistroResult]) -> Verdict:
        a, b = (rnd.check(sender, results) for rnd in self.rounds)
        self.pairs.append((a, b))
        self.combined[sender] = b
        return a

    def settle(self, verdicts: dict[Hashable, Verdict]) -> dict[Hashable, Verdict]:
        return _settle_both(self.rounds, (verdicts, self.combined), self.pairs)

    def close(self) -> None:
        for rnd in self.rounds:
            rnd.close()


class _Twin:
    def __init__(self, panel: WitnessPanel, pairs: Pairs) -> None:
        never = dataclasses.replace(panel.settings, precombine_from=10**9)
        always = dataclasses.replace(panel.settings, precombine_from=0)
        self.screens = (WitnessScreen(panel.reader, never), WitnessScreen(panel.reader, always))
        self.pairs = pairs

    def open_round(self) -> _TwinRound:
        gathered, combined = self.screens
        return _TwinRound(gathered.open_round(), combined.open_round(), self.pairs)


@pytest.mark.parametrize("form", FORMS)
def test_the_combined_direction_gives_the_gathered_directions_verdicts(form: str) -> None:
    """The direction combined once a round over the whole domain (`precombine_from`) gives
    every check the same `t`, bit for bit, as gathering the own update and the aggregate at
    the result's positions, and so the same verdict: every witness of a run with a
    sign-flipping, a random and a copying member checks each result both ways, over every
    round (the aggregate growing and decaying, results refused and passed)."""
    pairs: Pairs = []

    def twins(panel: WitnessPanel) -> None:
        twin = {w: _Twin(panel, pairs) for w in panel.screens}
        vars(panel)["screens"] = twin  # stand-ins with the methods the panel calls

    hostile = {
        3: HostileMember(Attack.SignFlip, start=2),
        4: HostileMember(Attack.RandomSigns, seed=4),
        5: HostileMember(Attack.Copy, seed=5, copy_from=1),
    }
    run(form, 6, hostile, steps=8 if form == "distro" else 12, prepare=twins)
    assert len(pairs) >= 90
    for gathered, combined in pairs:
        assert gathered.measure.agreement == combined.measure.agreement
        assert gathered.measure.norm == combined.measure.norm
        assert torch.equal(gathered.measure.fingerprint.sketch, combined.measure.fingerprint.sketch)
        assert gathered.problem == combined.problem
    problems = [str(g.problem) for g, _ in pairs]
    assert any("agreement" in p for p in problems)
    assert any("copy" in p for p in problems)
    assert len(pairs) / 3 < sum(g.passed for g, _ in pairs) < len(pairs)


def test_a_round_checked_while_the_one_before_is_still_open_has_that_rounds_level() -> None:
    """A client closes a witness's round N - 1 only when round N + 1 starts, so its second
    round's results are checked while its first is open: with no closed round yet, the open
    one's level judges them. A result independent of the direction (random signs: `t` about
    N(0, 1), above the floor) passed a witness's second round on `min_agreement` alone before
    (as a weakly opposed sign-flipped one did in the client's poisoned-results test)."""
    diloco, sent = honest_results("bf16")
    reader = ResultReader.of(diloco)
    fmt = DilocoFormat(diloco.layouts())
    g = torch.Generator().manual_seed(3)
    noise = [fmt.random_signs(r, i, g) for i, r in enumerate(sent[1])]
    screen = WitnessScreen(reader, DILOCO_SCREENING)
    first = screen.open_round()
    first.set_reference(reader.reference(diloco), sent[0])
    assert all(first.check(i, sent[i]).passed for i in (1, 2, 3))
    second = screen.open_round()  # the first is still open
    second.set_reference(reader.reference(diloco), sent[0])
    verdict = second.check(1, noise)
    assert verdict.checked
    assert verdict.measure.agreement > DILOCO_SCREENING.min_agreement
    assert not verdict.passed
    assert "lowest median" in str(verdict.problem)
    assert second.check(2, sent[2]).passed
    # the same once the first round is closed; a witness with no earlier round has the floor
    first.close()
    assert "lowest median" in str(second.check(4, noise).problem)
    alone = WitnessScreen(reader, DILOCO_SCREENING).open_round()
    alone.set_reference(reader.reference(diloco), sent[0])
    assert alone.check(1, noise).passed


@pytest.mark.parametrize("first", [True, False])
def test_a_witness_judges_its_first_round_as_a_whole(first: bool) -> None:
    """A witness with an update of its own but no level yet (its first round) judged each
    result by `min_agreement` alone: a hostile result independent of its update (random signs,
    `t` about N(0, 1)) or weakly opposed to it (a DiLoCo sign flip at `t` -3.9 in
    `scripts/bench/honest_checks.py`) passed it, with the hostile member's own vote a quorum of
    four, and it folded the lie into its aggregate. Its votes now follow the round judged as a
    whole (`RoundScreen.settle`, as the client's `settle_blind_votes`): leave-one-out levels of
    the round's other results, whatever order they came in; the round folds only what passed."""
    diloco, sent = honest_results("bf16")
    reader = ResultReader.of(diloco)
    fmt = DilocoFormat(diloco.layouts())
    g = torch.Generator().manual_seed(3)
    noise = [fmt.random_signs(r, i, g) for i, r in enumerate(sent[1])]
    rnd = WitnessScreen(reader, DILOCO_SCREENING).open_round()
    rnd.set_reference(reader.reference(diloco), sent[0])
    order: list[Hashable] = ["hostile", 2, 3] if first else [2, 3, "hostile"]
    checked = {s: rnd.check(s, noise if s == "hostile" else sent[int(s)]) for s in order}
    assert checked["hostile"].passed  # at its check: above the floor, no level yet
    assert all(v.index is not None and not v.blind for v in checked.values())  # held
    settled = rnd.settle(checked)
    assert not settled["hostile"].passed
    assert "lowest median" in str(settled["hostile"].problem)
    assert settled[2].passed
    assert settled[3].passed
    assert len(rnd.accepted) == 3  # its own and the two honest ones
    assert checked["hostile"].measure.agreement in rnd.refused_agreements
    assert checked["hostile"].measure.agreement not in rnd.agreements


_Blind = tuple[int, Hashable, Verdict]


class _CutRound:
    """A witness's round whose own update never comes (`keep`: it does): its training cut by
    the round's timeout, as a verifier's or a fresh joiner's rounds are; every verdict kept."""

    def __init__(self, rnd: RoundScreen, number: int, verdicts: list[_Blind]) -> None:
        self.rnd, self.number, self.verdicts = rnd, number, verdicts
        self.keep = number % 2 == 0

    def set_reference(self, reference: Reference, own_sent: Sequence[DistroResult]) -> None:
        if self.keep:
            self.rnd.set_reference(reference, own_sent)

    def check(self, sender: Hashable, results: Sequence[DistroResult]) -> Verdict:
        verdict = self.rnd.check(sender, results)
        if not self.keep:
            self.verdicts.append((self.number, sender, verdict))
        return verdict

    def settle(self, verdicts: dict[Hashable, Verdict]) -> dict[Hashable, Verdict]:
        return self.rnd.settle(verdicts)

    def close(self) -> None:
        self.rnd.close()


class _CutWitness:
    """A witness with an update of its own only in every other round (round 0 included); the
    verdicts of the others kept with their round."""

    def __init__(self, screen: WitnessScreen) -> None:
        self.screen = screen
        self.rounds = itertools.count()
        self.verdicts: list[_Blind] = []

    def open_round(self) -> _CutRound:
        return _CutRound(self.screen.open_round(), next(self.rounds), self.verdicts)


@pytest.mark.parametrize(
    ("form", "attack"),
    [("distro", Attack.SignFlip), ("bf16", Attack.SignFlip), ("int8", Attack.Scaled)],
)
def test_a_witness_without_an_update_of_its_own_still_refuses_a_hostile_result(
    form: str, attack: Attack
) -> None:
    """A witness that trained nothing in a round used to vouch for every result that was not a
    copy: one such witness's vote and the hostile member's own make a quorum of a four-member
    run. Now it judges each result against the others: the agreement along the results it
    accepted in earlier rounds against the median of the round's other results (leave-one-out),
    the norm against their median norm. Every honest witness of the run here has no update of
    its own in every other round: from the round the attack starts, none of the hostile
    member's results passes such a round, no honest one is refused, and none is applied."""
    cut: dict[int, _CutWitness] = {}

    def cut_witnesses(panel: WitnessPanel) -> None:
        cut.update({w: _CutWitness(screen) for w, screen in panel.screens.items()})
        vars(panel)["screens"] = cut  # stand-ins with the methods the panel calls

    tally, _ = run(form, 4, {3: HostileMember(attack, start=3)}, steps=16, prepare=cut_witnesses)
    blind = [verdict for w in cut.values() for verdict in w.verdicts]
    assert len(blind) >= 3 * 3 * 3
    assert all(v.checked for _, _, v in blind)  # each had an earlier round's accepted results
    lies = [v for rnd, sender, v in blind if sender == 3 and rnd >= 3]
    assert len(lies) >= 3 * 2
    assert not any(v.passed for v in lies), [v.measure for v in lies if v.passed]
    honest = [v for _, sender, v in blind if sender != 3]
    assert all(v.passed for v in honest), [v.problem for v in honest if not v.passed]
    assert tally.honest_refused == 0, tally.refusals
    assert all(r < 3 for r, _ in tally.hostile_applied), tally.hostile_applied


def test_a_new_witness_without_an_update_judges_the_norm_against_the_others() -> None:
    """A witness that has neither an update of its own nor an accepted result of an earlier
    round (a member that has just joined) cannot measure agreement, but a result scaled to
    the format's bound stands out against the median norm of the round's other results."""
    diloco, sent = honest_results("int8")
    reader = ResultReader.of(diloco)
    fmt = DilocoFormat(diloco.layouts())
    scaled = [fmt.at_bound(r, i) for i, r in enumerate(sent[3])]
    fresh = WitnessScreen(reader, DILOCO_SCREENING).open_round()
    first = fresh.check(0, sent[0])
    assert first.passed
    assert not first.checked
    assert all(fresh.check(i, sent[i]).passed for i in (1, 2))
    verdict = fresh.check(3, scaled)
    assert not verdict.passed
    assert "norm" in str(verdict.problem)


def test_a_hostile_first_result_does_not_set_a_blind_witness_norm_baseline() -> None:
    """Arrival order is a trainer's to choose (it can publish at the round's start without
    training). A result at the format's bound checked first by a witness with neither an update
    of its own nor a closed round used to become the norm basis: every honest result after it
    was refused. Now the in-round norm test waits for three others, whose median is honest;
    what the blind witness refuses never accuses (`Verdict.blind`). A result at the bound
    second or third at such a witness in its first round passes it too (with a closed round
    its norms judge them): a witness with an update of its own refuses it."""
    diloco, sent = honest_results("int8", members=5)
    reader = ResultReader.of(diloco)
    fmt = DilocoFormat(diloco.layouts())
    scaled = [fmt.at_bound(r, i) for i, r in enumerate(sent[4])]
    fresh = WitnessScreen(reader, DILOCO_SCREENING).open_round()
    first = fresh.check("hostile", scaled)
    honest = [fresh.check(i, sent[i]) for i in range(4)]
    assert all(v.passed for v in honest), [v.problem for v in honest]
    assert all(v.blind for v in [first, *honest])
    # the blind witness cannot judge what comes first (it never could); member 0's witness,
    # with its own update, refuses it
    trained = WitnessScreen(reader, DILOCO_SCREENING).open_round()
    trained.set_reference(reader.reference(diloco), sent[0])
    verdict = trained.check("hostile", scaled)
    assert not verdict.passed
    assert "norm" in str(verdict.problem)
    assert not verdict.blind


def test_a_hostile_first_result_along_the_aggregate_does_not_set_a_blind_witness_level() -> None:
    """A result whose values follow the public recent aggregate (`t` in the hundreds, the
    honest ones' far lower) checked first by a witness with no update of its own used to set
    the relative level (half the median `t` so far) above every honest result after it, each
    of which was refused (and, from a witness that was not young, accused: the health checks
    dropped the honest members while the hostile result got the vote). Now the level waits for
    three other results, whose median is honest while the hostile members are a minority."""
    diloco, before = honest_results("bf16", seed=2)
    _, sent = honest_results("bf16", seed=3)
    reader = ResultReader.of(diloco)
    fmt = DilocoFormat(diloco.layouts())
    witness = WitnessScreen(reader, DILOCO_SCREENING)
    closed = witness.open_round()  # its last round: no update of its own either
    assert all(closed.check(i, r).passed for i, r in enumerate(before))
    closed.close()
    # the aggregate's direction (every result accepted in that round), at an honest norm
    aggregate = sum(reader.flat(r).values for r in before)
    norm = reader.describe(reader.flat(sent[0]), DILOCO_SCREENING.sketch_size)[0]
    aligned_flat = aggregate * (norm / float(torch.linalg.vector_norm(aggregate)))
    sizes = [math.prod(fmt.shape(i)) for i in range(len(sent[0]))]
    aligned = [
        fmt.encode_dense(part.view(fmt.shape(i)), i)
        for i, part in enumerate(aligned_flat.split(sizes))
    ]
    rnd = witness.open_round()
    first = rnd.check("hostile", aligned)
    honest = [rnd.check(i, r) for i, r in enumerate(sent)]
    assert first.passed
    assert first.measure.agreement > 2 * max(v.measure.agreement for v in honest)
    # the first honest one has no others but the hostile one; the second may be refused (not
    # accused: `blind`); from three others on the median is honest
    assert honest[0].passed, honest[0].problem
    assert all(v.passed for v in honest[2:]), [v.problem for v in honest]
    assert all(v.blind and v.checked for v in [first, *honest])
    # the blind `t`s (along the aggregate alone, here up to the hundreds) stay out of the
    # window the own-update rounds' z-test reads: a hostile sender's blind round must not
    # bank credit against its opposed results there
    assert not witness._agreements
    assert list(witness._blind_agreements["hostile"]) == [first.measure.agreement]


class _ThreadedRound:
    """One round checked by two independent witnesses with the same memory: the second with
    its own reader, its own copies of every input and two torch threads instead of one."""

    def __init__(self, first: RoundScreen, second: RoundScreen, pairs: Pairs) -> None:
        self.first, self.second, self.pairs = first, second, pairs
        self.seconds: dict[Hashable, Verdict] = {}

    def _second(self, call: Callable[[], Verdict | None]) -> Verdict | None:
        torch.set_num_threads(2)
        try:
            return call()
        finally:
            torch.set_num_threads(1)

    def set_reference(self, reference: Reference, own_sent: Sequence[DistroResult]) -> None:
        self.first.set_reference(reference, own_sent)
        mine = (copy.deepcopy(reference), copy.deepcopy(list(own_sent)))
        self._second(lambda: self.second.set_reference(*mine))

    def check(self, sender: Hashable, results: Sequence[DistroResult]) -> Verdict:
        a = self.first.check(sender, results)
        mine = copy.deepcopy(list(results))
        b = self._second(lambda: self.second.check(sender, mine))
        assert b is not None
        self.pairs.append((a, b))
        self.seconds[sender] = b
        return a

    def settle(self, verdicts: dict[Hashable, Verdict]) -> dict[Hashable, Verdict]:
        rounds = (self.first, self.second)
        return _settle_both(rounds, (verdicts, self.seconds), self.pairs, threads=2)

    def close(self) -> None:
        self.first.close()
        self.second.close()


class _ThreadedTwin:
    def __init__(self, panel: WitnessPanel, pairs: Pairs) -> None:
        self.screens = (
            WitnessScreen(panel.reader, panel.settings),
            WitnessScreen(copy.deepcopy(panel.reader), panel.settings),
        )
        self.pairs = pairs

    def open_round(self) -> _ThreadedRound:
        return _ThreadedRound(
            self.screens[0].open_round(), self.screens[1].open_round(), self.pairs
        )


@pytest.mark.parametrize("form", ["distro", "sparse"])
def test_two_independent_witnesses_reach_the_same_verdicts_bit_for_bit(form: str) -> None:
    """Every honest witness with the same inputs must reach the same verdict, whatever its
    thread count: two instances (their own readers and copies of every input, one with one
    torch thread, one with two) check every result of a run with a sign-flipping and a copying
    member: every `t`, norm and fingerprint equal to the bit. torch splits a reduction of
    32,768 values or more between threads, and the split changes the low bits: the whole-result
    sums gave other `t`s at 1 and 2 threads."""
    pairs: Pairs = []

    def twins(panel: WitnessPanel) -> None:
        vars(panel)["screens"] = {w: _ThreadedTwin(panel, pairs) for w in panel.screens}

    hostile = {3: HostileMember(Attack.SignFlip, start=2), 4: HostileMember(Attack.Copy, seed=4)}
    run(form, 5, hostile, steps=6, prepare=twins)
    assert len(pairs) >= 30
    for a, b in pairs:
        assert a.measure.agreement.hex() == b.measure.agreement.hex()
        assert a.measure.norm.hex() == b.measure.norm.hex()
        assert torch.equal(a.measure.fingerprint.sketch, b.measure.fingerprint.sketch)
        assert a.problem == b.problem
    assert any(not a.passed for a, _ in pairs)
