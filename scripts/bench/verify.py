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

    .venv/bin/python scripts/bench/verify.py            # full: 500 honest verifications each
    .venv/bin/python scripts/bench/verify.py --quick    # a smoke check (seconds to a minute)

No downloads: random-init Llama configs and a synthetic corpus.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from psyche.modeling.hostile import Attack, HostileMember
from psyche.modeling.trainer import Batch
from psyche.modeling.verification_sim import FORMS, VerificationRun, tiny_trainer

sys.path.insert(0, str(Path(__file__).parent))
import diloco as bench_diloco

D = bench_diloco.D
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
    train: list[float] = field(default_factory=list)
    verify: list[float] = field(default_factory=list)


def play(form: str, attack: Attack | None, rounds: int, threads: int, seed: int) -> Outcome:
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
    )
    out = Outcome()
    for step in range(1, rounds + 1):
        r = run.round(step)
        out.rounds += 1
        out.train.append(r.train_seconds)
        out.verify.append(r.verify_seconds)
        for i, verdict in r.verdicts.items():
            member = hostile.get(i)
            if member is None:
                out.honest += 1
                if not verdict.matches:
                    out.honest_refused += 1
                    out.refusals.append(f"round {step}: {verdict.detail}")
            elif member.lies and member.lies[-1] == step - 1:
                out.lies += 1
                out.refused_alone += 0 if r.single[i].matches else 1
                out.refused_with_evidence += 0 if verdict.matches else 1
                if not verdict.matches and out.first_refused is None:
                    out.first_refused = len(member.lies)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke check: few rounds, two forms")
    p.add_argument("--optimizers", default=",".join(FORMS))
    p.add_argument("--attacks", default=",".join(a.value for a in ATTACKS))
    p.add_argument("--honest-rounds", type=int, default=125)
    p.add_argument("--attack-rounds", type=int, default=20)
    p.add_argument("--verifier-threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=5)
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
    print(
        f"# Verifiers: {MEMBERS} members x {ROWS} rows a round, the verifier on "
        f"{args.verifier_threads} threads (members: 1); CPU, torch {torch.__version__}"
    )
    for form in forms:
        started = time.perf_counter()
        honest = play(form, None, honest_rounds, args.verifier_threads, args.seed)
        ratio = statistics.median(honest.verify) / statistics.median(honest.train)
        print(
            f"\n## {NAMES[form]}: honest {honest.honest_refused} refused of {honest.honest} "
            f"verifications; recompute-and-compare {ratio:.2f}x one training step "
            f"(median {statistics.median(honest.verify) * 1000:.0f} ms against "
            f"{statistics.median(honest.train) * 1000:.0f} ms) "
            f"[{time.perf_counter() - started:.0f} s]"
        )
        for line in honest.refusals[:5]:
            print(f"    honest refused, {line}")
        print(
            f"  {'attack':<13} {'lies':>5} {'refused alone':>14} {'with evidence':>14} "
            f"{'caught by lie':>14} {'honest refused':>15}"
        )
        for attack in attacks:
            o = play(form, attack, attack_rounds, args.verifier_threads, args.seed)
            caught = "-" if o.first_refused is None else f"#{o.first_refused}"
            print(
                f"  {attack.value:<13} {o.lies:5d} {o.refused_alone / max(o.lies, 1):14.0%} "
                f"{o.refused_with_evidence / max(o.lies, 1):14.0%} {caught:>14} "
                f"{o.honest_refused:>6d} of {o.honest:<6d}"
            )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
