"""Run chaos scenarios back to back and print their figures (`just chaos`).

    .venv/bin/python scripts/chaos/run.py                  # the 10-minute soak
    .venv/bin/python scripts/chaos/run.py --scenarios all  # every scenario, then the soak
    .venv/bin/python scripts/chaos/run.py --scenarios sigkill,partition --duration 120

The fault-free `baseline` always runs first, in the same sitting and with the same config, so
every scenario's throughput is a ratio against it. Results go to `--out` (JSON, one object per
scenario) and a markdown table is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trio
from scenarios import ScenarioResult, catalogue, run_scenario, run_testnet_scenario

GOAL_LOST = 2
GOAL_RATIO = 0.9
GOAL_REJOIN_ROUNDS = 2


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def table(results: list[ScenarioResult]) -> str:
    head = (
        "| scenario | faults | rounds | epochs | median round s | server CPU s/min | tokens/s "
        "| vs fault-free | lost per departure "
        "| lost (all faults) | rejoin s (rounds waited) | rejoined hash-identical "
        "| models identical | unexpected exits | partial files |"
    )
    rows = [head, "|" + "---|" * 15]
    for r in results:
        rejoin = ", ".join(f"{_fmt(j['seconds'])} ({_fmt(j['rounds_waited'])})" for j in r.rejoins)
        hashes = {j["hash_identical"] for j in r.rejoins}
        rows.append(
            "| "
            + " | ".join(
                [
                    r.name,
                    ", ".join(f"{k} {v}" for k, v in r.fault_counts.items()) or "0",
                    str(r.rounds),
                    str(r.epochs),
                    _fmt(r.round_seconds),
                    _fmt(r.server_cpu_per_min),
                    f"{r.tokens_per_s:.0f}",
                    _fmt(r.throughput_ratio),
                    f"max {max(r.lost_per_departure)}" if r.lost_per_departure else "–",
                    f"{r.lost_total}",
                    rejoin or "–",
                    "–"
                    if not r.rejoins
                    else ("yes" if hashes == {True} else str(sorted(map(str, hashes)))),
                    "yes" if r.models_identical and not r.applied_problems else "NO",
                    str(len(r.unexpected_exits)),
                    str(len(r.partial_files)),
                ]
            )
            + " |"
        )
    return "\n".join(rows)


def goals(results: list[ScenarioResult]) -> list[str]:
    """Which of the issue's goals each scenario missed."""
    missed = []
    for r in results:
        if r.lost_per_departure and max(r.lost_per_departure) > GOAL_LOST:
            missed.append(
                f"{r.name}: {max(r.lost_per_departure)} assignments lost by one departure"
            )
        if r.name == "soak" and r.throughput_ratio is not None and r.throughput_ratio < GOAL_RATIO:
            missed.append(f"{r.name}: throughput {r.throughput_ratio:.2f} of fault-free")
        for j in r.rejoins:
            if j["rounds_waited"] is None or j["rounds_waited"] > GOAL_REJOIN_ROUNDS:
                missed.append(f"{r.name}: {j['client']} rejoin waited {j['rounds_waited']} rounds")
            if j["hash_identical"] is False:
                missed.append(f"{r.name}: {j['client']} rejoined with a different model")
        if not r.models_identical or r.applied_problems:
            missed.append(f"{r.name}: models diverged: {r.model_problems + r.applied_problems}")
        if r.partial_files:
            missed.append(f"{r.name}: partial files {r.partial_files}")
        if r.unexpected_exits:
            missed.append(f"{r.name}: unexpected exits {r.unexpected_exits}")
    return missed


async def main_async(args: argparse.Namespace) -> int:
    scenarios = catalogue(args.duration, args.interval)
    wanted = list(scenarios) if args.scenarios == "all" else args.scenarios.split(",")
    names = ["baseline", *[n for n in wanted if n and n != "baseline"]]
    unknown = [n for n in names if n not in scenarios]
    if unknown:
        print(f"unknown scenarios: {unknown}; known: {sorted(scenarios)}", file=sys.stderr)
        return 2
    workroot = Path(tempfile.mkdtemp(prefix="psyche-chaos-"))
    results: list[ScenarioResult] = []
    baseline_tps = None
    failed: list[str] = []
    for name in names:
        scenario = scenarios[name]
        duration = {"baseline": args.baseline_duration, "soak": args.soak_duration}.get(name)
        if duration:
            scenario = dataclasses.replace(scenario, duration=duration)
        started = time.time()
        print(f"== {name}: {scenario.title} ({scenario.duration:g} s)", flush=True)
        try:
            if name == "testnet-random-kill":
                result = await run_testnet_scenario(
                    scenario, workroot / name, interval=args.interval, seed=args.seed
                )
            else:
                result = await run_scenario(scenario, workroot / name, seed=args.seed)
        except Exception as e:  # one broken scenario must not cost the others' figures
            failed.append(f"{name}: {type(e).__name__}: {e}")
            print(f"   FAILED after {time.time() - started:.0f} s: {failed[-1]}", flush=True)
            continue
        if name == "baseline":
            baseline_tps = result.tokens_per_s
        if baseline_tps:
            result.throughput_ratio = result.tokens_per_s / baseline_tps
        results.append(result)
        print(
            f"   {result.rounds} rounds (median {_fmt(result.round_seconds)} s), server CPU "
            f"{_fmt(result.server_cpu_per_min)} s/min, "
            f"{result.tokens_per_s:.0f} tokens/s "
            f"(ratio {_fmt(result.throughput_ratio)}), faults {result.fault_counts}, "
            f"lost per departure {result.lost_per_departure}, models identical "
            f"{result.models_identical}, {time.time() - started:.0f} s wall",
            flush=True,
        )
    print()
    print(table(results))
    missed = goals(results) + [f"{line} (the scenario did not complete)" for line in failed]
    print()
    print("goals missed:" if missed else "all goals met")
    for line in missed:
        print(f"  - {line}")
    if args.out:
        args.out.write_text(json.dumps([r.to_dict() for r in results], indent=1))
        print(f"results written to {args.out}")
    if args.keep:
        print(f"logs kept in {workroot}")
    else:
        shutil.rmtree(workroot, ignore_errors=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="soak", help="comma-separated (baseline runs first)")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds per scenario")
    parser.add_argument(
        "--soak-duration", type=float, default=600.0, help="seconds of the soak scenario"
    )
    parser.add_argument(
        "--baseline-duration", type=float, default=300.0, help="seconds of the fault-free run"
    )
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between faults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the processes' logs")
    return trio.run(main_async, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
