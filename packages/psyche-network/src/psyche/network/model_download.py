"""A joining client fetching the whole model from its peers (upstream client flow for `P2P`).

1. Ask peers (chosen by `PeerManager`) for the config ticket and download it.
2. For each parameter name, in one sequential loop: wait for download capacity (at most
   `max_concurrent` parameter blobs in flight, upstream default 8), ask the next peer for the
   parameter's ticket (10 s per request, 500 attempts, 5 errors per peer), start its download.
3. A failed download releases its capacity, counts against the ticket's provider and is retried
   with a fresh ticket from another peer; a complete one is decoded and kept.

Each step awaits its own `Download`, so the application's event loop has nothing to route here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from psyche.network.download import DownloadComplete, DownloadFailed, DownloadOutcome
from psyche.network.identity import fmt_short
from psyche.network.peer_manager import (
    MAX_ERRORS_PER_PEER,
    PeerManager,
    PeersUnreachable,
    blob_ticket_param_request_task,
)
from psyche.network.scheduler import DEFAULT_MAX_CONCURRENT_PARAMETER_REQUESTS, DownloadScheduler
from psyche.network.sharable_model import CONFIG_TAG, SharableModel, parameter_tag
from psyche.network.ticket import BlobTicket
from psyche.network.transmittable import (
    DownloadType,
    ModelRequestType,
    SharableModelError,
    SharableModelFailure,
    TransmittableModelConfig,
    TransmittableModelParameter,
)

if TYPE_CHECKING:
    import torch

    from psyche.network.connection import NetworkConnection

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DownloadedModel:
    config: TransmittableModelConfig
    parameters: dict[str, torch.Tensor]


class ModelDownload:
    def __init__(
        self,
        network: NetworkConnection,
        peers: Iterable[bytes],
        *,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT_PARAMETER_REQUESTS,
        max_errors_per_peer: int = MAX_ERRORS_PER_PEER,
    ) -> None:
        self._network = network
        self._exhausted = False
        self._scope = trio.CancelScope()
        self.peer_manager = PeerManager(
            network.connection_monitor,
            max_errors_per_peer=max_errors_per_peer,
            on_exhausted=self._on_exhausted,
        )
        self.peer_manager.set_peers(p for p in peers if p != network.endpoint_id)
        self.scheduler = DownloadScheduler(max_concurrent)
        self.model = SharableModel()
        self.retried_downloads = 0

    def _on_exhausted(self) -> None:
        self._exhausted = True
        self._scope.cancel()

    async def _download(
        self, ticket: BlobTicket, tag: str, request: ModelRequestType
    ) -> DownloadOutcome:
        download = self._network.start_download(ticket, tag, DownloadType.ModelSharing(request))
        return await download.finished()

    async def _request_ticket(self, request: ModelRequestType) -> BlobTicket:
        if self._exhausted:
            raise PeersUnreachable("Peers were unreachable for P2P parameter requests")
        ticket, _, _ = await blob_ticket_param_request_task(
            request, self._network.request_model_blob_ticket, self.peer_manager
        )
        return ticket

    # flow -------------------------------------------------------------------------------------

    async def run(self) -> DownloadedModel:
        """The whole model; raises `PeersUnreachable` once every peer failed too often (the
        peer manager's verdict cancels all requests at once, like upstream's cancel token)."""
        with self._scope:
            try:
                return await self._run()
            except BaseExceptionGroup as group:
                unreachable, rest = group.split(PeersUnreachable)
                if unreachable is not None and rest is None:
                    raise _first(unreachable) from None
                raise
        raise PeersUnreachable("Peers were unreachable for P2P parameter requests")

    async def _run(self) -> DownloadedModel:
        config = await self._fetch_config()
        self.model.add_config(config)
        self.model.initialize_parameters(list(config.parameter_names))
        names = iter(config.parameter_names)
        # Upstream requests tickets one at a time; here one request may be in flight per peer
        # (the peer manager hands each peer to one request at a time either way).
        workers = max(1, min(len(self.peer_manager.available_peers), self.scheduler.max_concurrent))
        async with trio.open_nursery() as nursery:
            for _ in range(workers):
                nursery.start_soon(self._request_parameters, names, nursery)
        return DownloadedModel(config, self.model.take_parameters())

    async def _request_parameters(self, names: Iterator[str], nursery: trio.Nursery) -> None:
        for name in names:
            await self.scheduler.wait_for_capacity()
            try:
                ticket = await self._request_ticket(ModelRequestType.Parameter(name))
            except BaseException:
                self.scheduler.release_capacity()
                raise
            nursery.start_soon(self._complete_parameter, name, ticket)

    async def _fetch_config(self) -> TransmittableModelConfig:
        while True:
            ticket = await self._request_ticket(ModelRequestType.Config())
            result = await self._download(ticket, CONFIG_TAG, ModelRequestType.Config())
            if isinstance(result, DownloadComplete) and isinstance(
                result.data, TransmittableModelConfig
            ):
                return result.data
            self._failed(ticket, result)

    async def _complete_parameter(self, name: str, ticket: BlobTicket) -> None:
        request = ModelRequestType.Parameter(name)
        while True:
            result = await self._download(ticket, parameter_tag(name), request)
            if isinstance(result, DownloadComplete):
                try:
                    await self._accept_parameter(name, result.data)
                    self.scheduler.release_capacity()
                    return
                except SharableModelFailure as e:
                    logger.warning(
                        "bad parameter %s from %s: %s", name, fmt_short(ticket.provider), e
                    )
            self.scheduler.release_capacity()
            self._failed(ticket, result)
            await self.scheduler.wait_for_capacity()
            try:
                ticket = await self._request_ticket(request)
            except BaseException:
                self.scheduler.release_capacity()
                raise

    async def _accept_parameter(self, name: str, data: Any) -> None:
        if not isinstance(data, TransmittableModelParameter):
            raise SharableModelFailure(
                SharableModelError.SerializationError("blob is not a model parameter")
            )
        if data.param_name_bytes != name.encode("utf-8"):
            raise SharableModelFailure(SharableModelError.ParameterUnknown(data.name()))
        await self.model.add_parameter(data)

    def _failed(self, ticket: BlobTicket, result: DownloadOutcome) -> None:
        self.retried_downloads += 1
        reason = result.error if isinstance(result, DownloadFailed) else "unexpected payload"
        logger.warning(
            "model download from %s failed: %s; retrying", fmt_short(ticket.provider), reason
        )
        self.peer_manager.report_blob_ticket_request_error(ticket.provider)


def _first(group: BaseExceptionGroup) -> BaseException:
    first = group.exceptions[0]
    return _first(first) if isinstance(first, BaseExceptionGroup) else first
