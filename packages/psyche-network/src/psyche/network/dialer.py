"""Outbound connection set-up, paced: one dial per peer at a time, a few at once, a peer that
failed backed off, and the time a dial gets sized from how long set-ups take on this machine.

Why (measured with `scripts/bench/swarm.py`, 32 nodes in 8 processes on two loaded cores):
a libp2p connection costs each side about 25 ms of Python CPU to set up (Noise, multistream
negotiations, Yamux, identify, the gossip stream). Every node asked for 3 gossip neighbours at
once, and again every 6 s while it had none; every dial that took more than the 5 s connect
timeout was cancelled half-way, which threw away both sides' work and left the listener a
connection whose dialer was gone; the next top-up dialed 3 more peers beside the ones still
in progress. The dials fed the load that made them time out: 1,827 timed-out dials in two
minutes, connections open but no gossip stream negotiated, no mesh at all. Here:

* a dial to a peer already being dialed joins that dial instead of starting a second
  connection (`Dialer.connect`);
* at most `MAX_CONCURRENT_DIALS` set-ups run at once; the others wait for a slot, and the
  wait does not count against their timeout;
* a dial gets `MeasuredTimeout.timeout()`: the configured connect timeout, or
  `TIMEOUT_HEADROOM` times the median of the last set-ups when that is longer (a loaded
  machine's handshakes are slow but finish; cancelling them is what stalls; a dial that timed
  out counts as its whole timeout), at most `TIMEOUT_MAX_FACTOR` times the configured one;
  then stretched by how late this process's event loop runs (`stretch`, the network's
  `loop_lag.LoopLag.stretch`: a starved loop sees the peer's answers late, and cutting the
  set-up short then throws its work away), at most `loop_lag.MAX_STRETCH` times that;
* a peer whose dials failed is not dialed again in the background (`DialPacing.backed_off`)
  for `BACKOFF_BASE_SECS`, doubling per consecutive failure up to `BACKOFF_MAX_SECS`; a dial
  the application needs now (a download) still goes ahead.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

MAX_CONCURRENT_DIALS = 4
"""Connection set-ups in flight at once per node (the client's top-up asks for 3)."""
BACKOFF_BASE_SECS = 6.0
"""After a failed dial, a background dial to that peer waits this long (the client's top-up
interval), doubled per further consecutive failure."""
BACKOFF_MAX_SECS = 60.0
TIMEOUT_HEADROOM = 3.0
TIMEOUT_MAX_FACTOR = 2.0
"""At most this many times the configured timeout (10 s for the 5 s default: py-libp2p's own
upgrade timeout, which ends a longer set-up anyway; raising that and its 10 s stream
negotiation timeout to 20 s was tried and did not help where the set-ups failed)."""
RECENT_SETUPS = 8
"""How many successful set-ups' durations size the timeout."""


@dataclass
class MeasuredTimeout:
    """A timeout sized from how long the operation took here lately: `base`, or `HEADROOM`
    times the median of the last `RECENT_SETUPS` durations when that is longer, at most
    `MAX_FACTOR` times `base`. An attempt that timed out counts as having taken its whole
    timeout, so on a machine where nothing finishes in `base` the timeout grows instead of
    cutting every attempt short forever."""

    base: float
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_SETUPS))

    def timeout(self) -> float:
        if not self.recent:
            return self.base
        sized = TIMEOUT_HEADROOM * statistics.median(self.recent)
        return min(max(self.base, sized), TIMEOUT_MAX_FACTOR * self.base)

    def took(self, secs: float) -> None:
        self.recent.append(secs)


@dataclass
class DialPacing:
    """The decisions, without I/O: how long a dial may take, which peer is backed off."""

    timeouts: MeasuredTimeout
    failures: dict[bytes, tuple[int, float]] = field(default_factory=dict)
    """Peer -> (consecutive failed dials, when the last one failed)."""

    def timeout(self) -> float:
        return self.timeouts.timeout()

    def backed_off(self, peer: bytes, now: float) -> bool:
        failed = self.failures.get(peer)
        if failed is None:
            return False
        count, at = failed
        wait = min(BACKOFF_BASE_SECS * 2.0 ** (count - 1), BACKOFF_MAX_SECS)
        return now - at < wait

    def succeeded(self, peer: bytes, secs: float) -> None:
        self.failures.pop(peer, None)
        self.timeouts.took(secs)

    def failed(self, peer: bytes, now: float, timed_out_after: float | None = None) -> None:
        count, _ = self.failures.get(peer, (0, 0.0))
        self.failures[peer] = (count + 1, now)
        if timed_out_after is not None:
            self.timeouts.took(timed_out_after)


DialFn = Callable[[bytes, float], Awaitable[None]]
"""Connect to a peer within the given seconds (raises on failure)."""


class Dialer:
    """Runs `dial` with the pacing above; `connect` returns once a connection was made."""

    def __init__(
        self,
        dial: DialFn,
        base_timeout: float,
        max_concurrent: int = MAX_CONCURRENT_DIALS,
        stretch: Callable[[float], float] = lambda timeout: timeout,
    ) -> None:
        self._dial = dial
        self._stretch = stretch
        self.pacing = DialPacing(MeasuredTimeout(base_timeout))
        self._slots = trio.CapacityLimiter(max_concurrent)
        self._in_flight: dict[bytes, trio.Event] = {}
        self._errors: dict[bytes, BaseException] = {}

    def dialing(self, peer: bytes) -> bool:
        return peer in self._in_flight

    def in_flight(self) -> list[bytes]:
        """The peers being dialed (waiting for a slot included)."""
        return list(self._in_flight)

    def backed_off(self, peer: bytes) -> bool:
        return self.pacing.backed_off(peer, trio.current_time())

    async def connect(self, peer: bytes) -> None:
        """Dial `peer`, or wait for the dial already under way; raises what that dial raised."""
        pending = self._in_flight.get(peer)
        if pending is not None:
            await pending.wait()
            error = self._errors.get(peer)
            if error is not None:
                raise ConnectionError(f"the dial under way failed: {error}")
            return
        done = self._in_flight[peer] = trio.Event()
        self._errors.pop(peer, None)
        start, timeout = trio.current_time(), float("inf")
        try:
            async with self._slots:
                start, timeout = trio.current_time(), self._stretch(self.pacing.timeout())
                await self._dial(peer, timeout)
                self.pacing.succeeded(peer, trio.current_time() - start)
        except Exception as e:  # a cancelled dial (shutdown, an abandoned download) is no failure
            now = trio.current_time()
            self.pacing.failed(peer, now, timeout if now - start >= timeout else None)
            self._errors[peer] = e
            raise
        finally:
            del self._in_flight[peer]
            done.set()


__all__ = ["DialPacing", "Dialer", "MeasuredTimeout"]
