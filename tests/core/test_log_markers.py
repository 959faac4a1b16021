from __future__ import annotations

import pytest

from psyche.core.log_markers import IntegrationTestLogMarker

SPELLINGS = ["state_change", "loss", "loaded_model", "health_check", "untrained_batches",
             "solana_subscription", "witness_elected", "error", "rpc_fallback"]  # fmt: skip


def test_markers_round_trip_their_spellings() -> None:
    assert [str(m) for m in IntegrationTestLogMarker] == SPELLINGS
    for text in SPELLINGS:
        assert str(IntegrationTestLogMarker.from_str(text)) == text
    with pytest.raises(ValueError, match="unknown integration test log marker"):
        IntegrationTestLogMarker.from_str("StateChange")
