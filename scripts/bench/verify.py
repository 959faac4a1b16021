"""Verifiers: a verifier's recompute-and-compare (`psyche.modeling.verification`) against honest
members and each attack of `psyche.modeling.hostile`, in one sitting.

For each optimizer (DisTrO 1-bit c16 k4; DiLoCo bf16, int8 and sparse, 2 inner steps), 4
members train a tiny Llama as clients do (`train_exact`, `prepare_result`, the payload decoded
as every client decodes it) on a synthetic bigram corpus, 4 rows each a round, and one
verifier holding the run's weights verifies every member's result every round
(`psyche.modeling.verification_sim`: each batch recomputed once, the next member's recompute
its decoy; the verifier on `--verifier-threads` intra-op threads where the members use one).

* honest: every member honest for `--honest-rounds` rounds (125 x 4 = 500 verifications in
  the full mode): how many honest results were refused (false positives), and the verifier's
  time per verification against one member's `train_exact` of its batch (the ratio, measured
  in this run);
* each attack: member 3 lies from round 1 for `--attack-rounds` rounds: the share of its lying
  rounds refused (a round alone), the share refused with the verifier's `Evidence` over rounds,
  whether it was caught within 3 rounds, and the honest members' refusals beside it.

* `--switch-roles`: 2 of the 4 members sit each round out (a round's verifier and tie-breaker
  at 4 clients; drawn from the seed), in the honest and the attack runs, as clients do: a
  member's first round back subtracts the own results of the last round it trained;
* every run prints the honest results' agreement and DisTrO's parts (least, median, greatest)
  and each attack's parts, to set the thresholds against;
* `--halves` (DisTrO; research for a cheaper check, nothing ships it): the agreement of each
  result along one half of its batch's recompute less the same half of the decoy's, for honest
  members and each attack's lies, per half (`Lazy` trains the first half): what a verifier that
  recomputed one half of each of its two batches (one trainer's rows, not two) would read;
* `--cost`: a round's work per client at `verification_percent` 10 against 0 (the same
  sitting): one member's `train_exact` time per row and the verifier's recompute-and-compare
  time per row, measured, then each client's work a round for runs of 21 and 101 clients with
  8 rows per client (the committees and checked batches as `psyche.coordinator.verification`
  deals them): the trainers' (rows per trainer grow as verifiers stop training), a verifier's
  (its checked batches) and the tie-breaker's: before (`--cost` of e638355: it recomputed every
  checked batch in the round) and now (it recomputes only disputed batches, in the next round,
  from one saved copy of the weights: a round without a dispute costs it that copy, measured
  here as `save_weights` into the kept buffers; each disputed batch costs two recomputes, the
  batch and its decoy, and a verifier's two disputed batches are each other's decoy). Each
  client runs on its own machine, so a round's time is the slowest client's work, and
  verifiers and the tie-breaker only need to finish inside the round. With `verifiers_train`
  (`CoordinatorConfig.verifiers_train`) every client trains upstream's share, and a verifier's
  two checks come after its own training: the line says how much idle time (in training steps)
  the round must leave them.

* `--bias-gap`: the 1 % bias (`Attack.Bias`) against honest results, `--attack-rounds`
  rounds (6 with `--quick`): two runs of the same members, data and seed, one honest and one with
  member 3 biased; the honest and the biased `t` and cosine, the bias's own shift of member 3's
  `t` and cosine (the honest run less the biased, round by round), `Evidence`'s 3-round
  statistic, and whether any threshold separates the lies from every honest result
  (docs/reliability.md, "Verifiers": why the bias is not caught).

* `--shadow` also prints what wiring it in costs (`psyche.coordinator.following`: each trained
  batch rebuilt by `FOLLOWERS_PER_TRAINER` followers): the extra training a round per client,
  as a ratio of its own training step, from the shadow's measured ratio, at 4 clients and 25 % and where every client
  trains.

* `--profile`: where one verification's time goes (CPU seconds, one thread, the same sitting):
  a member's `train_exact` and `prepare_result` of a batch against the verifier's `recompute`
  (the batch's forward and backward, in two parts), `domain_of` (the parts' DCT), `compare`
  (the statistics at the payload's positions) and a tie-breaker's `save_weights`, each as a
  ratio of the member's training step; `--preset 20m --rows 4 --seq 128` for a 20M Llama.
  `--cost` and `--profile` run the verifier on one thread, as the members: on a loaded machine
  a two-thread verifier's CPU seconds count its threads' waiting (25x a member's step, seen).

    .venv/bin/python scripts/bench/verify.py            # full: 500 honest verifications each
    .venv/bin/python scripts/bench/verify.py --quick    # a smoke check (seconds to a minute)
    .venv/bin/python scripts/bench/verify.py --cost --optimizers distro
    .venv/bin/python scripts/bench/verify.py --bias-gap --attack-rounds 30
    .venv/bin/python scripts/bench/verify.py --profile --optimizers distro --preset 20m --rows 4 --seq 128

No downloads: random-init Llama configs and a synthetic corpus.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from psyche.coordinator.committee_selection import verifier_nodes_for
from psyche.coordinator.following import FOLLOWERS_PER_TRAINER
from psyche.coordinator.verification import (
    VERIFICATION_TIE_BREAKERS,
    VERIFIED_BATCHES_PER_VERIFIER,
)
from psyche.core.batch_id import BatchId
from psyche.modeling.distro import DistroResult
from psyche.modeling.hostile import Attack, HostileMember, payload_format
from psyche.modeling.screening import ResultReader, agreement
from psyche.modeling.serialized_distro import (
    TransmittableDistroResult,
    transmittable_distro_result,
)
from psyche.modeling.trainer import Batch
from psyche.modeling.verification import (
    Domain,
    Shadow,
    compare,
    compare_exact,
    domain_of,
    follow,
    recompute,
    result_reader,
    save_weights,
    verification_settings,
)
from psyche.modeling.verification_sim import FORMS, VerificationRun, tiny_trainer

sys.path.insert(0, str(Path(__file__).parent))
import diloco as bench_diloco

D = bench_diloco.D
T = TypeVar("T")
MEMBERS = 4
ROWS = 4
HOSTILE = MEMBERS - 1
NAMES = {
    "distro": "DisTrO 1-bit c16 k4",
    "bf16": "DiLoCo bf16",
    "int8": "DiLoCo int8 c64",
    "sparse": "DiLoCo sparse c16 k8 2-bit",
}
# what each attack means here (lazy: the half batch; bias: 1 % of the norm)
ATTACKS = [a for a in Attack if a is not Attack.Copy]


@dataclass
class Outcome:
    rounds: int = 0
    lies: int = 0
    refused_alone: int = 0
    refused_with_evidence: int = 0
    first_refused: int | None = None
    honest: int = 0
    honest_refused: int = 0
    refusals: list[str] = field(default_factory=list)
    honest_t: list[float] = field(default_factory=list)
    honest_parts: list[float] = field(default_factory=list)
    lie_parts: list[float] = field(default_factory=list)
    lie_t: list[float] = field(default_factory=list)
    t_by_member: dict[int, list[float]] = field(default_factory=dict)
    """Every member's agreement `t`, round by round (lying or not)."""
    cosines: dict[bool, list[float]] = field(default_factory=dict)
    """The payload's cosine with its batch's recompute, of honest results (False) and lies."""
    cos_by_member: dict[int, list[float]] = field(default_factory=dict)
    train: list[float] = field(default_factory=list)
    verify: list[float] = field(default_factory=list)


