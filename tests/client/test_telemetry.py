"""What a client reports, end to end in one process: two real clients (real libp2p on
loopback, real training of a tiny Llama) with every local tracker on (a JSONL file and
TensorBoard, read back with TensorBoard's own reader), `--events-dir`, and an evaluation task
scored between rounds from a local dataset file. The per-step metrics are the numbers of the
progress line (one source of truth)."""

from __future__ import annotations

import functools
import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
import trio.testing

from psyche.client.client import Client
from psyche.client.observe.evals import EvalSettings
from psyche.client.observe.event_files import read_event_files
from psyche.client.observe.telemetry import NetworkNumbers, round_metrics
from psyche.client.run import _close_all, run_observers
from psyche.client.setup.model_loading import preload_modeling
from psyche.client.setup.options import TrainOptions
from psyche.client.testing import InProcessServer
from psyche.coordinator import RunState
from psyche.metrics import names
from psyche.modeling.configs import llama_config_dict

from ..timing import scaled_timer
from .in_process import (
    RUN_ID,
    client_parts,
    coordinator,
    identities,
    run_beside_server,
    write_run,
)
from .support import round_report

ROOT = Path(__file__).resolve().parents[2]
PIQA_ROWS = [
    {"goal": f"Do thing {i}", "sol1": f"Way {i}.", "sol2": f"Another way {i}.", "label": i % 2}
    for i in range(4)
]
ARC_ROWS = [
    {
        "id": f"q{i}",
        "question": f"Which one is {i}?",
        "choices": {"text": [f"a {i}", f"b {i}", f"c {i}"], "label": ["A", "B", "C"]},
        "answerKey": "ABC"[i % 3],
    }
    for i in range(6)
]


def test_round_metrics_names_every_number_and_leaves_out_what_a_round_lacks() -> None:
    report = round_report(
        loss=2.0,
        lr=1e-3,
        efficiency=0.5,
        trained=1,
        witness_seconds=0.5,
        network=NetworkNumbers(peers=1, bytes_sent=10, bytes_received=20, bandwidth=3.0),
        eval_scores={"ARC-Easy": 0.5},
    )
    metrics = round_metrics(report)
    assert metrics[names.TRAIN_LOSS] == 2.0
    assert metrics[names.TRAIN_PERPLEXITY] == pytest.approx(math.exp(2.0))
    assert metrics[names.TRAIN_LR] == 1e-3
    assert metrics[names.ROUND_WITNESS_SECONDS] == 0.5
    assert metrics[names.P2P_DOWNLOAD_BYTES] == 20
    assert metrics[names.P2P_UPLOAD_BYTES] == 10
    assert metrics["eval/arc_easy"] == 0.5
    assert names.TRAIN_TOKENS_PER_SEC not in metrics  # no rate yet: not logged as 0
    assert names.ROUND_DOWNLOAD_SECONDS not in metrics


def test_a_partial_evaluation_reaches_the_trackers_under_its_own_name() -> None:
    """Issue 24, item 13: a score over fewer documents than its task holds (a task cut short by
    `--eval-task-max-docs`, or a pass not complete) is `eval_partial/<task>`, never
    `eval/<task>`; OpenTelemetry records it with `partial="true"`. Before, it was logged as the
    task's full score."""
    report = round_report(eval_scores={"ARC-Easy": 0.5, "PIQA": 0.25}, eval_partial=("PIQA",))
    metrics = round_metrics(report)
    assert metrics["eval/arc_easy"] == 0.5
    assert metrics["eval_partial/piqa"] == 0.25
    assert "eval/piqa" not in metrics
    instrument = names.otel_instrument("eval_partial/piqa")
    assert instrument.name == "psyche_eval_metrics"
    assert instrument.attributes == {"metric": "piqa", "partial": "true"}


class FakeEvals:
    def __init__(self) -> None:
        self.taken = 0

    def scores(self) -> dict[str, float]:
        return {f"a task with a very long name number {i}": i / 10 for i in range(10)}

    def prompt_results(self) -> tuple[list[int], int]:
        self.taken += 1
        return list(range(20)), 3


