"""Poisoned results: every attack of `psyche.modeling.hostile` against DisTrO and DiLoCo, with and
without the defences, held out against the honest members alone, in one sitting.

For each optimizer (DisTrO 1-bit c16 k4; DiLoCo bf16, int8 and sparse, 4 inner steps) and each
setup (1 hostile member of 4, 2 colluding of 8), N simulated members train a tiny Llama through
the real payloads (postcard, commitment hash, the receiver's checks; `PeerSimulation` /
`DilocoPeerSimulation`) on a synthetic bigram corpus, each on its own share of every step's
batch:

* honest-only: the honest members alone, on the same shares (the baseline of every ratio);
* honest, defended: all N members honest, with the witnesses' checks (and for DiLoCo the bounded
  aggregate): its loss against the same run undefended, and its honest checks (none refused is
  the goal);
* each attack, undefended and defended: the hostile members' results rewritten before they are
  encoded (they pass every check of the bytes), every member witnessing every round (an honest
  one screens, a hostile one vouches for everything; a result is applied with the coordinator's
  quorum of vouchers).

The loss is an honest member's held-out loss at the end. Ratios are against honest-only of the
same optimizer and setup, measured in this run.

`--only honest-cases` runs DisTrO's honest members in harder runs (`CASES`: one member on
another bigram chain, every member on its own, a member back with a fresh momentum, two
colluders framing an honest member) and counts their refused checks, and how many of them the
consensus-outlier test refused. `--outlier` sets that test for the defended DisTrO runs
("off", or its parameters); `--record` writes each of its judgements as a JSON line.

    .venv/bin/python scripts/bench/poison.py --threads 1
    .venv/bin/python scripts/bench/poison.py --optimizers distro --setups 1of4 --attacks sign-flip
    .venv/bin/python scripts/bench/poison.py --only honest-cases --steps 60

No downloads: random-init Llama configs and a synthetic corpus.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from psyche.core.batch_id import BatchId
from psyche.core.definitions import DilocoTransmission, LearningRateSchedule
from psyche.modeling.compression import index_width
from psyche.modeling.diloco import DilocoPeerSimulation, DilocoSettings
from psyche.modeling.distro import DistroResult
from psyche.modeling.hostile import Attack, HostileMember, HostileMembers
from psyche.modeling.research import DistroSettings, PeerSimulation
from psyche.modeling.screening import (
    _INDEX_DTYPES,
    DILOCO_SCREENING,
    DISTRO_SCREENING,
    OutlierTest,
    Reference,
    RoundTamper,
    ScreeningSettings,
    Tally,
    WitnessScreen,
    screening_settings,
)
from psyche.modeling.trainer import Batch, Trainer

T = DilocoTransmission


sys.path.insert(0, str(Path(__file__).parent))
import diloco as bench_diloco  # noqa: E402 (scripts/bench/diloco.py: its corpus and model builder)

D = bench_diloco.D
_schedule = bench_diloco._schedule
_held_out_loss = bench_diloco._held_out_loss

OPTIMIZERS = {
    "distro": "DisTrO 1-bit c16 k4",
    "bf16": "DiLoCo bf16",
    "int8": "DiLoCo int8 c64",
    "sparse": "DiLoCo sparse c16 k8 2-bit",
}
SETUPS = {"1of4": (4, 1), "2of8": (8, 2)}
GOAL_LOSS = 0.03


@dataclass
class Outcome:
    loss: float
    lies_applied: int
    lies: int
    tally: Tally | None
    seconds: float
    screen_seconds: float


def _diloco_settings(name: str, inner: int, bounded: bool) -> DilocoSettings:
    transmission = {"bf16": T.Bf16, "int8": T.Int8, "sparse": T.Sparse}[name]
    return DilocoSettings(
        inner_steps=inner,
        transmission=transmission,
        compression_chunk=64 if transmission is T.Int8 else 16,
        compression_topk=8,
        value_bits=2,
        outer_lr=0.7,
        outer_momentum=0.5,
        nesterov=True,
        peer_clip_multiple=2.0 if bounded else 0.0,
    )


def _chain_corpus(n: int, seq_len: int, vocab: int, chain: int, seed: int = 1) -> torch.Tensor:
    """`D.bigram_corpus` of another bigram chain (`chain`: the successors' seed; 0 is the
    run's): an honest member whose data differs from the others'."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 2), generator=torch.Generator().manual_seed(chain))
    x = torch.empty(n, seq_len, dtype=torch.int64)
    x[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, seq_len):
        x[:, t] = successors[x[:, t - 1], torch.randint(0, 2, (n,), generator=g)]
    return x


class Frame:
    """Colluders that try to get an honest member's results refused (a `RoundTamper`): each
    sends its honest DisTrO result with `share` of each block's entries moved onto the target's
    positions, the target's signs negated there, which pulls the target's `t` along the
    round's consensus down while the colluders' own results still agree with the round."""

    def __init__(self, colluders: Sequence[int], target: int, share: float = 1 / 3) -> None:
        self.indices = frozenset(colluders)
        self.late = frozenset(colluders)  # they need the target's result of the round
        self.target = target
        self.share = share

    def lazy_rows(self, member: int, rows: int) -> int:
        return rows

    def __call__(
        self, sent: Sequence[Sequence[DistroResult]], source: object
    ) -> list[list[DistroResult]]:
        out = [list(r) for r in sent]
        for c in self.indices:
            out[c] = [self._frame(r, t) for r, t in zip(sent[c], sent[self.target])]
        return out

    def _frame(self, r: DistroResult, t: DistroResult) -> DistroResult:
        dtype = _INDEX_DTYPES[index_width(r.totalk)]
        idx = r.sparse_idx.clone().view(dtype)
        k = idx.shape[-1]
        m = max(1, round(k * self.share))
        idx[..., :m] = t.sparse_idx.view(dtype)[..., :m]
        val = r.sparse_val.clone()
        assert val.dtype == torch.bool, "framing plays DisTrO 1-bit"
        val[..., :m] = ~t.sparse_val[..., :m]
        return DistroResult(idx.view(r.sparse_idx.dtype), val, list(r.xshape), r.totalk)


@dataclass(frozen=True)
class Case:
    """An honest run's variation (`--only honest-cases`): members on other data, a member
    back with a fresh momentum, colluders framing an honest member."""

    name: str
    other_chain: frozenset[int] = frozenset()
    """Positions whose rows come from another bigram chain each."""
    joiner: int | None = None
    """A position that restarts with a fresh momentum (and is new to every witness) at a
    third of the run."""
    frame: bool = False
    """The last two positions frame position 0 (`Frame`)."""


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        vocab = D.build("tiny", "cpu").config.vocab_size
        self.vocab = vocab
        self.per_member = args.rows_per_member
        self.data = D.bigram_corpus(args.steps * 8 * self.per_member, args.seq, vocab)
        self.held_out = D.bigram_corpus(64, args.seq, vocab, seed=99)
        self._chains: dict[int, torch.Tensor] = {}
        self.distro_screening = _distro_screening(args.outlier)

    def rows(self, step: int, member: int, chain: int = 0) -> torch.Tensor:
        """Member `member`'s share of step `step` (the same whoever else is in the run);
        `chain`: of another bigram chain's corpus."""
        start = ((step - 1) * 8 + member) * self.per_member
        data = self.data
        if chain:
            if chain not in self._chains:
                a = self.args
                n = a.steps * 8 * self.per_member
                self._chains[chain] = _chain_corpus(n, a.seq, self.vocab, chain)
            data = self._chains[chain]
        return data[start : start + self.per_member]

    def run(
        self,
        optimizer: str,
        members: list[int],
        hostile: dict[int, HostileMember] | None,
        defended: bool,
        case: Case | None = None,
    ) -> Outcome:
        """`members`: the indices (data shares) of the run's members; `hostile` by position in
        `members`."""
        a = self.args
        started = time.perf_counter()
        models = [D.build("tiny", "cpu").model for _ in members]
        tamper: RoundTamper | None = HostileMembers(hostile) if hostile else None
        if case is not None and case.frame:
            tamper = Frame([len(members) - 2, len(members) - 1], 0)
        if optimizer == "distro":
            settings = DistroSettings(compression_chunk=16, compression_topk=4, clip_grad_norm=1.0)
            sim: PeerSimulation | DilocoPeerSimulation = PeerSimulation(
                models,
                settings,
                lr=_schedule(a.distro_lr, a.steps),
                through_wire=True,
                hostile=tamper,
                screening=self.distro_screening if defended else None,
            )
        else:
            sim = DilocoPeerSimulation(
                models,
                _diloco_settings(optimizer, a.inner_steps, bounded=defended),
                lr=_schedule(a.diloco_lr, a.steps),
                through_wire=True,
                hostile=tamper,
                screening=DILOCO_SCREENING if defended else None,
            )
        panel = sim.witnesses
        screen_seconds = 0.0
        if panel is not None:
            accepted_fn = panel.accepted

            def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
                nonlocal screen_seconds
                t = time.perf_counter()
                out = accepted_fn(*args, **kwargs)
                screen_seconds += time.perf_counter() - t
                return out

            panel.accepted = timed  # type: ignore[method-assign]
        lies_applied = 0
        indices = tamper.indices if tamper else frozenset()
        joins = a.steps // 3 + 1
        RECORD.hostile = frozenset(indices)
        RECORD.label = f"{optimizer} {len(members)} {case.name if case else ''} {defended}"
        for step in range(1, a.steps + 1):
            RECORD.step = step
            if case is not None and case.joiner is not None and step == joins:
                _fresh(sim, case.joiner)
            sim.zero_grad(step)
            for position, (member, model) in enumerate(zip(members, sim.models)):
                chain = position + 1 if case is not None and position in case.other_chain else 0
                ids = self.rows(step, member, chain)
                if isinstance(tamper, HostileMembers):
                    ids = ids[: tamper.lazy_rows(position, len(ids))]
                model(ids, labels=ids, use_cache=False).loss.backward()
            ended = sim.step(step)
            if ended is not False and hostile:
                for i in indices.intersection(sim.last_accepted):
                    member = hostile[i]  # its round just sent: was it a lie?
                    lies_applied += bool(member.lies) and member.lies[-1] == member.rounds - 1
        if isinstance(sim, DilocoPeerSimulation):
            sim.flush(a.steps)
        honest = next(i for i in range(len(members)) if i not in indices)
        loss = _held_out_loss(sim.models[honest], self.held_out)
        tally = panel.tally if panel is not None else None
        lies = sum(len(m.lies) for m in (hostile or {}).values())
        seconds = time.perf_counter() - started
        return Outcome(loss, lies_applied, lies, tally, seconds, screen_seconds)


def _fresh(sim: PeerSimulation | DilocoPeerSimulation, position: int) -> None:
    """Member `position` starts again as a joiner does: the run's weights, a fresh momentum,
    and a sender no witness has checked before."""
    assert isinstance(sim, PeerSimulation), "a joiner is played for DisTrO"
    peer = sim.peers[position]
    peer.distro.zero_optim()
    peer.prev_results = None
    if sim.witnesses is not None:
        for screen in sim.witnesses.screens.values():
            screen._agreements.pop(position, None)
            screen._outlier_flags.pop(position, None)


def _distro_screening(spec: str) -> ScreeningSettings:
    """`--outlier`: "shipped" (`DISTRO_SCREENING` as it is), "off", or
    "share,consensus_gate,update_gate,outliers,rounds" (`OutlierTest`)."""
    if spec == "shipped":
        return DISTRO_SCREENING
    if spec == "off":
        return replace(DISTRO_SCREENING, consensus_outlier=None)
    share, consensus_gate, update_gate, outliers, rounds = spec.split(",")
    test = OutlierTest(
        float(share), float(consensus_gate), float(update_gate), int(outliers), int(rounds)
    )
    return replace(DISTRO_SCREENING, consensus_outlier=test)


class _Record:
    """`--record`: every judgement of the outlier test (open or closed) as a JSON line: step,
    witness, sender, `c`, `t`, `C`, `T`, and the decision."""

    def __init__(self) -> None:
        self.file: Any = None
        self.step = 0
        self.label = ""
        self.hostile: frozenset[int] = frozenset()

    def install(self, path: str) -> None:
        self.file = open(path, "a")  # noqa: SIM115 (open for the whole run)
        judge = WitnessScreen._outlier_problem

        def recorded(
            screen: WitnessScreen, sender: Any, ts: Any, consensus: Any, i: int
        ) -> tuple[bool, str | None] | None:
            out = judge(screen, sender, ts, consensus, i)
            others = [k for k in range(len(ts)) if k != i]
            if len(others) >= 2:
                row = {
                    "run": self.label, "step": self.step, "witness": id(screen) % 100003,
                    "sender": sender, "hostile": sender in self.hostile, "c": consensus[i],
                    "t": ts[i], "C": statistics.median_low(consensus[k] for k in others),
                    "T": statistics.median_low(ts[k] for k in others),
                    "refused": bool(out and out[1]),
                }  # fmt: skip
                self.file.write(json.dumps(row) + "\n")
            return out

        WitnessScreen._outlier_problem = recorded  # type: ignore[method-assign]


RECORD = _Record()


# -- the cost of the checks on an honest round ------------------------------------------------


def _cost_trainer(
    size: str, optimizer: str, device: str = "cpu", distro: tuple[int, int] = (16, 8)
) -> Trainer:
    from psyche.core.definitions import ConstantLR, DiLoCo, OptimizerDefinition

    model = D.build(size, device)
    schedule = LearningRateSchedule.Constant(ConstantLR(1e-3, 0.0, 0))
    if optimizer == "distro":  # (chunk, top-k): configs/tiny-cpu's by default
        definition = D.distro_def(*distro)
    else:  # configs/tiny-cpu-diloco's
        definition = OptimizerDefinition.DiLoCo(
            DiLoCo(
                inner_steps=4, transmission=T.Sparse, value_bits=2, compression_chunk=16,
                compression_topk=8, nesterov=True, outer_lr_follows_schedule=False,
                inner_weight_decay=0.0, inner_clip_grad_norm=1.0, outer_lr=0.7,
                outer_momentum=0.5, outer_clip_grad_norm=0.0, peer_clip_multiple=2.0,
            )
        )  # fmt: skip
    return Trainer(model, schedule, definition, micro_batch_size=1)


def cost_round(
    trainers: tuple[Trainer, Trainer],
    data: torch.Tensor,
    rows: int,
    step: int,
    prev: dict[int, list[list[DistroResult]]],
    sync: Callable[[], None] = lambda: None,
) -> tuple[float, Reference, list[list[DistroResult]]]:
    """One cost round of the witness's trainer and its peer's, each on its own `rows` rows:
    the witness's training (CPU seconds: forward/backward, `generate`, the payload), its
    reference, and both sent results (`prev`: each one's last results, updated)."""
    sent: list[list[DistroResult]] = []
    seconds, reference = 0.0, None
    for i, trainer in enumerate(trainers):
        sync()
        ids = data[((step - 1) * 2 + i) * rows : ((step - 1) * 2 + i + 1) * rows]
        t = time.process_time()
        out = trainer.train_exact(
            step, Batch(ids), warmup_lr_between=None, zero_optim=False,
            prev_self_distro_results=prev[i],
        )  # fmt: skip
        prepared = trainer.prepare_result(out, step=step, batch_id=BatchId(i, i))
        if i == 0:
            sync()
            seconds = time.process_time() - t
            reference = trainer.screening_reference()
        prev[i] = [out.distro_results or []]
        sent.append(prepared.sent)
    assert reference is not None
    return seconds, reference, sent


def bench_cost(
    sizes: list[str],
    clients: int,
    rows: int,
    seq: int,
    rounds: int,
    device: str = "cpu",
    distro: tuple[int, int] = (16, 8),
    optimizers: Sequence[str] = ("distro", "sparse"),
) -> None:
    """One honest round of one witness, the configs' optimizers, real `Trainer`s: its training
    (forward/backward, `generate` or the inner steps, the payload) against its checks of the
    round's other results (own reference, `clients - 1` checks of the peer's result, closing
    the round) and its apply of the round's results, medians over `rounds`; CPU time of the
    process (the machine's load distorts wall time; on the CPU the checks take cores the
    training would have).

    The checks run two ways on the same results of the same rounds, their order alternating:
    the direction gathered at each result's positions (the baseline: every check before
    `precombine_from`) and combined once a round (`precombine_from` = 0); the same `t`s
    (asserted), the cost of each and the ratio. A witness takes the combined direction when its
    previous round had `precombine_from` checks or more (`auto`)."""
    settings0 = DISTRO_SCREENING
    print(
        f"\n## Cost of the checks on an honest round ({clients} clients: {clients - 1} checks, "
        f"{rows}x{seq} tokens per client per round, {device}): median CPU time over {rounds} "
        f"rounds; gathered = baseline, combined = one direction a round "
        f"(auto: combined from {settings0.precombine_from} checks)"
    )
    print(
        f"  {'model':<6} {'optimizer':<27} {'train ms':>9} {'apply ms':>9} {'gathered ms':>12} "
        f"{'combined ms':>12} {'ratio':>6} {'gathered %':>11} {'combined %':>11} {'auto %':>7}"
    )
    for size in sizes:
        from psyche.modeling.configs import llama_config_dict

        vocab = llama_config_dict(size)["vocab_size"]
        for optimizer in optimizers:
            own = _cost_trainer(size, optimizer, device, distro)
            peer = _cost_trainer(size, optimizer, device, distro)
            sync = (
                (lambda: torch.cuda.synchronize()) if device.startswith("cuda") else (lambda: None)
            )
            reader = own.screening_reader()
            assert reader is not None
            settings = screening_settings(reader)
            ways = {
                "gathered": WitnessScreen(reader, replace(settings, precombine_from=10**9)),
                "combined": WitnessScreen(reader, replace(settings, precombine_from=0)),
            }
            auto_combined = clients - 1 >= settings.precombine_from
            data = D.bigram_corpus(2 * rounds * rows, seq, vocab).to(own.model.device)
            prev: dict[int, list[list[DistroResult]]] = {0: [], 1: []}
            train, apply = [], []
            check: dict[str, list[float]] = {way: [] for way in ways}
            for step in range(1, rounds + 1):
                seconds, reference, results = cost_round((own, peer), data, rows, step, prev, sync)
                train.append(seconds)
                agreements = {}
                for way in sorted(ways, reverse=step % 2 == 0):
                    t = time.process_time()
                    rnd = ways[way].open_round()
                    rnd.set_reference(reference, results[0])
                    agreements[way] = [
                        rnd.check(sender, results[1]).measure.agreement
                        for sender in range(1, clients)
                    ]
                    rnd.close()
                    sync()
                    check[way].append(time.process_time() - t)
                assert agreements["gathered"] == agreements["combined"], agreements
                t = time.process_time()
                own.optimize(step, distro_results=[results[0]] + [results[1]] * (clients - 1))
                sync()
                apply.append(time.process_time() - t)
            tr, ap, gathered, combined = (
                statistics.median(x) * 1000 for x in (train, apply, *check.values())
            )
            name = "DiLoCo sparse c16 k8 2-bit"
            if optimizer == "distro":
                name = f"DisTrO 1-bit c{distro[0]} k{distro[1]}"
            auto = combined if auto_combined else gathered
            print(
                f"  {size:<6} {name:<27} {tr:9.1f} {ap:9.1f} {gathered:12.1f} {combined:12.1f} "
                f"{combined / gathered:6.2f} {gathered / (tr + ap):11.1%} "
                f"{combined / (tr + ap):11.1%} {auto / (tr + ap):7.1%}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--rows-per-member", type=int, default=2)
    p.add_argument("--inner-steps", type=int, default=4)
    p.add_argument("--distro-lr", type=float, default=1e-2)
    p.add_argument("--diloco-lr", type=float, default=3e-3)
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--setups", default=",".join(SETUPS))
    # other-data needs a trainer that picks its rows (the verification benchmark plays it)
    playable = [a.value for a in Attack if a is not Attack.OtherData]
    p.add_argument("--attacks", default=",".join(playable))
    p.add_argument("--only", default="attacks,cost")
    p.add_argument("--cost-sizes", default="tiny,20m")
    p.add_argument("--cost-seq", type=int, default=128)
    p.add_argument("--cost-rows", type=int, default=3, help="sequences per client per round")
    p.add_argument("--cost-clients", type=int, default=3)
    p.add_argument("--cost-device", default="cpu")
    p.add_argument("--cost-rounds", type=int, default=6)
    p.add_argument("--cost-distro", default="16,8", help="DisTrO chunk,top-k of the cost rounds")
    p.add_argument("--cost-optimizers", default="distro,sparse")
    p.add_argument(
        "--outlier",
        default="shipped",
        help='DisTrO\'s outlier test when defended: "shipped" (DISTRO_SCREENING), "off", or '
        '"share,consensus_gate,update_gate,outliers,rounds" (OutlierTest)',
    )
    p.add_argument("--cases", default=",".join(CASES), help="--only honest-cases: which")
    p.add_argument("--record", help="append every outlier judgement to this file (JSON lines)")
    args = p.parse_args()
    if args.record:
        RECORD.install(args.record)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    only = set(args.only.split(","))
    if "cost" in only:
        chunk, topk = (int(x) for x in args.cost_distro.split(","))
        bench_cost(
            args.cost_sizes.split(","), args.cost_clients, args.cost_rows, args.cost_seq,
            args.cost_rounds, args.cost_device,
            (chunk, topk),
            args.cost_optimizers.split(","),
        )  # fmt: skip
    if "attacks" in only:
        bench_attacks(args)
    if "honest-cases" in only:
        bench_honest_cases(args)


CASES = {
    "other-data": Case("other-data", other_chain=frozenset({1})),
    "mixed-data": Case("mixed-data", other_chain=frozenset(range(1, 8))),
    "joiner": Case("joiner", joiner=1),
    "frame": Case("frame", frame=True),
}
"""`--only honest-cases`: one member on another bigram chain; every member on its own chain
(the first on the run's); a member back with a fresh momentum at a third of the run, new to
every witness; the last two members of the run framing the first (`Frame`, 2 of 8 only: in a
run of four their results would be a third of the round)."""


_OUTLIER_REFUSAL = "open rounds here"
"""How `WitnessScreen._outlier_problem`'s refusals end."""


def bench_honest_cases(args: argparse.Namespace) -> None:
    """DisTrO's honest members in harder runs than the attack suite's (`CASES`), defended:
    their results checked by honest witnesses and how many were refused (the goal: none),
    and an honest member's held-out loss against the same run undefended."""
    runner = Runner(args)
    print(
        f"\n## DisTrO 1-bit c16 k4, honest cases, {args.steps} steps; outlier test "
        f"{runner.distro_screening.consensus_outlier}"
    )
    checks = refused = by_outlier = 0
    for setup in args.setups.split(","):
        n, _ = SETUPS[setup]
        for name in args.cases.split(","):
            case = CASES[name]
            if case.frame and n < 8:
                continue
            plain, guarded = (
                runner.run("distro", list(range(n)), None, defended=d, case=case)
                for d in (False, True)
            )
            tally = guarded.tally
            assert tally is not None
            checks += tally.honest_checks
            refused += tally.honest_refused
            outliers = sum(_OUTLIER_REFUSAL in p for p in tally.refusals)
            by_outlier += outliers
            print(
                f"  {n} members, {name:<11} honest checks {tally.honest_checks:5d}, refused "
                f"{tally.honest_refused:3d} ({outliers} by the outlier test), lowest t "
                f"{tally.lowest_honest_agreement:6.2f}; "
                f"loss undefended {plain.loss:.4f}, defended {guarded.loss:.4f} "
                f"({guarded.loss / plain.loss - 1:+.2%})"
            )
            for problem in tally.refusals[:3]:
                print(f"      refused: {problem}")
    print(
        f"honest cases: {refused} of {checks} honest checks refused, {by_outlier} by the "
        f"outlier test"
    )


def bench_attacks(args: argparse.Namespace) -> None:
    attacks = [Attack(name) for name in args.attacks.split(",")]
    runner = Runner(args)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}; tiny Llama, "
        f"{args.steps} steps, {args.rows_per_member}x{args.seq} tokens per member per step, "
        f"cosine LR (DisTrO {args.distro_lr:g}, DiLoCo inner {args.diloco_lr:g}, "
        f"{args.inner_steps} inner steps, outer 0.7/0.5 Nesterov)"
    )
    total_honest_checks = total_honest_refused = 0
    summary: list[tuple[str, str, str, float, float, int]] = []
    for optimizer in args.optimizers.split(","):
        for setup in args.setups.split(","):
            n, bad = SETUPS[setup]
            everyone = list(range(n))
            hostile_at = list(range(n - bad, n))
            print(f"\n## {OPTIMIZERS[optimizer]}, {bad} hostile of {n}")
            base = runner.run(optimizer, everyone[: n - bad], None, defended=False)
            print(f"  {'honest only':<34} loss {base.loss:.4f}  ({base.seconds:.0f} s)")
            plain = runner.run(optimizer, everyone, None, defended=False)
            guarded = runner.run(optimizer, everyone, None, defended=True)
            tally = guarded.tally
            assert tally is not None
            total_honest_checks += tally.honest_checks
            total_honest_refused += tally.honest_refused
            print(
                f"  {'all honest, undefended':<34} loss {plain.loss:.4f} {plain.loss / base.loss - 1:+7.2%}"
            )
            print(
                f"  {'all honest, defended':<34} loss {guarded.loss:.4f} "
                f"{guarded.loss / base.loss - 1:+7.2%}  (vs undefended {guarded.loss / plain.loss - 1:+.4%}); "
                f"honest checks {tally.honest_checks}, refused {tally.honest_refused}, lowest "
                f"agreement {tally.lowest_honest_agreement:.2f}; screening "
                f"{guarded.screen_seconds / n / guarded.seconds:.2%} of a member's time"
            )
            for problem in tally.refusals[:3]:
                print(f"      refused: {problem}")
            for attack in attacks:
                open_run, shut = (
                    runner.run(
                        optimizer,
                        everyone,
                        {p: HostileMember(attack, seed=p) for p in hostile_at},  # fresh each run
                        defended=defended,
                    )
                    for defended in (False, True)
                )
                tally = shut.tally
                assert tally is not None
                ratio_open = open_run.loss / base.loss - 1
                ratio_shut = shut.loss / base.loss - 1
                verdict = "ok" if ratio_shut <= GOAL_LOSS else "MISSED"
                print(
                    f"  {attack.value:<14} undefended {open_run.loss:.4f} {ratio_open:+8.2%}   "
                    f"defended {shut.loss:.4f} {ratio_shut:+7.2%} {verdict:<6}  lies applied "
                    f"{shut.lies_applied} of {shut.lies} (undefended {open_run.lies_applied}), "
                    f"honest refused {tally.honest_refused}/{tally.honest_checks}"
                )
                total_honest_checks += tally.honest_checks
                total_honest_refused += tally.honest_refused
                summary.append(
                    (optimizer, setup, attack.value, ratio_open, ratio_shut, shut.lies_applied)
                )
    print(
        f"\nhonest results refused: {total_honest_refused} of {total_honest_checks} checks "
        f"(goal 0 of >= 2000)"
    )
    missed = [s for s in summary if s[4] > GOAL_LOSS]
    print(
        f"attacks within {GOAL_LOSS:.0%} of honest-only, defended: {len(summary) - len(missed)} of {len(summary)}"
    )
    for optimizer, setup, attack, _, shut, _ in missed:
        print(f"  missed: {optimizer} {setup} {attack}: {shut:+.2%}")


if __name__ == "__main__":
    main()
