"""Evaluations on a client whose rank 0 holds only part of the model (TP, FSDP): rank 0 keeps a
whole replica (`LeaderTrainer.keep_replica`), gathered after every apply, and evaluates on it
alone as a one-rank client evaluates its model (tests/client/workers_leader.py `replica`, real
worker processes over gloo):

* FSDP2 over 2 ranks: after a step and its apply the replica holds the ranks' parameters bit
  for bit, and its forward pass gives the one-rank client's logits bit for bit (FSDP=2's
  parameters are the one-rank bits);
* TP=2: the replica holds the ranks' gathered parameters bit for bit and computes what a
  one-rank model holding them computes (TP's training is close to one rank, not equal);
* the ranks train on in step after the replica's forward pass: the next step's loss is the
  one-rank client's (bit for bit with FSDP=2, to rounding with TP=2).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .leaders import LEADER

pytestmark = [pytest.mark.slow]


@pytest.mark.parametrize("how", ["fsdp", "tp"])
def test_rank_0_evaluates_a_gathered_replica_with_the_ranks_bits(model_dir: Path, how: str) -> None:
    done = subprocess.run(
        [sys.executable, str(LEADER), "replica", str(model_dir), how],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert lines.get("REPLICA_EQUAL") == "True", done.stdout
    assert lines.get("EVAL_EQUAL") == "True", done.stdout
    ranks, single = map(float, lines["NEXT_LOSS"].split())
    if how == "fsdp":
        assert ranks == single
    else:
        assert ranks == pytest.approx(single, rel=1e-6)
