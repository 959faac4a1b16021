"""The --events-dir record file: one record per distinct state, partial records cut off."""

from __future__ import annotations

from pathlib import Path

from psyche.centralized.events import STATE_FILE, EventsWriter, read_events
from psyche.coordinator import RunState
from psyche.coordinator.testing import quick_coordinator


def test_records_distinct_states_and_survives_a_torn_write(tmp_path: Path) -> None:
    first = quick_coordinator()
    second = quick_coordinator()
    second.run_state = RunState.Paused
    writer = EventsWriter(tmp_path)
    assert writer.record(first.to_bytes())
    assert not writer.record(first.to_bytes())  # unchanged: nothing written
    assert writer.record(second.to_bytes())
    writer.close()
    path = tmp_path / STATE_FILE
    events = list(read_events(path))
    assert [c.run_state for _, c in events] == [RunState.WaitingForMembers, RunState.Paused]
    assert events[0][0] <= events[1][0]

    whole = path.read_bytes()
    path.write_bytes(whole + whole[:20])  # a crash in the middle of a record
    assert len(list(read_events(path))) == 2
    writer = EventsWriter(tmp_path)  # reopening cuts the partial record off
    assert path.read_bytes() == whole
    assert writer.record(first.to_bytes())
    writer.close()
    assert [c.run_state for _, c in read_events(path)][-1] is RunState.WaitingForMembers
