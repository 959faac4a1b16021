"""The witness checks' cost before and after a change, in one sitting: `psyche.modeling.screening`
as it is in the working tree against the same module at a git revision (`--baseline`), each
checking the same results of the same rounds (their order alternating), beside the round's
training and apply measured in the same run (CPU time of the process: on a loaded machine wall
time measures the neighbours).

One witness of `--clients` (its own update, `clients - 1` checks of the peer's result, each
sender's with a tenth of its signs flipped (`_variant`: no copies), the votes
settled as the client casts them, `RoundScreen.settle`: a round's held checks judged as a whole,
the round closed), 20M Llama, DisTrO c16 k8, 3 rows of 128 tokens per client per round, the configs'
`Trainer`s (scripts/bench/poison.py's cost rounds). Prints each module's median checks a round
as a share of the round's training and apply, their ratio, and each round's `t` and verdict from
both (the change may move low bits of `t`; the verdicts should match), and what a witness's
first round without an update of its own costs to judge as a whole (`RoundScreen.judge`).
`--profile`: where the working tree's checks spend their CPU time, function by function (the
profiler's overhead counts in the working tree's time: take the ratio from a run without it).

    .venv/bin/python scripts/bench/screening_ab.py --baseline beb03b0 --rounds 6
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import importlib.util
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from psyche.modeling import screening
from psyche.modeling.configs import llama_config_dict
from psyche.modeling.distro import DistroResult

sys.path.insert(0, str(Path(__file__).parent))
import poison  # scripts/bench/poison.py: the cost rounds' trainers

MODULE = "packages/psyche-modeling/src/psyche/modeling/screening.py"


def _module_at(revision: str, folder: Path) -> ModuleType:
    """The screening module as it is at `revision`, imported under another name."""
    root = Path(__file__).resolve().parents[2]
    source = subprocess.run(
        ["git", "show", f"{revision}:{MODULE}"], cwd=root, capture_output=True, text=True
    )
    if source.returncode != 0:
        raise SystemExit(f"cannot read {MODULE} at {revision}: {source.stderr.strip()}")
    path = folder / "screening_baseline.py"
    path.write_text(source.stdout)
    spec = importlib.util.spec_from_file_location("screening_baseline", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _variant(results: list[DistroResult], seed: int) -> list[DistroResult]:
    """The peer's result with a tenth of its signs flipped (seeded): one result per sender
    that is no copy of another (the copy check would refuse the same result sent twice, and a
    round's judgement sums only results that passed), as cheap to make as a copy."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in results:
        v = r.sparse_val
        flip = torch.rand(v.shape, generator=g) < 0.1
        val = v ^ flip if v.dtype == torch.bool else torch.where(flip, -v, v)
        out.append(dataclasses.replace(r, sparse_val=val))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--baseline", default="HEAD", help="git revision of the module to compare with")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--size", default="20m")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument(
        "--profile",
        action="store_true",
        help="print where the working tree's checks spend their time (cProfile; skews the ratio)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        modules = {"baseline": _module_at(args.baseline, Path(folder)), "now": screening}
        run(modules, args.size, args.clients, args.rounds, args.profile)


def run(
    modules: dict[str, ModuleType], size: str, clients: int, rounds: int, profile: bool = False
) -> None:
    own, peer = (poison._cost_trainer(size, "distro") for _ in range(2))
    own.screening_reader()
    optimizer = own.distro
    assert optimizer is not None
    screens = {
        name: m.WitnessScreen(m.ResultReader.of(optimizer), m.DISTRO_SCREENING)
        for name, m in modules.items()
    }
    rows = 3
    data = poison.D.bigram_corpus(2 * rounds * rows, 128, llama_config_dict(size)["vocab_size"])
    prev: dict[int, list[list[DistroResult]]] = {0: [], 1: []}
    train: list[float] = []
    apply: list[float] = []
    checks: dict[str, list[float]] = {name: [] for name in modules}
    verdicts: list[dict[str, list[tuple[float, bool]]]] = []
    profiler = cProfile.Profile(time.process_time) if profile else None
    for step in range(1, rounds + 1):
        seconds, reference, sent = poison.cost_round((own, peer), data, rows, step, prev)
        train.append(seconds)
        peers = [sent[1], *(_variant(sent[1], step * clients + k) for k in range(2, clients))]
        seen = {}
        for name in sorted(modules, reverse=step % 2 == 0):
            m = modules[name]
            if profiler is not None and name == "now":
                profiler.enable()
            t = time.process_time()
            rnd = screens[name].open_round()
            fields = {f.name for f in dataclasses.fields(m.Reference)}  # the baseline's
            rnd.set_reference(
                m.Reference(**{k: v for k, v in vars(reference).items() if k in fields}), sent[0]
            )
            checked = {sender: rnd.check(sender, peers[sender - 1]) for sender in range(1, clients)}
            # the votes as the client casts them: held ones by the round's judgement
            got = list(rnd.settle(checked).values())
            rnd.close()
            checks[name].append(time.process_time() - t)
            if profiler is not None:
                profiler.disable()
            seen[name] = [(v.measure.agreement, v.passed) for v in got]
        verdicts.append(seen)
        t = time.process_time()
        own.optimize(step, distro_results=[sent[0]] + [sent[1]] * (clients - 1))
        apply.append(time.process_time() - t)
    tr, ap = (statistics.median(x) * 1000 for x in (train, apply))
    base, now = (statistics.median(checks[name]) * 1000 for name in ("baseline", "now"))
    print(
        f"{size} DisTrO c16 k8, {clients} clients ({clients - 1} checks a round), {rounds} rounds, "
        f"median CPU ms: training {tr:.1f}, apply {ap:.1f}; checks: baseline {base:.1f} "
        f"({base / (tr + ap):.2%} of training and apply), now {now:.1f} ({now / (tr + ap):.2%}); "
        f"now / baseline {now / base:.3f}"
    )
    same = 0
    for step, seen in enumerate(verdicts, 1):
        pairs = list(zip(seen["baseline"], seen["now"]))
        same += all(a[1] == b[1] for a, b in pairs)
        shown = ", ".join(f"t {a[0]:.4f} / {b[0]:.4f} {a[1]}/{b[1]}" for a, b in pairs)
        print(f"  round {step}: {shown}")
    print(f"rounds with every verdict the same: {same} of {len(verdicts)}")
    m = modules["now"]
    blind = m.WitnessScreen(m.ResultReader.of(optimizer), m.DISTRO_SCREENING).open_round()
    for sender, results in enumerate(sent):
        blind.check(sender, results)
    t = time.process_time()
    blind.judge()
    print(
        f"a witness's first round without an update of its own, its {len(sent)} results judged as "
        f"a whole (RoundScreen.judge, one model-sized sum): {(time.process_time() - t) * 1000:.1f} "
        "CPU ms (made in a worker thread: psyche.client.round.screening.judge_round)"
    )
    if profiler is not None:
        print("where the working tree's checks spend their CPU time (self time, top 15):")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
