"""The simulation example in docs/coordinator.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from psyche.coordinator import Coordinator, RunState

REPO = Path(__file__).resolve().parents[2]


def test_docs_example_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (REPO / "docs" / "coordinator.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    monkeypatch.chdir(REPO)  # the example names a config by its path in the repository
    namespace: dict[str, object] = {"__name__": "docs_example"}
    exec(compile(code, "docs/coordinator.md", "exec"), namespace)
    assert len(capsys.readouterr().out.strip()) == 64  # the transcript digest
    coordinator = namespace["coordinator"]
    assert isinstance(coordinator, Coordinator)
    assert coordinator.run_state in (RunState.RoundTrain, RunState.RoundWitness)
    assert namespace["mine"]  # the first client got data to train on
