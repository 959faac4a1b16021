"""Honest result checks by witnesses of several ranks: a DP=2 or FSDP=2 client's witness against
a one-rank client's on the same results, with every member honest (issue 25's goal: no honest
result refused over at least 2,000 honest checks, one rank and DP/FSDP ranks).

Two gloo processes (one torch thread each). Every member of a simulated run of `--members` is a
client of two ranks (replicated DP, or FSDP2) training a tiny Llama on its own share of a
synthetic bigram corpus; rank 0 also runs each member's one-rank twin on the same rows. Each
round, as the client does it (`psyche.client.round.train` / `screening`): `train_exact`, the
payload (`prepare_result`, its commitment hash), the witness's own update of the round
(`screening_reference`: on rank 0 only, the full momentum's DCT for DisTrO, which `generate`
gathers on every rank; DiLoCo's pseudo-gradient plus residual); every payload goes through its
bytes and the receiver's checks (`results_from_payload`); every member witnesses every other
member's result with its `WitnessScreen` (the two-rank member's, and separately its twin's),
and votes as the client does: a held check's vote (a witness's first round, or one without an
update of its own) by the round's judgement (`RoundScreen.settle`, as `settle_blind_votes`),
its own result and a hostile member's every vote counted as the client's blooms count them;
the results a quorum vouched for are applied by every rank (rank 1 gets the aggregate as a
worker gets `optimize`'s arguments) and by the twins. A held check's margin is printed against
`min_agreement` (its level is the round's, not read here).

Rank 1 runs the calls `psyche.modeling.distributed.serve` runs on command, in the same order
(one worker process per member would need one process group each). Printed per layout and
optimizer: the two-rank witnesses' honest checks, how many they refused, the lowest `t` and its
margin to the threshold it was judged by (`min_agreement`, or the relative level), the widest
norm ratio against the witness's own (the bound is 8x either way), and whether every `t`, norm
and verdict equals the one-rank twin's to the bit, every payload's bytes and the parameters at
the end too.

    .venv/bin/python scripts/bench/honest_checks.py --rounds 30 --members 8
    .venv/bin/python scripts/bench/honest_checks.py --modes fsdp --optimizers bf16 --rounds 4

No downloads: random-init Llama configs and a synthetic corpus. The twins double rank 0's
training; the figure counts checks, not time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from psyche.modeling.hostile import Attack

sys.path.insert(0, str(Path(__file__).parent))
import poison as bench_poison  # scripts/bench/poison.py: its DiLoCo settings and schedule

D = bench_poison.D
OPTIMIZERS = bench_poison.OPTIMIZERS
MODES = ("dp", "fsdp")


@dataclass
class Figures:
    """What one layout and optimizer gave (rank 0's view)."""

    checks: int = 0
    refused: int = 0
    refusals: list[str] = field(default_factory=list)
    lowest_t: float = math.inf
    lowest_margin: float = math.inf
    widest_norm_ratio: float = 1.0
    twin_differs: int = 0
    """Checks whose `t`, norm or verdict differ from the one-rank twin's."""
    hostile_checks: int = 0
    hostile_refused: int = 0
    """The hostile member's results (`--hostile`) the two-rank witnesses refused."""
    hostile_refused_by_twins: int = 0
    hostile_passed_rounds: list[int] = field(default_factory=list)
    """The round (from 1) of each check a two-rank witness let the hostile result pass."""
    hostile_applied: int = 0
    """Rounds whose applied set held the hostile member's result."""
    payloads_differ: int = 0
    params_equal: bool = False
    rounds: int = 0
    seconds: float = 0.0


def _definition(name: str, args: argparse.Namespace) -> Any:
    from psyche.core.definitions import OptimizerDefinition
    from psyche.modeling.research import DistroSettings

    if name == "distro":
        settings = DistroSettings(compression_chunk=16, compression_topk=4, clip_grad_norm=1.0)
        return OptimizerDefinition.Distro(settings.definition())
    diloco = bench_poison._diloco_settings(name, args.inner_steps, bounded=True)
    return OptimizerDefinition.DiLoCo(diloco.definition())


def _trainer(name: str, args: argparse.Namespace, dims: Any) -> Any:
    """A member's trainer: the tiny Llama (seed 1337, as every client's init), laid out by
    `dims` (None: one rank), micro-batches of one row."""
    from psyche.modeling.sharding import ShardingOptions, parallelize
    from psyche.modeling.trainer import Trainer

    model = D.build("tiny", "cpu")
    if dims is not None:
        model = parallelize(model, dims, ShardingOptions())
    lr = args.distro_lr if name == "distro" else args.diloco_lr
    schedule = bench_poison._schedule(lr, args.rounds)
    return Trainer(model, schedule, _definition(name, args), micro_batch_size=1, parallel=dims)


def _threshold(settings: Any, levels: list[float]) -> float:
    """The agreement a result must reach at a witness with an update of its own
    (`WitnessScreen._first_order_problem`: `min_agreement`, and the relative level)."""
    floor = settings.min_agreement
    if settings.relative_agreement is not None and levels:
        a, b = settings.relative_agreement
        floor = max(floor, a * min(levels) - b)
    return float(floor)


def _scenario(rank: int, mode: str, name: str, args: argparse.Namespace) -> Figures | None:
    import torch.distributed as dist

    from psyche.coordinator.consensus import witness_quorum_for
    from psyche.modeling.hostile import HostileMember, make_hostile
    from psyche.modeling.parallel import ParallelDims
    from psyche.modeling.screening import WitnessScreen, screening_settings
    from psyche.modeling.sharding import build_mesh
    from psyche.modeling.trainer import Batch

    started = time.perf_counter()
    dims = ParallelDims(torch.device("cpu"), dp=2, fsdp=mode == "fsdp", rank=rank)
    dims = replace(dims, mesh=build_mesh(dims))
    m = args.members
    vocab = D.build("tiny", "cpu").config.vocab_size
    data = D.bigram_corpus(args.rounds * m * 2, args.seq, vocab)

    def rows(step: int, member: int) -> Batch:
        start = ((step - 1) * m + member) * 2
        return Batch(data[start : start + 2])

    sharded = [_trainer(name, args, dims) for _ in range(m)]
    twins = [_trainer(name, args, None) for _ in range(m)] if rank == 0 else []
    hostile = m - 1 if args.hostile else None
    if hostile is not None and rank == 0:  # what it sends is rank 0's (`prepare_result`)
        for trainer in (sharded[hostile], twins[hostile]):
            make_hostile(trainer, HostileMember(Attack(args.hostile), seed=hostile))
    screens: dict[str, list[WitnessScreen]] = {"sharded": [], "twin": []}
    if rank == 0:
        for kind, trainers in (("sharded", sharded), ("twin", twins)):
            for trainer in trainers:
                reader = trainer.screening_reader()  # rank 0 only, as the client's leader
                screens[kind].append(WitnessScreen(reader, screening_settings(reader)))
    settings = screens["sharded"][0].settings if rank == 0 else None
    quorum = witness_quorum_for(0, m)
    fig = Figures()
    # DisTrO's own results of the previous round (honest, a hostile member's too)
    prev: dict[str, list[list[Any]]] = {
        "sharded": [[] for _ in sharded],
        "twin": [[] for _ in twins],
    }
    for step in range(1, args.rounds + 1):
        outs: dict[str, list[Any]] = {"sharded": [], "twin": []}
        for kind, trainers in (("sharded", sharded), ("twin", twins)):
            for i, trainer in enumerate(trainers):
                outs[kind].append(
                    trainer.train_exact(
                        step,
                        rows(step, i),
                        warmup_lr_between=None,
                        zero_optim=False,
                        prev_self_distro_results=prev[kind][i],
                    )
                )
        aggregate: list[Any] = []
        if rank == 0:
            aggregate = _witness_round(
                step, sharded, twins, outs, screens, settings, quorum, fig, hostile
            )
        box = [aggregate]
        dist.broadcast_object_list(box, src=0)  # a worker's `optimize` arguments
        aggregate = box[0]
        for kind, trainers in (("sharded", sharded), ("twin", twins)):
            for i, trainer in enumerate(trainers):
                trainer.optimize(step, distro_results=aggregate)
                if name == "distro":
                    prev[kind][i] = [outs[kind][i].distro_results]
        fig.rounds += 1
    finals = [t.full_variables() for t in sharded]  # a collective: every rank
    if rank != 0:
        return None
    fig.params_equal = all(
        torch.equal(full[n], p.detach())
        for full, twin in zip(finals, twins)
        for n, p in twin.model.variables()
    )
    fig.seconds = time.perf_counter() - started
    return fig


def _witness_round(
    step: int,
    sharded: list[Any],
    twins: list[Any],
    outs: dict[str, list[Any]],
    screens: dict[str, list[Any]],
    settings: Any,
    quorum: int,
    fig: Figures,
    hostile: int | None,
) -> list[Any]:
    """Rank 0: the round's payloads through their bytes, every member's checks of the others
    (the two-rank witnesses' and the twins'), the applied set's results. The `hostile` member
    vouches for every result (its own checks are not run)."""
    from psyche.core.batch_id import BatchId
    from psyche.modeling.serialized_distro import decode_transmittable

    m = len(sharded)
    sent = {
        kind: [
            t.prepare_result(out, step=step, batch_id=BatchId(i, i))
            for i, (t, out) in enumerate(zip(trainers, outs[kind]))
        ]
        for kind, trainers in (("sharded", sharded), ("twin", twins))
    }
    refs = {
        kind: [t.screening_reference() for t in trainers]
        for kind, trainers in (("sharded", sharded), ("twin", twins))
    }
    fig.payloads_differ += sum(
        a.payload.to_bytes() != b.payload.to_bytes() for a, b in zip(sent["sharded"], sent["twin"])
    )
    received = [
        twins[0].results_from_payload(decode_transmittable(p.payload.to_bytes()))
        for p in sent["sharded"]
    ]
    votes = [0] * m
    for w in range(m):
        if w == hostile:
            votes = [v + 1 for v in votes]
            continue
        votes[w] += 1  # its own result
        rounds = {}
        for kind in ("sharded", "twin"):
            rnd = screens[kind][w].open_round()
            rnd.set_reference(refs[kind][w], sent[kind][w].sent)
            rounds[kind] = rnd
        checked: dict[str, dict[int, Any]] = {"sharded": {}, "twin": {}}
        levels_at: dict[int, list[float]] = {}
        for i in range(m):
            if i == w:
                continue
            # the level this check is judged by (read as `_decide` reads it, before the check)
            levels_at[i] = screens["sharded"][w]._level_list(rounds["sharded"])
            for kind in ("sharded", "twin"):
                checked[kind][i] = rounds[kind].check(i, received[i])
        # the votes as the client casts them: a held check's by the round's judgement
        # (`RoundScreen.settle`, as `psyche.client.round.payloads.settle_blind_votes`)
        settled = {kind: rounds[kind].settle(checked[kind]) for kind in ("sharded", "twin")}
        for i, verdict in settled["sharded"].items():
            twin = settled["twin"][i]
            # a held check's level is the round's (`RoundScreen.judge`), not read here: its
            # margin is to `min_agreement` alone
            levels = levels_at[i]
            t = verdict.measure.agreement
            fig.twin_differs += (
                t != twin.measure.agreement
                or verdict.measure.norm != twin.measure.norm
                or verdict.problem != twin.problem
            )
            if i == hostile:
                fig.hostile_checks += 1
                fig.hostile_refused += not verdict.passed
                fig.hostile_refused_by_twins += not twin.passed
                if verdict.passed:
                    fig.hostile_passed_rounds.append(step)
                votes[i] += verdict.passed
                continue
            fig.checks += 1
            fig.lowest_t = min(fig.lowest_t, t)
            fig.lowest_margin = min(fig.lowest_margin, t - _threshold(settings, levels))
            own_norm = rounds["sharded"].reference.own_norm
            ratio = verdict.measure.norm / own_norm
            fig.widest_norm_ratio = max(fig.widest_norm_ratio, ratio, 1.0 / ratio)
            if verdict.passed:
                votes[i] += 1
            else:
                fig.refused += 1
                fig.refusals.append(f"round {step}, witness {w}, member {i}: {verdict.problem}")
        for rnd in rounds.values():
            rnd.close()
    fig.hostile_applied += hostile is not None and votes[hostile] >= quorum
    return [received[i] for i in range(m) if votes[i] >= quorum]


def rank_main(args: argparse.Namespace) -> None:
    from psyche.modeling.sharding import close_world, init_world

    torch.set_num_threads(1)
    init_world(args.rank, 2, f"file://{args.init}", torch.device("cpu"))
    report: dict[str, dict[str, Any]] = {}
    try:
        for mode in args.modes.split(","):
            for name in args.optimizers.split(","):
                fig = _scenario(args.rank, mode, name, args)
                if fig is not None:
                    report[f"{mode}/{name}"] = fig.__dict__
                    if args.rank == 0:
                        print(f"{mode}/{name}: {json.dumps(fig.__dict__)}", flush=True)
    finally:
        close_world()
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(report))
    os._exit(0)


