"""A witness of a client of two ranks (replicated DP=2, FSDP2) decides as a one-rank witness does.

In a client of several ranks only rank 0 checks results (`psyche.client.round.screening`): its
`WitnessScreen` reads rank 0's trainer, whose reference is the round's full update
(`Trainer.screening_reference`: DisTrO's momentum DCT, which `generate` gathers on every rank;
DiLoCo's pseudo-gradient plus residual, gathered the same way under FSDP), never a shard. Two
gloo processes run `scripts/bench/honest_checks.py` small: four members, each a two-rank client
with a one-rank twin on the same rows, the last one hostile (sign flip, `psyche.modeling.hostile`
through `make_hostile`, as a client's trainer is made hostile); every member witnesses every
other. Every check's `t`, norm and verdict, and every payload, must be the twin's to the bit.

FSDP with DiLoCo crashed at the end of every round before this test (`Diloco.end_round` encoded
a sharded residual: "mixed torch.Tensor and DTensor"); it now gathers it first, as DisTrO
gathers its momentum, and steps each rank's slice of the mean.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Separate rank processes for a minute or more: run beside the other whole-system files (the
# e2e phase's workers mostly wait on round timers), not in the unit phase.
pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "scripts" / "bench" / "honest_checks.py"


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    report = tmp_path_factory.mktemp("witness") / "report.json"
    args = ["--members", "4", "--rounds", "3", "--modes", "dp,fsdp"]
    args += ["--optimizers", "distro,bf16", "--hostile", "sign-flip", "--timeout", "800"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *args, "--report", str(report)],
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    loaded: dict[str, dict] = json.loads(report.read_text())
    return loaded


@pytest.mark.parametrize("case", ["dp/distro", "dp/bf16", "fsdp/distro", "fsdp/bf16"])
def test_a_two_rank_witness_decides_as_a_one_rank_witness(
    figures: dict[str, dict], case: str
) -> None:
    f = figures[case]
    assert f["rounds"] == 3
    assert f["checks"] == 3 * 3 * 2  # 3 honest witnesses x 2 honest others x 3 rounds
    assert f["refused"] == 0, f["refusals"]
    assert f["twin_differs"] == 0  # every t, norm and verdict of the honest and hostile checks
    assert f["payloads_differ"] == 0
    assert f["params_equal"] is True
    # the hostile member's sign flips: 3 honest witnesses x 3 rounds, refused by both alike
    assert f["hostile_checks"] == 9
    assert f["hostile_refused"] == f["hostile_refused_by_twins"]
    # a witness's first round holds its votes for the round's judgement (`RoundScreen.judge`,
    # levels from the round's other results; the bench votes by `RoundScreen.settle`, as the
    # client's `settle_blind_votes`): a DiLoCo sign flip is refused from round 1 and never
    # applied. A 1-bit DisTrO result's own `t` is noisier (honest ones 3.6 to 7.6 at one
    # witness in round 1): a flip of a weakly aligned update (`t` -1.3) is within the honest
    # spread there, so DisTrO's lies are refused from round 2 on (levels of closed rounds)
    first = 1 if case.endswith("bf16") else 2
    assert [r for r in f["hostile_passed_rounds"] if r >= first] == []
    if first == 1:
        assert f["hostile_refused"] == f["hostile_checks"]
        assert f["hostile_applied"] == 0
    assert f["hostile_refused"] >= 7
