"""`scripts/gpu.sh --dry-run`: the one GPU command runs every step at tiny sizes on the CPU, so it
cannot rot between the (rare) sessions that have a GPU. It starts a real centralized run for its
round-overhead section, hence an e2e test."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_script_runs_every_section_at_tiny_sizes(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(REPO / "scripts" / "gpu.sh"), "--dry-run", "--out-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (tmp_path / "gpu-table.md").read_text()
    # every section wrote its row, with figures rather than a failure
    for row in (
        "gpu tests collected (dry run)",
        "matmul 256^3",
        "device-to-device copy",
        "plain forward+backward, tiny",
        "client training step (DisTrO), tiny",
        "DisTrO generate+apply share of the tiny step, per-parameter route (baseline)",
        "DisTrO generate+apply share of the tiny step, batched route",
        "DiLoCo CPU/CUDA bit agreement (dry run)",
        "round overhead, tiny on the CPU (dry run)",
        "witness checks' cost, tiny DisTrO 1-bit c16 k8",
    ):
        assert row in table, table
    assert "the run failed" not in table
    collected = next(line for line in table.splitlines() if "gpu tests collected" in line)
    assert int(collected.split("|")[2]) >= 16  # every gpu-marked test imports and is collected
    assert "3 cases collected" in table