def make_run(
    form: str,
    attack: Attack | None,
    rounds: int,
    threads: int,
    seed: int,
    switch_roles: bool = False,
    shadow: bool = False,
) -> tuple[VerificationRun, dict[int, HostileMember]]:
    """The simulated run of `play` and `--halves`: 4 members (member 3 hostile from round 1 if
    `attack`), one verifier, a bigram corpus; `shadow`: the verifier follows every member from
    its first round and compares exactly (`--shadow`)."""
    vocab = D.build("tiny", "cpu").config.vocab_size
    data = D.bigram_corpus((rounds + 1) * (MEMBERS + 1) * ROWS, 32, vocab, seed=seed)

    def batch(step: int, i: int) -> Batch:
        start = ((step - 1) * (MEMBERS + 1) + i) * ROWS
        return Batch(data[start : start + ROWS])

    hostile = {}
    if attack is not None:
        hostile[HOSTILE] = HostileMember(attack, start=0, lazy_fraction=0.5, seed=seed)
    run = VerificationRun(
        [tiny_trainer(form) for _ in range(MEMBERS)],
        tiny_trainer(form),
        batch,
        hostile,
        verifier_threads=threads,
        sits_out=sits_out(seed) if switch_roles else None,
        shadow_from=1 if shadow else None,
    )
    return run, hostile


