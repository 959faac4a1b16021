"""The chaos tests drive the harness in scripts/chaos (proxies, cluster, scenarios, adversary).

`scaled_run_config(config)`: a scenario's run config for a test, the harness's timers
(`cluster.FAST_CONFIG`) with `config` over them, every timer stretched to this machine's speed
(`tests/timing.py`): on a busy machine a round outlasts unscaled timers, and honest clients are
banned for being slow."""

from __future__ import annotations

import sys
from pathlib import Path

from ..timing import TIMER_FIELDS, scaled_timers

CHAOS = Path(__file__).resolve().parents[2] / "scripts" / "chaos"
if str(CHAOS) not in sys.path:
    sys.path.insert(0, str(CHAOS))


def scaled_run_config(config: dict[str, int]) -> dict[str, int]:
    from cluster import FAST_CONFIG

    timers = {key: value for key, value in FAST_CONFIG.items() if key in TIMER_FIELDS}
    return scaled_timers({**timers, **config})
