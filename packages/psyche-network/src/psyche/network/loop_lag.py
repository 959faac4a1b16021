"""How late this process's event loop runs its tasks, and timeouts stretched by that lateness.

Why (measured with `scripts/bench/swarm.py`, 32 and 64 nodes, 4 to a process, on two cores
shared with other engineers' work): the kernel shares the cores between sessions (autogroup
scheduling), so a swarm's processes together got what one session gets: 0.014-0.032 of a
core per process at 64 nodes, and each process's loop ran a task that slept 0.1 s a median
0.4 s late, 1-5 s at the 99th percentile. Every wall-clock timeout of a connection set-up
(the dial, py-libp2p's 10 s upgrade and stream negotiations) then measured our own
starvation, not the peer: 3,425 dials of 64 nodes timed out in five minutes, each throwing
away both sides' handshake work (about 25 ms of CPU a side), more CPU than the whole swarm
got, so the meshes never formed.

A timeout here guards against a peer that does not answer. When our loop runs `lag` late,
each message the peer sent on time is seen `lag` late, at every hop of a handshake, on both
sides (the peer's process starves alike). So a set-up's timeout is its base plus
`LAG_HOPS` times the recent lateness (`LoopLag.stretch`), and never more than
`MAX_STRETCH` times the base: a stranger or a dead peer is still let go within a bound,
and on an idle machine (lateness ~0) every timeout is what it was.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

import trio

TICK_SECS = 0.5
"""How often the loop's lateness is sampled (a sleep of this long, timed)."""
SAMPLES_KEPT = 20
"""The lateness is the `LAG_QUANTILE` of the last this many samples (~10 s on an idle loop)."""
LAG_QUANTILE = 0.9
LAG_HOPS = 8
"""Message hops a connection set-up or stream negotiation waits on, counted on both sides:
multistream-select for the security protocol, Noise XX's three messages, multistream-select
for the muxer; a stream's negotiation is two round trips."""
MAX_STRETCH = 4.0
"""A stretched timeout is at most this many times its base (py-libp2p's 10 s upgrade and
negotiation timeouts: 40 s; a 5 s dial: 20 s, within the dialer's own cap)."""


class LoopLag:
    """Samples how late `trio.sleep(TICK_SECS)` returns (`run`) and stretches timeouts by it."""

    def __init__(self) -> None:
        self._late: deque[float] = deque(maxlen=SAMPLES_KEPT)

    def note(self, late_secs: float) -> None:
        self._late.append(max(0.0, late_secs))

    def lag(self) -> float:
        """The recent lateness (the `LAG_QUANTILE` of the samples kept; 0 with none)."""
        if not self._late:
            return 0.0
        if len(self._late) == 1:
            return self._late[0]
        return statistics.quantiles(self._late, n=10, method="inclusive")[
            int(LAG_QUANTILE * 10) - 1
        ]

    def stretch(self, base: float) -> float:
        """`base` plus `LAG_HOPS` times the recent lateness, at most `MAX_STRETCH` x `base`."""
        return min(base + LAG_HOPS * self.lag(), MAX_STRETCH * base)

    async def run(self, after_each: Callable[[], None] = lambda: None) -> None:
        """Sample forever (run it in the network's nursery), calling `after_each` after each
        sample."""
        while True:
            start = trio.current_time()
            await trio.sleep(TICK_SECS)
            self.note(trio.current_time() - start - TICK_SECS)
            after_each()


__all__ = ["LAG_HOPS", "MAX_STRETCH", "LoopLag"]
