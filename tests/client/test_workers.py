"""A client of several ranks (`psyche.client.setup.workers`): the option checks, and real worker
processes (gloo on the CPU) started by rank 0 through tests/client/workers_leader.py: the
trainer built through the group publishes a one-rank client's payload and holds its
parameters; a rank killed mid-training stops the whole client within a bounded time, leaving no
process behind; a killed client takes its workers with it."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from psyche.client.setup.options import TrainOptions
from psyche.modeling.configs import llama_config_dict

from .leaders import Leader, pid_alive, wait_until


def problems(**kwargs: object) -> list[str]:
    return TrainOptions(run_id="r", **kwargs).problems()  # type: ignore[arg-type]


def test_the_ranks_options_say_what_is_wrong_in_one_line() -> None:
    assert problems(data_parallelism=2, tensor_parallelism=2, device="cpu") == []
    assert problems(data_parallelism=2, fsdp=True, param_dtype="bf16", device="cuda:0,1") == []
    [line] = problems(data_parallelism=2, tensor_parallelism=2, device="cuda:0,1")
    assert line == (
        "--device cuda:0,1 names 2 device(s) for --data-parallelism 2 x --tensor-parallelism 2 "
        "= 4 rank(s): list 4 devices, or use --device cuda / auto"
    )
    assert problems(fsdp=True) == [
        "--fsdp shards over the data-parallel ranks: add --data-parallelism 2+"
    ]
    assert problems(reduce_dtype="bf16") == [
        "--param-dtype and --reduce-dtype apply to --fsdp only"
    ]
    assert problems(device="cuda:x") == ["--device cuda:x: expected cuda:N or cuda:N,M,..."]
    # TP or FSDP with evaluations: rank 0 evaluates a gathered replica (test_eval_replica.py)
    assert problems(tensor_parallelism=2, prompt_task=True) == []
    assert (
        problems(data_parallelism=4, main_host="10.0.0.1", num_local_ranks=2, device="cuda:0,1")
        == []
    )
    # replicated DP: rank 0 holds the whole model and evaluates it alone
    assert problems(data_parallelism=2, device="cpu", prompt_task=True) == []


@pytest.fixture
def leaders() -> Iterator[list[Leader]]:
    started: list[Leader] = []
    yield started
    for leader in started:
        leader.stop()


def test_a_two_rank_client_trains_as_one_and_stops_with_a_dead_rank(
    model_dir: Path, tmp_path: Path, leaders: list[Leader]
) -> None:
    leader = Leader("train", model_dir, tmp_path / "leader.log")
    leaders.append(leader)
    [worker] = map(int, leader.line("WORKERS"))
    assert leader.line("PAYLOAD_EQUAL") == ["True"], leader.tail()
    assert leader.line("PARAMS_EQUAL") == ["True"], leader.tail()
    assert leader.line("EVAL_EQUAL") == ["True"], leader.tail()
    leader.line("TRAINING")
    time.sleep(1.0)  # let a training step be under way (the test holds either way)
    os.kill(worker, signal.SIGKILL)
    stopped = leader.line("STOPPED", timeout=60.0)
    assert set(stopped) <= {"WorkerDied", "RuntimeError", "DistBackendError"}, stopped
    assert leader.proc.wait(timeout=60.0) == 3, leader.tail()
    assert "CLOSED" in leader.lines()
    wait_until(lambda: not pid_alive(worker), "the killed rank to be gone")


def test_a_layout_the_model_cannot_take_and_a_killed_client(
    tmp_path: Path, leaders: list[Leader]
) -> None:
    """TP=2 of a model with one key/value head: one line from the leader, the worker waits;
    then the client is SIGKILLed and its worker exits by itself."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = llama_config_dict("tiny", num_key_value_heads=1)
    (model_dir / "config.json").write_text(json.dumps(config))
    leader = Leader("orphan", model_dir, tmp_path / "leader.log")
    leaders.append(leader)
    [worker] = map(int, leader.line("WORKERS"))
    error = " ".join(leader.line("INIT_ERROR"))
    assert error == (
        "tensor parallelism 2 does not divide the model's num_key_value_heads (1): use "
        "--tensor-parallelism 1"
    )
    assert pid_alive(worker)
    os.kill(leader.proc.pid, signal.SIGKILL)
    leader.proc.wait()
    wait_until(lambda: not pid_alive(worker), "the worker to exit after its client", 30.0)
