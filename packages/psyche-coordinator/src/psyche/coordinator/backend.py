"""What a training client needs from a coordinator backend (upstream's `watcher::Backend`).

The client is written against this protocol only; the centralized TCP backend and the Solana
backend implement it. Methods are trio-async. `wait_for_new_state` must be cancel safe: a
cancelled wait loses no state (the next call returns the newest one).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from psyche.coordinator.committee_selection import CommitteeProof
from psyche.coordinator.coordinator import Coordinator
from psyche.coordinator.model import Checkpoint
from psyche.coordinator.run_state import Witness, WitnessMetadata
from psyche.coordinator.verification import VerificationReport
from psyche.core.node_identity import NodeIdentity
from psyche.core.serde import DataEnum, variant


class OpportunisticData(DataEnum):
    """A witness sent during training (with metadata) or during warmup."""

    WitnessStep = variant(tuple[Witness, WitnessMetadata])
    WarmupStep = variant(Witness)

    @property
    def kind(self) -> str:
        return "witness" if isinstance(self, OpportunisticData.WitnessStep) else "warmup"


# Upstream `HealthChecks = Vec<(NodeIdentity, CommitteeProof)>`: a client the sender considers
# unhealthy, with that client's committee proof for the round.
HealthCheck = tuple[NodeIdentity, CommitteeProof]


@runtime_checkable
class Backend(Protocol):
    async def wait_for_new_state(self) -> Coordinator:
        """The next coordinator state (cancel safe)."""
        ...

    async def send_witness(self, opportunistic_data: OpportunisticData) -> None: ...

    async def send_health_check(self, health_checks: list[HealthCheck]) -> None: ...

    async def send_checkpoint(self, checkpoint: Checkpoint) -> None: ...


@runtime_checkable
class EndpointDiscovery(Protocol):
    """Optional backend capability: how clients of a run learn each other's network addresses.

    A client publishes its signed endpoint record (opaque bytes produced by the network layer) and
    reads everyone else's. The centralized backend relays records through the server; a backend
    without this capability leaves discovery to the network layer's own means (bootstrap peers,
    peer exchange).
    """

    async def publish_endpoint(self, record: bytes) -> None: ...

    def peer_endpoints(self) -> list[bytes]:
        """The newest record of every other client known to the backend."""
        ...


@runtime_checkable
class Rejoin(Protocol):
    """Optional backend capability: join the run again after the coordinator went on without
    this client (a health check dropped it, or an epoch started while it was not pending).

    A backend without it leaves this client out for good; the Solana backend's client exits
    then, as upstream's does, and a person restarts it."""

    async def rejoin(self) -> None:
        """Ask to be in the run's next epoch; returns once the request is on its way."""
        ...


@runtime_checkable
class RunIdentity(Protocol):
    """Optional backend capability: which instance of the run this coordinator runs. The same
    run config started twice gives two instances with different identities; a server resumed
    from its saved state keeps its identity. Every client of the instance sees the same one.
    A client's checkpoints carry it, so that it never resumes, counts or deletes another
    instance's (psyche.client.checkpoints.store)."""

    def run_identity(self) -> str | None:
        """The identity (a short printable string), or None when the coordinator names none."""
        ...


@runtime_checkable
class VerificationReports(Protocol):
    """Optional backend capability: carry a verifier's or tie-breaker's findings of a round to
    the coordinator (`psyche.coordinator.verification`; runs with `verification_percent > 0`).
    The centralized backend has it; a backend without it drops the reports (logged once)."""

    async def send_verification(self, report: VerificationReport) -> None: ...

    async def round_reports(self, step: int) -> dict[NodeIdentity, VerificationReport]:
        """The reports the coordinator accepted for round `step` so far, by sender (a round's
        tie-breaker reads its disputes from them; empty once the round is forgotten)."""
        ...
