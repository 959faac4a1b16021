"""The main job ends by itself: the real local testnet (headless: a `psyche-server` and two
`psyche-client` processes) trains a shortened copy of the tiny run to `Finished`; every process
exits 0 on its own, nothing logs an error or a traceback, each client prints one progress line
per step, and the final model lands where the summary says, loadable by `transformers`."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ..timing import scaled
from .conftest import TINY

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

TOTAL_STEPS = 10
PROGRESS = re.compile(
    r"^\[client-(\d)\] [\d:.]+ INFO  psyche\.client\.round\.steps: "
    r"step (\d+)/(\d+) \(epoch (\d+)\): "
    r"(?:loss [\d.]+|no batch this round)(?:, [\d,]+ tok/s)?(?:, about \w+ left)?$",
    re.MULTILINE,
)


def shortened_tiny_run(tiny_run: Callable[..., Path]) -> Path:
    """The tiny run with `TOTAL_STEPS` steps, short epochs, and the model's path made absolute
    (the processes run in the test's directory, where `./checkpoints` then lands)."""
    config = tiny_run(epoch_time=15)
    state = config / "state.toml"
    text, count = re.subn(
        r"(?m)^total_steps = 200$", f"total_steps = {TOTAL_STEPS}", state.read_text()
    )
    assert count == 2  # the run's and the learning-rate schedule's
    text = text.replace('repo_id = "configs/tiny-cpu/model"', f'repo_id = "{TINY / "model"}"')
    state.write_text(text)
    return config


def test_the_testnet_ends_by_itself_with_the_final_model(
    tiny_run: Callable[..., Path], processes: Any, free_port: Callable[[], int], tmp_path: Path
) -> None:
    config = shortened_tiny_run(tiny_run)
    testnet = processes.start(
        "testnet",
        [sys.executable, "-m", "psyche.cli.local_testnet", "start", "--num-clients", "2",
         "--config-path", str(config), "--headless", "--server-port", str(free_port())],
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        cwd=tmp_path,
    )  # fmt: skip
    # generous: two clients import torch, load and train on a busy 2-core machine
    code = testnet.popen.wait(timeout=scaled(420))
    text = testnet.text()
    assert code == 0, text[-6000:]
    for name in ("server", "client-1", "client-2"):
        assert f"[{name}] exited with code 0" in text, text[-6000:]
    assert "ERROR" not in text, text[-6000:]
    assert "Traceback" not in text, text[-6000:]
    assert " DEBUG " not in text  # debug logging only when asked for

    # one progress line per trained step from each client, steps counting up to the total
    progress: dict[int, list[int]] = {1: [], 2: []}
    for client, step, total, _epoch in (m.groups()[:4] for m in PROGRESS.finditer(text)):
        assert int(total) == TOTAL_STEPS
        progress[int(client)].append(int(step))
    for client, steps in progress.items():
        assert steps, f"client-{client} printed no progress line:\n{text[-6000:]}"
        assert steps == sorted(set(steps)), steps  # once per step, in order
        assert steps[-1] == TOTAL_STEPS - 1, steps  # the last step the run trains

    # both end with the same model: the last cooldown's hash, as each logged it
    finals = {
        client: re.findall(
            rf"^\[client-{client}\] .*: epoch (\d+) ended at step (\d+): model hash (\w+)$",
            text,
            re.MULTILINE,
        )[-1:]
        for client in (1, 2)
    }
    assert finals[1], finals
    assert finals[1] == finals[2], finals

    # each client's summary; the first one names the model's directory
    summaries = dict(re.findall(r"^\[client-(\d)\] .*: (run 'tiny-cpu' finished .*)$", text, re.M))
    assert set(summaries) == {"1", "2"}, text[-6000:]
    assert summaries["2"].endswith("model not saved (no --checkpoint-dir)")
    saved = re.search(r"; model saved to (\S+)$", summaries["1"])
    assert saved, summaries["1"]
    model_dir = Path(saved.group(1))
    assert model_dir == tmp_path / "checkpoints" / f"tiny-cpu-step{TOTAL_STEPS - 1}"
    assert re.search(rf"finished at step {TOTAL_STEPS} of {TOTAL_STEPS} \(\d+ epochs?, "
                     r"final loss [\d.]+, [\d,]+ tok/s overall, \w+ in all\)", summaries["1"])  # fmt: skip
    last = text.strip().splitlines()[-1]
    assert last.startswith("[testnet] done in "), last
    assert str(tmp_path / "checkpoints") in last, last

    import torch
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape[:2] == (1, 4)
    assert torch.isfinite(logits).all()