def play(setup: tuple[VerificationRun, dict[int, HostileMember]], rounds: int) -> Outcome:
    """`rounds` rounds of `make_run`'s run: each verdict, the agreements and the times."""
    run, hostile = setup
    out = Outcome()
    for step in range(1, rounds + 1):
        r = run.round(step)
        out.rounds += 1
        out.train.append(r.train_seconds)
        out.verify.append(r.verify_seconds)
        for i, verdict in r.verdicts.items():
            member = hostile.get(i)
            measures = r.single[i].measures
            out.t_by_member.setdefault(i, []).append(measures.agreement)
            lying = (
                member is not None and bool(member.lies) and member.lies[-1] == member.rounds - 1
            )
            out.cosines.setdefault(lying, []).append(measures.cosine)
            out.cos_by_member.setdefault(i, []).append(measures.cosine)
            if member is None:
                out.honest += 1
                out.honest_t.append(measures.agreement)
                if measures.parts is not None:
                    out.honest_parts.append(measures.parts)
                if not verdict.matches:
                    out.honest_refused += 1
                    out.refusals.append(f"round {step}: {verdict.detail}")
            elif member.lies and member.lies[-1] == member.rounds - 1:  # this round's a lie
                out.lies += 1
                out.lie_t.append(measures.agreement)
                if measures.parts is not None:
                    out.lie_parts.append(measures.parts)
                out.refused_alone += 0 if r.single[i].matches else 1
                out.refused_with_evidence += 0 if verdict.matches else 1
                if not verdict.matches and out.first_refused is None:
                    out.first_refused = len(member.lies)
    return out


