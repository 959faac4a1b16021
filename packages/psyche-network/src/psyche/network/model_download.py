"""A joining client fetching the whole model from its peers (upstream client flow for `P2P`).

1. Open and authenticate every peer's blob side-channel session at once
   (`BlobRoutes.prepare`; a libp2p connection only to a peer the side channel cannot serve),
   and, meanwhile, ask peers (chosen by `PeerManager`) for the config ticket and download it.
2. Ask for the parameters' tickets in batches, one batch per peer at a time and all peers at
   once (one round trip per peer, not per tensor; upstream asks per parameter); the
   configuration and the batches are asked on the peer's blob side channel session
   (`blob_protocol`'s `GetConfig`, `GetTickets`), which is up before the libp2p connection
   is set up on the provider, and over libp2p (`/psyche/model-sharing/1`,
   `/psyche/model-sharing-batch/1`) when the side channel cannot answer; a next round of batches (names a peer had no ticket for, or a model with
   more tensors than `MAX_BATCH_NAMES` per peer) is asked as soon as the last is answered, not
   when its downloads are done. Smaller first batches (2, 4, 8 names, or a peer's in-flight
   share, then four times larger) were measured: every extra batch is a py-libp2p stream, which
   cost a warm fetch more CPU per byte and more time than a provider's serialization of a whole
   batch cost a cold one. A name a peer answers with an error is asked again (of whichever peer
   is next), and the error counts against that peer (10 s per request, 500 attempts, 5 errors
   per peer, as upstream).
3. Download each batch's parameters as soon as its tickets arrive, with at most `max_concurrent`
   blobs in flight in all (upstream default 8), shared evenly between the peers; a peer's
   blobs in flight share one pipelined session (`BlobSession`: every request is sent at once,
   the replies read in turn), so each provider pays one handshake and sends blob after blob
   without waiting a round trip for the next request. Capacity is released when a blob
   is complete, before its tensor is decoded (as upstream). A failed download releases its
   capacity, counts against the ticket's provider and is retried with a fresh ticket from
   another peer (asked as a batch of one, so that it names its model's version too); a
   complete one is decoded and kept.

Peers serve the parameters only during warmup (upstream's rule). A peer that answers "not
serving now" (`peer_manager.not_serving_now`) is no failed peer: it is asked again a moment
later, until the peers' next warmup or `give_up_at`. When a peer that already served this
download some tickets says so, its warmup ended before the download had every ticket: the
rest would come from the next warmup's (newer) model, so what was collected is dropped and the
download starts again from the configuration, once the peers serve again: one model, never a
mixture of two epochs'. Every answer, the configuration's (`/psyche/model-sharing/1`) and every
ticket batch's (`model_sharing.ModelTickets`), names the version of the model its tickets are
of, a claim of the answering peer: the download takes only the version the joiner already knows
it wants (`expected_version`: its warmup's step, the version every honest provider of the
epoch's model gives), never one a peer names, so the configuration (the download's list of
parameter names) and the parameters are of one model. A peer that answers with any other
version (a provider of an older or newer window's model, or a hostile one naming any number)
is no failed peer (`PeerManager.report_other_version`): one with an older model is asked
nothing more until the download starts again, one with any other rests for a growing time; it
neither pins nor restarts the download.

Each step awaits its own `Download`, so the application's event loop has nothing to route here.
The parameters are decoded with the network's `ParameterCodec` (the application's tensors); a
download is started with `NetworkConnection.model_download` and given up when no peer has served
the model's configuration by `give_up_at`.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from psyche.network.download import DownloadComplete, DownloadFailed, DownloadOutcome
from psyche.network.identity import fmt_short
from psyche.network.model_sharing import MAX_BATCH_NAMES, batch_timeout, results_version
from psyche.network.peer_manager import (
    MAX_ERRORS_PER_PEER,
    NOT_SERVING_RETRY_SECS,
    OtherModelVersion,
    PeerManager,
    PeersUnreachable,
    blob_ticket_batch_request_task,
    blob_ticket_param_request_task,
    not_serving_now,
)
from psyche.network.scheduler import DEFAULT_MAX_CONCURRENT_PARAMETER_REQUESTS, DownloadScheduler
from psyche.network.sharable_model import CONFIG_TAG, SharableModel, parameter_tag
from psyche.network.ticket import BlobTicket
from psyche.network.transmittable import (
    DownloadType,
    ModelRequestType,
    SharableModelError,
    SharableModelFailure,
    TicketResult,
    TransmittableModelConfig,
    TransmittableModelParameter,
)

if TYPE_CHECKING:
    from psyche.network.connection import NetworkConnection

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DownloadedModel:
    config: TransmittableModelConfig
    parameters: dict[str, Any]
    """Each parameter as the network's `ParameterCodec` decodes it."""


