"""Waiting for state that the code under test exposes but does not signal.

A test often has to wait until a server has counted a connection, a client has written a file or
a run has reached a state: nothing there sets an event for it, and adding one only for the tests
would change the code they check. `poll_until` is the one place such a wait is written. It has no
deadline of its own: the caller bounds it (`trio.fail_after`), so a wait that never ends fails the
test with the caller's timeout.
"""

from __future__ import annotations

from collections.abc import Callable

import trio


async def poll_until(predicate: Callable[[], object], interval: float = 0.01) -> None:
    """Returns once `predicate()` is true, checking it every `interval` seconds."""
    # Nothing signals this state, so ASYNC110's advice (wait for an Event) does not apply.
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(interval)