def half_agreement(
    reader: ResultReader, own: Domain, decoy: Domain, published: list[DistroResult], k: int
) -> float:
    """`--halves`: the agreement `t` of `published` along part `k` of its batch's recompute less
    part `k` of the decoy's (what a verifier that recomputes only one half of each of its two
    batches could read: half the rows of today's two recomputes)."""

    def at(t: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return t.clone() if positions is None else t.index_select(0, positions)

    flat = reader.flat(published)
    return agreement(
        (at(own.parts[k][i], pos).sub_(at(decoy.parts[k][i], pos)), values)
        for i, (pos, values) in enumerate(flat.parts)
    )


def halves(
    attacks: list[Attack], honest_rounds: int, attack_rounds: int, seed: int, switch_roles: bool
) -> None:
    """`--halves` (see the module docstring): DisTrO, the verifier on one thread."""
    reader = result_reader(tiny_trainer("distro"))
    for attack in [None, *attacks]:
        rounds = honest_rounds if attack is None else attack_rounds
        run, hostile = make_run("distro", attack, rounds, 1, seed, switch_roles)
        by_part: dict[tuple[bool, int], list[float]] = {}
        for step in range(1, rounds + 1):
            r = run.round(step)
            members = sorted(r.domains)
            for j, i in enumerate(members):
                decoy = r.domains[members[(j + 1) % len(members)]]
                lying = i in hostile
                for k in (0, 1):
                    t = half_agreement(reader, r.domains[i], decoy, r.published[i], k)
                    by_part.setdefault((lying, k), []).append(t)
        name = "honest" if attack is None else attack.value
        for (lying, k), ts in sorted(by_part.items()):
            who = "its lies" if lying else "honest members"
            print(f"  {name:<12} {who:<15} half {k}: t {spread(ts)}")


def windows(ts: list[float], n: int) -> list[float]:
    """`Evidence`'s statistic over every `n` consecutive rounds: the sum of `t` over sqrt(n)."""
    return [sum(ts[k : k + n]) / math.sqrt(n) for k in range(len(ts) - n + 1)]


def beside(by_member: dict[int, list[float]], member: int) -> list[float]:
    """`member`'s value each round less the mean of the other members' that round."""
    others = [ts for i, ts in by_member.items() if i != member]
    return [
        own - statistics.mean(ts[k] for ts in others) for k, own in enumerate(by_member[member])
    ]


def bias_gap(form: str, rounds: int, threads: int, seed: int) -> None:
    """`--bias-gap`: what the comparison sees of the 1 % bias against honest results. Two runs
    of the same members, data and seed, one honest and one with member 3 biased from its first
    round: every honest `t` (both runs' honest members), the biased results' `t`, member 3's
    `t` in the honest run less its `t` in the biased run round by round (the bias's own effect
    on the statistic: the rounds' weights are the same until the first biased result is
    applied, one round late, and differ by that much after), and the same over every 3
    consecutive rounds (`Evidence`'s statistic, the issue's "within 3 rounds"). One threshold
    catches every lie without refusing an honest result only if the lies' greatest value lies
    below the honest least."""
    honest = play(make_run(form, None, rounds, threads, seed), rounds)
    biased = play(make_run(form, Attack.Bias, rounds, threads, seed), rounds)
    honest_t = [t for ts in honest.t_by_member.values() for t in ts]
    honest_t += [t for i, ts in biased.t_by_member.items() if i != HOSTILE for t in ts]
    lie_t = biased.lie_t
    paired = [a - b for a, b in zip(honest.t_by_member[HOSTILE], lie_t, strict=False)]
    honest_w = [w for ts in honest.t_by_member.values() for w in windows(ts, 3)]
    honest_w += [w for i, ts in biased.t_by_member.items() if i != HOSTILE for w in windows(ts, 3)]
    lie_w = windows(lie_t, 3)
    settings = verification_settings(tiny_trainer(form))
    honest_cos = honest.cosines.get(False, []) + biased.cosines.get(False, [])
    print(
        f"  cosine with the batch's recompute: honest {spread(honest_cos, 3)}, biased "
        f"{spread(biased.cosines.get(True, []), 3)}"
    )

    def unexplained(cosines: list[float]) -> str:
        return spread([math.sqrt(max(0.0, 1.0 - c * c)) for c in cosines], 3)

    # a member's first round carries no history of its own (no momentum, a fresh inner AdamW)
    honest_first = [ts[0] for ts in honest.cos_by_member.values()]
    honest_later = [c for ts in honest.cos_by_member.values() for c in ts[1:]]
    print(
        "  the payload's share no recompute gives, sqrt(1 - cos^2) (the bias: 0.010 of its "
        f"norm): honest first round {unexplained(honest_first)}, later rounds "
        f"{unexplained(honest_later)}; biased first round "
        f"{unexplained(biased.cos_by_member[HOSTILE][:1])}, later "
        f"{unexplained(biased.cos_by_member[HOSTILE][1:])}"
    )
    paired_cos = [
        a - b
        for a, b in zip(honest.cos_by_member[HOSTILE], biased.cos_by_member[HOSTILE], strict=False)
    ]
    print(
        f"  the bias's shift of member {HOSTILE}'s cosine (honest less biased) {spread(paired_cos, 3)}"
    )
    honest_dev = [x for i in honest.cos_by_member for x in beside(honest.cos_by_member, i)]
    print(
        "  cosine less the round's other members' mean (a relative test): honest "
        f"{spread(honest_dev, 3)}, biased {spread(beside(biased.cos_by_member, HOSTILE), 3)}"
    )
    print(f"  honest t {spread(honest_t)}; threshold min_agreement {settings.min_agreement:g}")
    print(f"  biased t {spread(lie_t)}")
    print(f"  the bias's shift of member {HOSTILE}'s t (honest run less biased) {spread(paired)}")
    print(f"  3-round sum / sqrt(3): honest {spread(honest_w)}; biased {spread(lie_w)}")
    for name, h, b in (("one round", honest_t, lie_t), ("3 rounds", honest_w, lie_w)):
        if not h or not b:
            continue
        gap = min(h) - max(b)
        caught = sum(1 for x in b if x < min(h)) / len(b)
        print(
            f"  {name}: {'separable' if gap > 0 else 'NOT separable'} (honest least "
            f"{min(h):.1f}, biased greatest {max(b):.1f}); a threshold just below the honest "
            f"least catches {caught:.0%} of the biased"
        )


def spread(values: list[float], digits: int = 1) -> str:
    """The least, the median and the greatest of `values`."""
    if not values:
        return "-"
    return (
        f"{min(values):.{digits}f} to {max(values):.{digits}f} (median "
        f"{statistics.median(values):.{digits}f}, {len(values)})"
    )


def sits_out(seed: int) -> Callable[[int, int], bool]:
    """2 of the 4 members sit each round out (drawn from the seed), as a 4-client verifying run's
    verifier and tie-breaker do."""

    def out(step: int, i: int) -> bool:
        return i in random.Random(seed * 7919 + step).sample(range(MEMBERS), 2)

    return out


def cost(form: str, threads: int, seed: int, reps: int) -> None:
    """`--cost` (see the module docstring)."""
    honest = play(make_run(form, None, reps, 1, seed), reps)  # like for like: module docstring
    train = statistics.median(honest.train) / ROWS  # seconds per row, one member
    check = statistics.median(honest.verify) / ROWS  # recompute + compare, per row
    copy = save_seconds(form, reps)
    print(
        f"  per row: train {train * 1000:.1f} ms, recompute-and-compare {check * 1000:.1f} ms "
        f"({check / train:.2f}x); a tie-breaker's copy of the weights {copy * 1000:.2f} ms"
    )
    for clients in (21, 101):
        rows = 8 * clients
        base = math.ceil(rows / clients) * train
        free = clients - VERIFICATION_TIE_BREAKERS
        verifiers = verifier_nodes_for(free, 10)
        trainers = free - verifiers
        per = math.ceil(rows / trainers)
        checked = min(trainers, VERIFIED_BATCHES_PER_VERIFIER * verifiers)
        trainer = per * train / base
        verifier = VERIFIED_BATCHES_PER_VERIFIER * per * check / base
        before = checked * per * check / base
        dispute = 2 * per * check / base  # the disputed batch and its decoy, next round
        behind = verifier / trainer
        print(
            f"  {clients} clients at 10 %: 1 tie-breaker, {verifiers} verifiers, {trainers} "
            f"trainers ({per} rows each, {math.ceil(rows / clients)} at 0 %); work a round "
            f"against a trainer's at 0 %: trainer {trainer:.2f}x, verifier {verifier:.2f}x; "
            f"tie-breaker before {before:.2f}x (every checked batch, in the round), now "
            f"{copy / base:.3f}x without a dispute (the copy) and {dispute:.2f}x a disputed "
            f"batch (next round; {checked * per * check / base:.2f}x if every checked batch "
            f"were disputed); {checked} of {trainers} trainers checked a round "
            f"({checked / trainers:.0%}); a verifier needs {behind:.2f}x the trainers' time "
            f"for its two recomputes (a round's end stops it: in a compute-bound round it "
            f"reports nothing unless the witness phase gives it the rest)"
        )
        # `verifiers_train`: every client trains (upstream's split of the batch), a verifier
        # checks after its own training, in the round's idle time
        own = math.ceil(rows / clients)
        checks = VERIFIED_BATCHES_PER_VERIFIER * own * check / base
        print(
            f"  {clients} clients at 10 % with verifiers_train: every client {own} rows "
            f"({math.ceil(rows / clients)} at 0 %): the round's training "
            f"{own * train / base:.2f}x a round at 0 % (verifiers train nothing: {trainer:.2f}x); "
            f"a verifier's work {own * train / base + checks:.2f}x, its checks "
            f"{checks:.2f}x of a training step after its own, which the round's idle time "
            f"(witness phase, waiting for the slowest result) must hold for them to be reported; "
            f"{min(trainers + verifiers, VERIFIED_BATCHES_PER_VERIFIER * verifiers)} of "
            f"{trainers + verifiers} training clients' batches checkable a round "
            f"(the tie-breaker's own is in no pool)"
        )


def profile(form: str, preset: str, rows: int, seq: int, reps: int, seed: int) -> None:
    """`--profile` (see the module docstring): one member and one verifier at the same weights,
    `reps` rounds; the member's result of each round checked with the next batch as decoy."""
    trainer, verifier = tiny_trainer(form, preset=preset), tiny_trainer(form, preset=preset)
    vocab = trainer.model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    reader, settings = result_reader(verifier), verification_settings(verifier)
    saved = save_weights(verifier)
    times: dict[str, list[float]] = {
        k: [] for k in ("train", "prepare", "recompute", "domain", "compare", "copy")
    }

    def timed(name: str, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        start = time.process_time()
        out = work(*args, **kwargs)
        times[name].append(time.process_time() - start)
        return out

    verdict = None
    for step in range(1, reps + 1):
        own, other = (Batch(torch.randint(0, vocab, (rows, seq), generator=g)) for _ in (0, 1))
        out = timed(
            "train",
            trainer.train_exact,
            step,
            own,
            warmup_lr_between=None,
            zero_optim=False,
            prev_self_distro_results=[],
        )
        prepared = timed("prepare", trainer.prepare_result, out, step=step, batch_id=BatchId(0, 0))
        published = verifier.results_from_payload(prepared.payload)
        domains = [
            timed(
                "domain", domain_of, verifier, timed("recompute", recompute, verifier, b, step=step)
            )
            for b in (own, other)
        ]
        verdict = timed("compare", compare, reader, domains[0], domains[1], published, settings)
        timed("copy", save_weights, verifier, saved)
        for t in (trainer, verifier):  # the round's own update, on both: the same weights
            t.optimize(step, distro_results=[out.distro_results or []])
    base = statistics.median(times["train"]) + statistics.median(times["prepare"])
    check = sum(statistics.median(times[k]) for k in ("recompute", "domain", "compare"))
    print(
        f"  {preset}, {rows} rows x {seq} tokens, {reps} rounds: a member's training step "
        f"{base * 1000:.1f} ms (train_exact + prepare_result); one check (its batch's "
        f"recompute, its DCT and one comparison; the decoy is another check's batch) "
        f"{check * 1000:.1f} ms = {check / base:.2f}x"
    )
    for name in ("recompute", "domain", "compare", "copy"):
        x = statistics.median(times[name])
        print(f"    {name:<9} {x * 1000:9.1f} ms  {x / base:.3f}x  {x / check:.0%} of a check")
    assert verdict is not None
    print(f"    last verdict: {'matches' if verdict.matches else 'REFUSED'} ({verdict.detail})")


def save_seconds(form: str, reps: int) -> float:
    """The median time of a tie-breaker's `save_weights` into its kept copy (the tiny model)."""
    trainer = tiny_trainer(form)
    saved = save_weights(trainer)
    times = []
    for _ in range(max(reps, 5)):
        start = time.process_time()
        save_weights(trainer, saved)
        times.append(time.process_time() - start)
    return statistics.median(times)


def shadow(
    form: str,
    attacks: list[Attack],
    rounds: tuple[int, int],
    threads: int,
    seed: int,
    switch_roles: bool,
) -> None:
    """`--shadow` (see the module docstring): the exact comparison's honest mismatches and time,
    then each attack's caught rounds."""
    honest_rounds, attack_rounds = rounds
    if honest_rounds < 1:
        return
    started = time.perf_counter()
    run, _ = make_run(form, None, honest_rounds, threads, seed, switch_roles, shadow=True)
    verdicts, train, verify = [], [], []
    for step in range(1, honest_rounds + 1):
        r = run.round(step)
        verdicts += list(r.exact.values())
        train.append(r.train_seconds)
        verify.append(r.verify_seconds)
    mismatched = sum(1 for v in verdicts if not v.matches)
    ratio = statistics.median(verify) / statistics.median(train)
    print(
        f"  honest: {mismatched} mismatches of {len(verdicts)} exact verifications (the verifier "
        f"on {threads} thread(s), the members on 1{', switching roles' if switch_roles else ''}); "
        f"a shadow verification {ratio:.2f}x one training step (median "
        f"{statistics.median(verify) * 1000:.0f} ms against {statistics.median(train) * 1000:.0f} "
        f"ms, CPU seconds{' of both threads, waiting included' if threads > 1 else ''}) "
        f"[{time.perf_counter() - started:.0f} s]"
    )
    follow_cost(ratio)
    print(
        f"  {'attack':<13} {'lies':>5} {'caught':>7} {'caught by lie':>14} {'honest mismatches':>18}"
    )
    for attack in attacks:
        run, hostile = make_run(form, attack, attack_rounds, threads, seed, switch_roles, True)
        member = hostile[HOSTILE]
        lies = caught = honest = honest_mismatched = 0
        first: int | None = None
        for step in range(1, attack_rounds + 1):
            r = run.round(step)
            for i, verdict in r.exact.items():
                if i != HOSTILE:
                    honest += 1
                    honest_mismatched += 0 if verdict.matches else 1
                elif member.lies and member.lies[-1] == member.rounds - 1:
                    lies += 1
                    caught += 0 if verdict.matches else 1
                    if not verdict.matches and first is None:
                        first = len(member.lies)
        by = "-" if first is None else f"#{first}"
        print(
            f"  {attack.value:<13} {lies:5d} {caught / max(lies, 1):7.0%} {by:>14} "
            f"{honest_mismatched:>8d} of {honest:<8d}"
        )


def follow_cost(ratio: float) -> None:
    """The extra training a round of a run that verifies exactly costs (`psyche.coordinator.
    following`: every trained batch is rebuilt by `FOLLOWERS_PER_TRAINER` followers, one shadow
    step each, `ratio` of one training step as measured above), per client, as a ratio of its
    own training step: at 4 clients and `verification_percent = 25` (two trainers a round),
    and in a run where every client trains (`verifiers_train`, or 0 % verifiers)."""
    for label, clients, trainers in (("4 clients at 25 %", 4, 2), ("every client trains", 8, 8)):
        extra = FOLLOWERS_PER_TRAINER * trainers / clients * ratio
        print(
            f"  followed ({FOLLOWERS_PER_TRAINER} followers a trainer), {label}: each client "
            f"trains +{extra:.2f} of a training step a round ({trainers} trained batches x "
            f"{FOLLOWERS_PER_TRAINER} x {ratio:.2f} over {clients} clients)"
        )


def determinism(form: str, preset: str, rows: int, seq: int, seed: int) -> None:
    """`--shadow`'s determinism line: one member trains 2 rounds on one thread, a verifier
    follows it on 1, 2 and 4 intra-op threads; does each rebuild its payload, and how many bits
    differ (against the bits the 1 % bias changes in the same payloads)?"""
    vocab = D.build(preset, "cpu").config.vocab_size
    data = D.bigram_corpus(2 * rows, seq, vocab, seed=seed)
    torch.set_num_threads(1)
    member = tiny_trainer(form, preset=preset)
    liar, fmt = HostileMember(Attack.Bias, seed=seed), payload_format(member)
    payloads: list[TransmittableDistroResult] = []
    biased: list[TransmittableDistroResult] = []
    prev: list[DistroResult] = []
    for step in (1, 2):
        batch = Batch(data[(step - 1) * rows : step * rows])
        out = member.train_exact(
            step, batch, warmup_lr_between=None, zero_optim=False,
            prev_self_distro_results=[prev] if prev else [],
        )  # fmt: skip
        prev = out.distro_results or []
        prepared = member.prepare_result(out, step=step, batch_id=BatchId(0, 0))
        payloads.append(prepared.payload)
        sent = liar.tamper(prepared.sent, fmt)
        biased.append(transmittable_distro_result(sent, step, out.nonce, BatchId(0, 0)))
        member.optimize(step, distro_results=[member.results_from_payload(prepared.payload)])
    words = []
    for threads in (1, 2, 4):
        torch.set_num_threads(threads)
        verifier = tiny_trainer(form, preset=preset)
        shadow_state = Shadow.fresh(verifier)
        found = []
        for step, payload, lie in zip((1, 2), payloads, biased):
            batch = Batch(data[(step - 1) * rows : step * rows])
            rebuilt = follow(verifier, shadow_state, batch, step=step, batch_id=BatchId(0, 0))
            honest, bias = compare_exact(rebuilt, payload), compare_exact(rebuilt, lie)
            found.append(
                f"{'=' if honest.matches else 'x'} ({honest.differing_bits} bits; the bias "
                f"{bias.differing_bits} of {bias.bits})"
            )
            verifier.optimize(step, distro_results=[verifier.results_from_payload(payload)])
        words.append(f"{threads} thread(s): " + ", ".join(found))
    torch.set_num_threads(1)
    print(f"  {preset}, {rows} rows x {seq} tokens, rounds 1 and 2 (= rebuilt, x not):")
    for line in words:
        print(f"    {line}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke check: few rounds, two forms")
    p.add_argument("--optimizers", default=",".join(FORMS))
    p.add_argument("--attacks", default=",".join(a.value for a in ATTACKS))
    p.add_argument("--honest-rounds", type=int, default=125)
    p.add_argument("--attack-rounds", type=int, default=20)
    p.add_argument("--verifier-threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--switch-roles", action="store_true", help="honest members sit rounds out")
    p.add_argument("--cost", action="store_true", help="a round's work per client at 10 %%")
    p.add_argument("--profile", action="store_true", help="where a verification's time goes")
    p.add_argument("--halves", action="store_true", help="DisTrO: a one-half check's statistic")
    p.add_argument("--bias-gap", action="store_true", help="the 1 %% bias against honest t")
    p.add_argument("--shadow", action="store_true", help="exact verification by a shadow")
    p.add_argument(
        "--preset", default="tiny", help="--profile, --shadow's determinism: Llama size (tiny, 20m)"
    )
    p.add_argument("--rows", type=int, default=ROWS, help="--profile, --shadow: rows a batch")
    p.add_argument("--seq", type=int, default=32, help="--profile, --shadow: tokens a row")
    args = p.parse_args()
    torch.set_num_threads(1)
    forms = args.optimizers.split(",")
    attacks = [Attack(name) for name in args.attacks.split(",")]
    honest_rounds, attack_rounds = args.honest_rounds, args.attack_rounds
    if args.quick:
        forms = [f for f in forms if f in ("distro", "bf16")]
        honest_rounds, attack_rounds = 4, 3
        attacks = [a for a in attacks if a in (Attack.OtherData, Attack.Lazy, Attack.Bias)]
    unknown = [f for f in forms if f not in FORMS]
    if unknown:
        p.error(f"unknown optimizer {unknown[0]!r}; choose from {', '.join(FORMS)}")
    threads = 1 if args.cost or args.profile or args.halves else args.verifier_threads
    print(
        f"# Verifiers: {MEMBERS} members x {ROWS} rows a round, the verifier on "
        f"{threads} thread(s) (members: 1); CPU, torch {torch.__version__}"
    )
    if args.halves:
        print("\n## DisTrO 1-bit c16 k4: t along one half of the batch less the decoy's same half")
        halves(attacks, honest_rounds, attack_rounds, args.seed, args.switch_roles)
        return
    if args.bias_gap:
        for form in forms:
            rounds = 6 if args.quick else args.attack_rounds
            print(f"\n## {NAMES[form]}: the 1 % bias against honest results, {rounds} rounds")
            bias_gap(form, rounds, args.verifier_threads, args.seed)
        return
    if args.shadow:
        for form in forms:
            print(f"\n## {NAMES[form]}: exact verification by a shadow")
            determinism(form, args.preset, args.rows, args.seq, args.seed)
            rounds = (honest_rounds, attack_rounds)
            shadow(form, attacks, rounds, args.verifier_threads, args.seed, args.switch_roles)
        return
    if args.profile:
        for form in forms:
            print(f"\n## {NAMES[form]}: where a verification's time goes (one thread)")
            profile(form, args.preset, args.rows, args.seq, 4 if args.quick else 8, args.seed)
        return
    if args.cost:
        for form in forms:
            print(f"\n## {NAMES[form]}: a round's work per client, verification_percent 10")
            cost(form, args.verifier_threads, args.seed, 4 if args.quick else 12)
        return
    for form in forms:
        started = time.perf_counter()
        setup = (args.verifier_threads, args.seed, args.switch_roles)
        honest = play(make_run(form, None, honest_rounds, *setup), honest_rounds)
        ratio = statistics.median(honest.verify) / statistics.median(honest.train)
        print(
            f"\n## {NAMES[form]}: honest {honest.honest_refused} refused of {honest.honest} "
            f"verifications; recompute-and-compare {ratio:.2f}x one training step "
            f"(median {statistics.median(honest.verify) * 1000:.0f} ms against "
            f"{statistics.median(honest.train) * 1000:.0f} ms"
            + (
                f"; CPU seconds of the verifier's {threads} threads, waiting included: "
                "--cost or --profile for a like-for-like ratio"
                if threads > 1
                else ""
            )
            + f") [{time.perf_counter() - started:.0f} s]"
        )
        print(f"  honest agreement {spread(honest.honest_t)}; parts {spread(honest.honest_parts)}")
        for line in honest.refusals[:5]:
            print(f"    honest refused, {line}")
        print(
            f"  {'attack':<13} {'lies':>5} {'refused alone':>14} {'with evidence':>14} "
            f"{'caught by lie':>14} {'honest refused':>15}"
        )
        for attack in attacks:
            o = play(make_run(form, attack, attack_rounds, *setup), attack_rounds)
            caught = "-" if o.first_refused is None else f"#{o.first_refused}"
            print(
                f"  {attack.value:<13} {o.lies:5d} {o.refused_alone / max(o.lies, 1):14.0%} "
                f"{o.refused_with_evidence / max(o.lies, 1):14.0%} {caught:>14} "
                f"{o.honest_refused:>6d} of {o.honest:<6d}"
            )
            print(f"    its lying rounds' agreement {spread(o.lie_t)}")
            if o.lie_parts:
                print(f"    its lying rounds' parts {spread(o.lie_parts)}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
