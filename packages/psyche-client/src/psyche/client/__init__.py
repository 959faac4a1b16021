"""The backend-agnostic Psyche training client (upstream `shared/client`).

    async with NetworkConnection.open(NetworkConfig(run_id, secret_key), broadcast_type=Broadcast) as network:
        await Client(backend, network, RunInitConfig(identity, secret_key)).run()

`backend` is any `psyche.coordinator.backend.Backend` (the centralized TCP backend, or
`psyche.client.testing.InProcessServer(...).connect(...)` for a run inside one process).
`psyche.client.core` holds the consensus-critical decisions as plain functions. See
docs/client.md. Names are exported lazily: importing this package does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Client": "psyche.client.client",
    "RunInitConfig": "psyche.client.init",
    "InitRunError": "psyche.client.init",
    "CheckpointConfig": "psyche.client.cooldown",
    "StepStateMachine": "psyche.client.steps",
    "StepDesync": "psyche.client.steps",
    "MachineSettings": "psyche.client.steps",
    "RoundState": "psyche.client.round_state",
    "setup_logging": "psyche.client.logs",
    "log_event": "psyche.client.logs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'psyche.client' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
