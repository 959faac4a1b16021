"""`--cpu-threads`: the client's torch threads, set where it sets up its device (issue 28)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from psyche.cli.client.main import build_parser
from psyche.client.run import Preload
from psyche.client.setup.cpu_threads import available_cores, rank_threads, threads_per_client
from psyche.client.setup.options import TrainOptions

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_budget_is_split_among_the_ranks() -> None:
    assert [threads_per_client(4, n) for n in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]
    assert rank_threads(4, CPU, 2) == 2
    assert rank_threads(1, CPU, 4) == 1
    assert rank_threads(3, CUDA, 1) == 3  # asked for: the CPU work of a GPU client too
    # unset: one rank keeps torch's default; ranks on the CPU share the cores
    assert rank_threads(None, CPU, 1) is None
    assert rank_threads(None, CUDA, 2) is None
    assert rank_threads(None, CPU, 2) == max(1, available_cores() // 2)


def test_the_option_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    parser, env = build_parser()

    def options(*argv: str) -> TrainOptions:
        args = parser.parse_args(["train", "--run-id", "r", "--server-addr", "h:1", *argv])
        env.resolve(parser, args)
        return TrainOptions.from_args(args)

    assert options().cpu_threads is None
    assert options("--cpu-threads", "2").cpu_threads == 2
    monkeypatch.setenv("CPU_THREADS", "3")
    assert options().cpu_threads == 3
    assert options("--cpu-threads", "1").cpu_threads == 1  # the command line wins
    with pytest.raises(SystemExit):
        options("--cpu-threads", "0")


def test_the_client_sets_its_threads_with_its_device() -> None:
    """What the client does before joining (`Preload`): load torch, check the device, and
    give torch the threads asked for, before any model of the run is built."""
    torch.set_num_threads(2)
    Preload("cpu", None, 1)._load()
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    Preload("cpu", None, None)._load()  # unset: torch's own setting stays
    assert torch.get_num_threads() == 2
