"""Markers that integration tests look for in structured logs (field `integration_test_log_marker`)."""

from __future__ import annotations

import enum


class IntegrationTestLogMarker(enum.Enum):
    StateChange = "state_change"
    Loss = "loss"
    LoadedModel = "loaded_model"
    HealthCheck = "health_check"
    UntrainedBatches = "untrained_batches"
    SolanaSubscription = "solana_subscription"
    WitnessElected = "witness_elected"
    Error = "error"
    RpcFallback = "rpc_fallback"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def from_str(cls, text: str) -> IntegrationTestLogMarker:
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"unknown integration test log marker {text!r}") from None
