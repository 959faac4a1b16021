"""The chaos tests drive the harness in scripts/chaos (proxies, cluster, scenarios, adversary)."""

from __future__ import annotations

import sys
from pathlib import Path

CHAOS = Path(__file__).resolve().parents[2] / "scripts" / "chaos"
if str(CHAOS) not in sys.path:
    sys.path.insert(0, str(CHAOS))
