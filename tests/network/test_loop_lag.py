"""Timeouts stretched by the event loop's lateness (`psyche.network.loop_lag`): a starved process
does not cut its own connection set-ups short, and the stretch stays bounded."""

from __future__ import annotations

import trio
import trio.testing

from psyche.core.identity import SecretKey
from psyche.network import p2p_host
from psyche.network.dialer import Dialer
from psyche.network.loop_lag import LAG_HOPS, MAX_STRETCH, SAMPLES_KEPT, LoopLag
from psyche.network.testing import open_nodes, wait_until

A = b"a" * 32


def test_a_timeout_is_stretched_by_the_loops_lateness_within_a_bound() -> None:
    lag = LoopLag()
    assert lag.stretch(10.0) == 10.0  # nothing sampled yet: the timeout as configured
    for _ in range(SAMPLES_KEPT):
        lag.note(0.0)
    assert lag.stretch(10.0) == 10.0  # an idle loop: unchanged
    for _ in range(SAMPLES_KEPT):
        lag.note(0.5)
    assert lag.stretch(10.0) == 10.0 + LAG_HOPS * 0.5
    lag.note(-1.0)  # a tick that came early is no lateness
    assert lag.lag() == 0.5
    for _ in range(SAMPLES_KEPT):
        lag.note(1000.0)  # a stranger that never answers is still let go
    assert lag.stretch(10.0) == MAX_STRETCH * 10.0
    for _ in range(SAMPLES_KEPT):
        lag.note(0.0)
    assert lag.stretch(10.0) == 10.0  # and the stretch ends with the starvation


def test_a_slow_set_up_on_a_late_loop_is_not_cut_short() -> None:
    """A set-up that takes 12 s because our own loop runs 2 s late finishes (the 5 s connect
    timeout stretched to 21 s, within 4x); on an on-time loop the same set-up is cut at 5 s,
    as before, and counts as a failed dial."""

    async def main() -> None:
        async def dial(peer: bytes, timeout: float) -> None:
            with trio.fail_after(timeout):
                await trio.sleep(12.0)

        on_time = Dialer(dial, base_timeout=5.0, stretch=LoopLag().stretch)
        try:
            await on_time.connect(A)
        except trio.TooSlowError:
            pass
        else:
            raise AssertionError("an on-time loop's 5 s timeout must still end a 12 s set-up")
        assert on_time.backed_off(A)

        late = LoopLag()
        for _ in range(SAMPLES_KEPT):
            late.note(2.0)
        dialer = Dialer(dial, base_timeout=5.0, stretch=late.stretch)
        await dialer.connect(A)
        assert not dialer.backed_off(A)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_libp2p_set_up_timeouts_follow_the_stretch_from_their_base() -> None:
    host = p2p_host.build_host(SecretKey.generate(), "127.0.0.1")
    config = host.get_network().connection_config  # type: ignore[attr-defined]
    base = {name: getattr(config, name) for name in p2p_host.LIBP2P_SET_UP_TIMEOUTS}
    assert all(secs == 10.0 for secs in base.values())  # py-libp2p's defaults
    p2p_host.stretch_set_up_timeouts(host, lambda secs: 3 * secs)
    p2p_host.stretch_set_up_timeouts(host, lambda secs: 3 * secs)  # from the base, not compounded
    assert [getattr(config, name) for name in base] == [30.0] * 4
    p2p_host.stretch_set_up_timeouts(host, lambda secs: secs)
    assert [getattr(config, name) for name in base] == [10.0] * 4


def test_a_node_whose_loop_runs_late_stretches_its_set_up_timeouts() -> None:
    """The wiring: a node samples its loop, and its dials, RTT probes and py-libp2p's upgrade
    and stream-negotiation timeouts follow. Lateness is injected (the samples a starved loop
    would take), so nothing here depends on this machine's load."""

    async def main() -> None:
        async with open_nodes(1) as (node,):
            config = node.host.get_network().connection_config  # type: ignore[attr-defined]
            for _ in range(SAMPLES_KEPT):
                node.loop_lag.note(1.0)
            await wait_until(lambda: config.outbound_upgrade_timeout > 10.0, timeout=30.0)
            assert config.inbound_stream_protocol_negotiation_timeout > 10.0
            assert config.outbound_upgrade_timeout <= MAX_STRETCH * 10.0

    trio.run(main)
