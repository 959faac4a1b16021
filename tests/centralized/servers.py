"""What the server tests share: a running server's loopback address, waiting for a condition, and
a run whose training data its own server hosts (`data_location = Server`: the tiny run's dataset
written into a test's directory, and a quick coordinator pointing at the data port), and the
tiny CPU run's config (`TINY`) with its state pointed at a data port (`tiny_state`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import trio

from psyche.centralized.server import CentralizedServer
from psyche.centralized.tiny_run import write_tiny_dataset
from psyche.coordinator.coordinator import Coordinator
from psyche.coordinator.model import Checkpoint, HubRepo, LLMTrainingDataLocation
from psyche.coordinator.testing import quick_coordinator
from psyche.data_provider import DataServerInfo

from ..polling import poll_until
from ..processes import REPO, free_port

TINY = REPO / "configs" / "tiny-cpu"


def tiny_state(tmp_path: Path, data_port: int, **replace: str) -> Path:
    text = (TINY / "state.toml").read_text().replace("127.0.0.1:20001", f"127.0.0.1:{data_port}")
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "state.toml"
    path.write_text(text)
    return path


def addr(server: CentralizedServer) -> str:
    return f"127.0.0.1:{server.port}"


async def eventually(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        await poll_until(predicate, 0.01)


def hosted(directory: Path, *, port: int | None = None) -> tuple[Coordinator, DataServerInfo]:
    """The coordinator (one client starts an epoch, a Dummy checkpoint) and its `data.toml`;
    the data port is `port`, or a free one."""
    write_tiny_dataset(
        directory / "data",
        tokenizer_path=TINY / "model" / "tokenizer.json",
        seq_len=32,
        min_sequences=64,
    )
    (directory / "data.toml").write_text(
        f'dir = "data"\ntoken_size = "TwoBytes"\nseq_len = 32\nshuffle_seed = {list(range(32))}\n'
    )
    coordinator = quick_coordinator(init_min_clients=1)
    llm = coordinator.model.value  # type: ignore[attr-defined]
    llm.data_location = LLMTrainingDataLocation.Server(f"127.0.0.1:{port or free_port()}")
    llm.checkpoint = Checkpoint.Dummy(HubRepo(""))
    return coordinator, DataServerInfo.load(directory / "data.toml")
