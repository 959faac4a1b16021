"""The backend-agnostic Psyche training client (upstream `shared/client`).

    async with open_network(NetworkConfig(run_id, secret_key)) as network:
        await Client(backend, network, RunInitConfig(identity, secret_key, run_id)).run()

`backend` is any `psyche.coordinator.backend.Backend` (the centralized TCP backend, or
`psyche.client.testing.InProcessServer(...).connect(...)` for a run inside one process).
A round reads forward through `round/`'s modules: `fetch`, `train`, `payloads`, `witness`,
`apply`; `round.steps` dispatches on the coordinator's states and `client` does the I/O, with
`setup/`, `checkpoints/` and `observe/` below. See docs/client.md. Names are exported lazily: importing this package does not import torch.
"""

from __future__ import annotations

from psyche.core.lazy import lazy_exports

_EXPORTS = {
    "Client": "psyche.client.client",
    "RunInitConfig": "psyche.client.setup.init",
    "InitRunError": "psyche.client.setup.init",
    "CheckpointConfig": "psyche.client.checkpoints.store",
    "StepStateMachine": "psyche.client.round.steps",
    "StepDesync": "psyche.client.round.steps",
    "MachineSettings": "psyche.client.round.steps",
    "RoundState": "psyche.client.round.state",
    "setup_logging": "psyche.client.observe.logs",
    "log_event": "psyche.client.observe.logs",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
