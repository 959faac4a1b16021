"""`BandwidthTracker` keeps running totals; these tests hold it to the definition it replaced
(re-summing a peer's window on every query), event for event, on random progress streams."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from psyche.network.stats import BandwidthTracker, PeerBandwidth

PERIOD = 15.0
PEERS = (b"a" * 32, b"b" * 32, b"c" * 32)


class ResummingTracker:
    """The tracker as it was: every query sums the peer's whole window."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.events: dict[bytes, deque[tuple[float, int]]] = {}

    def add_event(self, peer: bytes, num_bytes: int) -> None:
        now = self.clock[0]
        events = self.events.setdefault(peer, deque())
        events.append((now, num_bytes))
        while events and now - events[0][0] > PERIOD:
            events.popleft()

    def bandwidth(self, events: deque[tuple[float, int]]) -> float:
        if not events:
            return 0.0
        seconds = self.clock[0] - events[0][0]
        total = sum(n for _, n in events)
        return total / seconds if seconds > 0 else 0.0

    def get_peer_bandwidth(self, peer: bytes) -> PeerBandwidth:
        events = self.events.get(peer)
        if not events:
            return PeerBandwidth.NotMeasured()
        return PeerBandwidth.Measured(self.bandwidth(events))

    def get_total_bandwidth(self) -> float:
        return sum(self.bandwidth(events) for events in self.events.values())


# One step: (seconds the clock moves, peer index, bytes; None: a query without an event).
steps = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.001, 0.25, 1.0, 7.5, 14.999, 15.0, 15.001, 40.0]),
        st.integers(0, len(PEERS) - 1),
        st.none() | st.integers(0, 1 << 40),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_running_totals_equal_the_resummed_window(stream: list) -> None:  # type: ignore[type-arg]
    clock = [1000.0]
    tracker = BandwidthTracker(PERIOD, clock=lambda: clock[0])
    reference = ResummingTracker(clock)
    for advance, index, num_bytes in stream:
        clock[0] += advance
        peer = PEERS[index]
        if num_bytes is not None:
            tracker.add_event(peer, num_bytes)
            reference.add_event(peer, num_bytes)
        # Exact equality: the totals are integers, so the quotient is the same float.
        for other in PEERS:
            assert tracker.get_peer_bandwidth(other) == reference.get_peer_bandwidth(other)
        assert tracker.get_total_bandwidth() == reference.get_total_bandwidth()


def test_a_long_fetch_keeps_only_the_window() -> None:
    """100,000 frames at 1,024 a second (exact binary times): the window holds the last 15 s of
    them, both ends included, and the rate is their bytes over those 15 s."""
    clock = [0.0]
    tracker = BandwidthTracker(PERIOD, clock=lambda: clock[0])
    for i in range(100_000):
        clock[0] = i / 1024
        tracker.add_event(PEERS[0], 65536)
    in_window = 15 * 1024 + 1
    assert tracker.get_peer_bandwidth(PEERS[0]) == PeerBandwidth.Measured(in_window * 65536 / 15)


class CountedBytes(int):
    """A byte count that counts the additions it takes part in (`sum` over a window adds each)."""

    additions = 0

    def __add__(self, other: object) -> int:
        CountedBytes.additions += 1
        return int(self) + int(other)  # type: ignore[call-overload]

    __radd__ = __add__


def test_a_progress_update_does_not_revisit_the_window() -> None:
    """What made a long fetch quadratic: each update re-summed the peer's window. Now an update
    adds its own bytes once and a query adds nothing, however full the window is."""
    clock = [0.0]
    tracker = BandwidthTracker(PERIOD, clock=lambda: clock[0])
    for i in range(2000):
        clock[0] = i / 1024
        tracker.add_event(PEERS[0], CountedBytes(65536))
        tracker.get_peer_bandwidth(PEERS[0])
    assert CountedBytes.additions <= 2000
    before = CountedBytes.additions
    for _ in range(100):
        tracker.get_peer_bandwidth(PEERS[0])
        tracker.get_total_bandwidth()
    assert CountedBytes.additions == before