def test_witness_metadata_carries_eval_scores_and_prompt_tokens_within_upstreams_bounds() -> None:
    from psyche.client.observe.stats import StatsLogger
    from psyche.coordinator.run_state import WitnessMetadata
    from psyche.coordinator.testing import quick_coordinator
    from psyche.core.serde import from_bytes, to_bytes

    evals = FakeEvals()
    metadata = StatsLogger(evals=evals).witness_metadata(quick_coordinator())
    assert len(metadata.evals) == 8  # upstream's FixedVec<_, 8>: the rest are left out
    assert all(len(e.name.encode()) <= 32 for e in metadata.evals)
    assert metadata.evals[1].value == pytest.approx(0.1)
    assert metadata.prompt_results == list(range(4, 20))
    assert metadata.prompt_index == 3
    assert evals.taken == 1
    decoded = from_bytes(to_bytes(metadata), WitnessMetadata)  # fits the wire format
    assert decoded.prompt_index == 3
    assert len(decoded.evals) == 8


async def run_client(
    server: InProcessServer, number: int, options: TrainOptions
) -> tuple[Client, list[Any]]:
    (identity,) = identities(number)
    observers, closers = run_observers(options, identity, "psyche-test-client")
    evals = await trio.to_thread.run_sync(EvalSettings.from_options, options.evals)
    try:
        async with client_parts(server, number) as parts:
            client = Client(*parts, observers=observers, evals=evals)
            await client.run()
    finally:
        _close_all(closers)
    return client, closers