class ModelDownload:
    def __init__(
        self,
        network: NetworkConnection,
        peers: Iterable[bytes],
        *,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT_PARAMETER_REQUESTS,
        max_errors_per_peer: int = MAX_ERRORS_PER_PEER,
        expected_version: int | None = None,
    ) -> None:
        """`expected_version`: the version of the model to take (`SharableModel.version`: the
        run's step it starts; None for a model served without one)."""
        self._network = network
        self._exhausted = False
        self._scope = trio.CancelScope()
        self._attempt = trio.CancelScope()
        self._peers = [p for p in peers if p != network.endpoint_id]
        self.peer_manager = PeerManager(
            network.connection_monitor,
            max_errors_per_peer=max_errors_per_peer,
            on_exhausted=self._on_exhausted,
        )
        self.peer_manager.set_peers(self._peers)
        self._max_concurrent = max_concurrent
        self.scheduler = DownloadScheduler(max_concurrent)
        self.model = SharableModel()
        self.retried_downloads = 0
        self.restarts = 0
        """Times the peers stopped serving before every ticket was had (a warmup ended)."""
        self._shares: dict[bytes, trio.Semaphore] = {}
        self._served_by: set[bytes] = set()
        """Peers that answered this attempt with a parameter ticket."""
        self._serving_ended = False
        self._expected_version = expected_version

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
            request, self._ask_ticket, self.peer_manager
        )
        return ticket

    # flow -------------------------------------------------------------------------------------

    async def run(self, give_up_at: float | None = None) -> DownloadedModel:
        """The whole model; raises `PeersUnreachable` once every peer failed too often (the
        peer manager's verdict cancels all requests at once, like upstream's cancel token), or
        when none has served the model's configuration, or every peer still says it serves
        none now, at `give_up_at` (`trio.current_time()`; a download under way is not cut
        short)."""
        deadline = math.inf if give_up_at is None else give_up_at
        self.peer_manager.give_up_at = deadline
        with self._scope:
            while True:
                with trio.CancelScope() as self._attempt:
                    try:
                        return await self._run(deadline)
                    except BaseExceptionGroup as group:
                        unreachable, rest = group.split(PeersUnreachable)
                        if unreachable is not None and rest is None:
                            raise _first(unreachable) from None
                        raise
                if not self._serving_ended:
                    break
                self._start_again()
                await trio.sleep(NOT_SERVING_RETRY_SECS)
        raise PeersUnreachable("Peers were unreachable for P2P parameter requests")

    def _start_again(self) -> None:
        """Drop what the ended serving window gave (its tickets and parameters) and ask every
        peer again (the connections and blob sessions stay)."""
        self.restarts += 1
        self._serving_ended = False
        self._served_by = set()
        self._shares = {}
        self.model = SharableModel()
        self.scheduler = DownloadScheduler(self._max_concurrent)
        self.peer_manager.set_peers(self._peers)

    def _check_version(self, version: int | None) -> None:
        """Take only tickets of the expected model: an answer of any other version (the peer's
        claim) raises `OtherModelVersion` (the peer manager rests the peer or, for an older
        model, asks it nothing more); a peer's version never pins nor restarts the download."""
        if version != self._expected_version:
            raise OtherModelVersion(version, self._expected_version)

    def _note_answers(self, peer: bytes, results: list[TicketResult]) -> None:
        """Remember which peers served tickets; a "not serving now" from a peer that served
        tickets in an *earlier* answer ends the attempt (`_start_again`: its serving window
        closed mid-download). An answer that mixes tickets and "not serving now" never
        reaches here from a peer that had not served (`_ask_tickets` refuses it whole)."""
        served_before = peer in self._served_by
        if any(isinstance(r, TicketResult.Ok) for r in results):
            self._served_by.add(peer)
        stopped = any(isinstance(r, TicketResult.Err) and not_serving_now(r.value) for r in results)
        if stopped and served_before and not self._serving_ended:
            logger.warning(
                "peer %s stopped serving the model before this client had all of it (its "
                "warmup ended): dropping the %d parameters received, starting again when the "
                "peers serve again",
                fmt_short(peer),
                sum(t is not None for t in (self.model.parameters or {}).values()),
            )
            self._serving_ended = True
            self._attempt.cancel()

    async def _run(self, give_up_at: float) -> DownloadedModel:
        async with trio.open_nursery() as dials:
            for peer in self.peer_manager.available_peers:
                dials.start_soon(self._dial, peer)
            with trio.move_on_at(give_up_at) as waiting:
                config = await self._fetch_config()
            if waiting.cancelled_caught:
                dials.cancel_scope.cancel()
                raise PeersUnreachable("no peer served the model's configuration in time")
            self.model.add_config(config)
            self.model.initialize_parameters(list(config.parameter_names))
            queue = deque(config.parameter_names)
            async with trio.open_nursery() as downloads:
                while queue:
                    # The peer manager hands each peer to one request at a time: one batch per
                    # peer; each batch's downloads start as its tickets arrive, and the next
                    # round of batches (names a peer had no ticket for, or more names than
                    # `MAX_BATCH_NAMES` per peer) is asked without waiting for them.
                    workers = max(1, len(self.peer_manager.available_peers))
                    share = max(1, min(MAX_BATCH_NAMES, -(-len(queue) // workers)))
                    per_provider = max(1, -(-self.scheduler.max_concurrent // workers))
                    batches: list[list[str]] = []
                    while queue and len(batches) < workers:
                        batches.append([queue.popleft() for _ in range(min(share, len(queue)))])
                    async with trio.open_nursery() as requests:
                        for batch in batches:
                            requests.start_soon(
                                self._request_batch, batch, queue, per_provider, downloads
                            )
        return DownloadedModel(config, self.model.take_parameters())

    async def _dial(self, peer: bytes) -> None:
        """Before `peer`'s first request, open and authenticate its blob session
        (`BlobRoutes.prepare`), so the first blobs wait for no handshake; only a peer whose
        side channel is not usable (none announced, behind a relay, failed lately, refused) is
        connected over libp2p here, while the configuration is fetched (a failure is the
        request's to report). A peer the side channel serves is asked and fetched from there,
        so the download dials it no libp2p connection: measured on a 1 Gbit/s link with a
        process per node, that dial's py-libp2p handshakes on the providers' event loops
        delayed their first side-channel answers by hundreds of ms on a loaded machine; a
        libp2p request made later (a fallback) dials it then."""
        addr = self._network.address_book.get(peer)
        try:
            if addr is not None and await self._network.blob_routes.prepare(addr):
                return
            await self._network.connect(peer)
        except Exception as e:
            logger.debug("connecting to %s ahead of its requests: %s", fmt_short(peer), e)

    async def _ask_ticket(self, peer: bytes, request: ModelRequestType) -> BlobTicket:
        ticket, version = await self._network.request_model_blob_ticket(peer, request)
        self._check_version(version)
        return ticket

    async def _ask_tickets(self, peer: bytes, names: list[str]) -> list[TicketResult]:
        """A batch's results from `peer`. An answer that mixes tickets and "not serving now"
        from a peer that had not served this attempt is a serving window that changed while
        it was made (a provider of this port answers a batch from one window, so only another
        provider's answer mixes): opening (the tickets are of the model wanted) or closing
        (they are of the last model, and a restart would be owed, though the peer served
        nothing before). Which one cannot be told, so none of its tickets is kept: the whole
        batch is asked again and the peer rests as "not serving now" (an opening window costs
        one more request; a closing one leaves nothing of the old model)."""
        results = await self._network.request_model_blob_tickets(peer, names)
        stopped = [
            r.value for r in results if isinstance(r, TicketResult.Err) and not_serving_now(r.value)
        ]
        served = any(isinstance(r, TicketResult.Ok) for r in results)
        if stopped and served and peer not in self._served_by:
            raise SharableModelFailure(stopped[0])  # the whole peer, not these names
        if any(isinstance(r, TicketResult.Ok) for r in results):
            self._check_version(results_version(results))
        self._note_answers(peer, results)
        errors = [r.value for r in results if isinstance(r, TicketResult.Err)]
        if errors and len(errors) == len(results) and all(map(not_serving_now, errors)):
            raise SharableModelFailure(errors[0])  # the whole peer, not these names
        return results

    async def _request_batch(
        self, names: list[str], retry: deque[str], per_provider: int, downloads: trio.Nursery
    ) -> None:
        """Ask one peer for `names`' tickets and hand them to a task that starts their
        downloads, at most `per_provider` of them in flight from that peer (so every peer gets
        its share of the capacity); names the peer has no ticket for go back to `retry`."""
        if self._exhausted:
            raise PeersUnreachable("Peers were unreachable for P2P parameter requests")
        results, peer = await blob_ticket_batch_request_task(
            names,
            self._ask_tickets,
            self.peer_manager,
            request_timeout=batch_timeout(len(names)),
        )
        failed = []
        tickets = []
        not_serving = False
        for name, result in zip(names, results, strict=True):
            match result:
                case TicketResult.Ok(ticket):
                    tickets.append((name, ticket))
                case TicketResult.Err(error):
                    failed.append(name)
                    not_serving = not_serving or not_serving_now(error)
                    logger.debug("peer %s has no ticket for %s: %s", fmt_short(peer), name, error)
        if failed:
            retry.extend(failed)
            if not_serving:
                self.peer_manager.report_not_serving(peer)
            else:
                self.peer_manager.report_blob_ticket_request_error(peer)
        if tickets:
            share = self._shares.setdefault(peer, trio.Semaphore(per_provider))
            downloads.start_soon(self._start_downloads, tickets, share, downloads)

    async def _start_downloads(
        self, tickets: list[tuple[str, BlobTicket]], share: trio.Semaphore, downloads: trio.Nursery
    ) -> None:
        for name, ticket in tickets:
            await share.acquire()
            await self.scheduler.wait_for_capacity()
            downloads.start_soon(self._complete_parameter, name, ticket, share)

    async def _ticket_again(self, name: str) -> BlobTicket:
        """A fresh ticket for `name` (its blob failed), from whichever peer is next: a batch
        of one, so that the answer names its model's version like every other."""
        while True:
            if self._exhausted:
                raise PeersUnreachable("Peers were unreachable for P2P parameter requests")
            results, peer = await blob_ticket_batch_request_task(
                [name], self._ask_tickets, self.peer_manager, request_timeout=batch_timeout(1)
            )
            match results[0]:
                case TicketResult.Ok(ticket):
                    found: BlobTicket = ticket
                    return found
                case TicketResult.Err(error):
                    logger.debug("peer %s has no ticket for %s: %s", fmt_short(peer), name, error)
                    self.peer_manager.report_blob_ticket_request_error(peer)

    async def _fetch_config(self) -> TransmittableModelConfig:
        while True:
            ticket = await self._request_ticket(ModelRequestType.Config())
            result = await self._download(ticket, CONFIG_TAG, ModelRequestType.Config())
            if isinstance(result, DownloadComplete) and isinstance(
                result.data, TransmittableModelConfig
            ):
                return result.data
            self._failed(ticket, result)

    async def _complete_parameter(
        self, name: str, ticket: BlobTicket, share: trio.Semaphore | None = None
    ) -> None:
        """Download one parameter (holding a unit of capacity, and of `share`, while its blob
        is in flight, as upstream releases capacity on `DownloadComplete`), retrying with fresh
        tickets from other peers until it is decoded and kept."""
        request = ModelRequestType.Parameter(name)
        while True:
            try:
                result = await self._download(ticket, parameter_tag(name), request)
            finally:
                self.scheduler.release_capacity()
                if share is not None:
                    share.release()
                    share = None
            if isinstance(result, DownloadComplete):
                try:
                    await self._accept_parameter(name, result.data)
                    return
                except SharableModelFailure as e:
                    logger.warning(
                        "bad parameter %s from %s: %s", name, fmt_short(ticket.provider), e
                    )
            self._failed(ticket, result)
            await self.scheduler.wait_for_capacity()
            try:
                ticket = await self._ticket_again(name)
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
        await self.model.add_parameter(data, self._network.model_codec)

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