def two_ranks(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        passed = [*sys.argv[1:], "--init", f"{tmp}/init", "--out", str(out)]
        procs = [
            subprocess.Popen([sys.executable, __file__, *passed, "--rank", str(r)], env=env)
            for r in range(2)
        ]
        deadline = time.monotonic() + args.timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise SystemExit(f"the ranks did not finish in {args.timeout:g} s") from None
        finally:  # on a timeout, an error or SIGINT: the ranks start nothing of their own
            for proc in procs:
                proc.kill()  # nothing for one that has exited
                proc.wait()
        codes = [p.returncode for p in procs]
        if codes != [0, 0]:
            raise SystemExit(f"the ranks exited {codes}")
        report: dict[str, dict[str, Any]] = json.loads(out.read_text())
        return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES), help="dp, fsdp")
    p.add_argument("--optimizers", default="distro,bf16", help=",".join(OPTIMIZERS))
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--inner-steps", type=int, default=4)
    p.add_argument("--distro-lr", type=float, default=1e-2)
    p.add_argument("--diloco-lr", type=float, default=3e-3)
    p.add_argument(
        "--hostile",
        choices=[a.value for a in Attack if a is not Attack.OtherData],
        help="the last member plays this attack (psyche.modeling.hostile)",
    )
    p.add_argument("--report", type=Path, help="also write the figures here as JSON")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--init", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    started = time.perf_counter()
    report = two_ranks(args)
    if args.report is not None:
        args.report.write_text(json.dumps(report))
    print(
        "| layout / optimizer | honest checks | refused | lowest t | lowest margin | "
        "widest norm ratio | t/norm/verdict = one rank | payloads = one rank | params = one rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for key, f in report.items():
        print(
            f"| {key} | {f['checks']} | {f['refused']} | {f['lowest_t']:.2f} | "
            f"{f['lowest_margin']:.2f} | {f['widest_norm_ratio']:.2f} | "
            f"{f['checks'] - f['twin_differs']} of {f['checks']} | "
            f"{'all' if f['payloads_differ'] == 0 else str(f['payloads_differ']) + ' differ'} | "
            f"{f['params_equal']} |"
        )
        for refusal in f["refusals"][:5]:
            print(f"  refused: {refusal}")
        if f["hostile_checks"]:
            print(
                f"  hostile ({args.hostile}): refused {f['hostile_refused']} of "
                f"{f['hostile_checks']} (one-rank twins: {f['hostile_refused_by_twins']}), "
                f"applied in {f['hostile_applied']} of {f['rounds']} rounds"
            )
    total = sum(f["checks"] for f in report.values())
    refused = sum(f["refused"] for f in report.values())
    print(f"{refused} of {total} honest checks refused; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