@pytest.mark.usefixtures("single_thread")
def test_a_run_logs_each_round_to_every_tracker_and_scores_evals_between_rounds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ..modeling.eval_support import write_rows

    caplog.set_level(logging.INFO, logger="psyche")
    preload_modeling()
    model_dir, data_dir = write_run(tmp_path)
    # the tiny run's tokenizer, so that the evaluation can tokenize its documents
    (model_dir / "config.json").write_text(json.dumps(llama_config_dict("tiny", vocab_size=512)))
    shutil.copy(ROOT / "configs" / "tiny-cpu" / "model" / "tokenizer.json", model_dir)
    evals_dir = tmp_path / "evals"
    write_rows(evals_dir, "ybisk/piqa", "plain_text", "validation", PIQA_ROWS)
    write_rows(evals_dir, "ybisk/piqa", "plain_text", "train", PIQA_ROWS)
    write_rows(evals_dir, "allenai/ai2_arc", "ARC-Easy", "test", ARC_ROWS)
    write_rows(evals_dir, "allenai/ai2_arc", "ARC-Easy", "train", ARC_ROWS)
    state = coordinator(model_dir, data_dir)
    state.config.total_steps = 4
    state.config.warmup_time = scaled_timer(2)
    server = InProcessServer(state)
    clients: dict[int, Client] = {}

    def options(number: int) -> TrainOptions:
        out = tmp_path / f"client-{number}"
        return TrainOptions(
            run_id=RUN_ID,
            metrics_jsonl=out / "metrics.jsonl",
            tensorboard_dir=out / "tb" if number == 1 else None,
            events_dir=out / "events",
            eval_tasks="piqa,arc_easy" if number == 1 else None,
            eval_data_dir=evals_dir if number == 1 else None,
            prompt_task=number == 1,
        )

    async def one(number: int) -> None:
        clients[number], _ = await run_client(server, number, options(number))

    run_beside_server(server, 150, functools.partial(one, 1), functools.partial(one, 2))
    assert server.coordinator.run_state is RunState.Finished
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text

    # the progress lines' numbers are the trackers' numbers
    progress = {
        (r.psyche_fields["client_id"], r.psyche_fields["step"]): r.psyche_fields
        for r in caplog.records
        if r.getMessage() == "client_loss"
    }
    for number, client in clients.items():
        lines = (tmp_path / f"client-{number}" / "metrics.jsonl").read_text().splitlines()
        logged = [e for e in map(json.loads, lines) if e["kind"] == "log"]
        assert logged, lines
        trained = [e for e in logged if names.TRAIN_LOSS in e["values"]]
        assert trained
        for entry in trained:
            values = entry["values"]
            line = progress[(str(client.identity), entry["step"])]
            assert values[names.TRAIN_LOSS] == pytest.approx(line["loss"])
            assert values[names.TRAIN_LR] == pytest.approx(3e-3)
            assert values[names.ROUND_TRAIN_SECONDS] > 0
            assert values[names.P2P_PEERS] >= 1
        events = read_event_files(tmp_path / f"client-{number}" / "events" / str(client.identity))
        kinds = [e["event"] for e in events]
        assert kinds[0] == "run_started"
        assert kinds[-1] == "finished"
        assert "state_changed" in kinds
        assert "round" in kinds
        rounds = [e for e in events if e["event"] == "round"]
        assert [e["step"] for e in rounds] == sorted(e["step"] for e in rounds)
        assert any(e["network"]["bytes_received"] > 0 for e in rounds)

    # the evaluation ran between rounds on client 1 and its score reached the trackers
    worker = clients[1].machine.evals  # type: ignore[union-attr]
    assert worker is not None
    assert worker.slices > 0
    assert worker.documents >= 10
    assert worker.runner is not None
    assert worker.runner.prompt is not None
    assert worker.prompt_tokens > 0  # the prompt task generated between rounds too
    lines = (tmp_path / "client-1" / "metrics.jsonl").read_text().splitlines()
    logged = [e["values"] for e in map(json.loads, lines) if e["kind"] == "log"]
    # each full score is a share of the task's documents (4 and 6 here), as a hand count
    # gives; one before the first whole pass is logged as partial, never as the task's
    for task, count in (("PIQA", 4), ("ARC-Easy", 6)):
        scores = [v[names.eval_key(task)] for v in logged if names.eval_key(task) in v]
        assert scores, (task, scores)
        assert all(abs(s * count - round(s * count)) < 1e-6 for s in scores), (task, scores)
        assert all(0 <= s <= 1 for s in scores), (task, scores)
        partial = [v for v in logged if names.eval_key(task, partial=True) in v]
        first_full = next(i for i, v in enumerate(logged) if names.eval_key(task) in v)
        assert all(logged.index(v) < first_full for v in partial), task
    score_key = names.eval_key("PIQA")
    accumulator = EventAccumulator(str(tmp_path / "client-1" / "tb"))
    accumulator.Reload()
    assert names.TRAIN_LOSS in accumulator.Tags()["scalars"]
    assert score_key in accumulator.Tags()["scalars"]


def test_a_long_wait_logs_its_progress_and_a_short_one_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from types import SimpleNamespace

    from psyche.client.observe.progress import log_progress, model_download_progress

    parameters: dict[str, Any] = {"a": None, "b": None}
    download = SimpleNamespace(model=SimpleNamespace(parameters=None))
    logger = logging.getLogger("test.progress")
    caplog.set_level(logging.INFO, logger="test.progress")

    async def wait(seconds: float) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(log_progress, logger, lambda: model_download_progress(download))
            await trio.sleep(seconds)
            if seconds > 6:
                download.model.parameters = parameters
                parameters["a"] = torch.zeros(1000, dtype=torch.bfloat16)
                await trio.sleep(5)
            nursery.cancel_scope.cancel()

    trio.run(wait, 3.0, clock=trio.testing.MockClock(autojump_threshold=0))
    assert caplog.messages == []
    trio.run(wait, 7.0, clock=trio.testing.MockClock(autojump_threshold=0))
    assert caplog.messages == [
        "downloading the model from peers: waiting for its configuration",
        "downloading the model from peers: 1/2 parameters (0.0 MB)",
    ]
