"""Client of the TCP data server (upstream `DataProviderTcpClient`).

One request, one reply, on a connection authenticated with the node's ed25519 key. A connection
that fails or is abandoned mid-request (a cancelled fetch leaves a reply in flight) is dropped and
the next request opens a new one, so a restarted server is picked up again.

Requests use the port's raw-token extension (see `wire`) until the server shows it does not
speak it: a Rust server (or `upstream_only` one) cannot decode the request and drops the
connection. The client then reconnects, repeats the request in upstream's form and, once that
succeeds, keeps using upstream's form for the rest of its life.
"""

from __future__ import annotations

import logging

import numpy as np
import trio

from psyche.core.batch_id import BatchId
from psyche.core.identity import SecretKey
from psyche.data_provider.types import (
    DataProviderError,
    TokenizedData,
    as_batch_id,
    batch_bounds,
    stack_input_ids,
)
from psyche.data_provider.wire import (
    ClientToServerMessage,
    RawTrainingData,
    RequestRejected,
    RequestTrainingData,
    ServerMessageCodec,
    ServerToClientMessage,
    TrainingData,
)
from psyche.transport import (
    CLIENT_MAX_FRAME_LENGTH,
    ConnectionClosed,
    PostcardCodec,
    TcpClient,
    TcpProtocolError,
)

log = logging.getLogger(__name__)

_REQUEST_CODEC: PostcardCodec[ClientToServerMessage] = PostcardCodec(ClientToServerMessage)
_REPLY_CODEC = ServerMessageCodec()

_CONNECTION_ERRORS = (
    ConnectionClosed,
    TcpProtocolError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    OSError,
    ValueError,
)
# How a server that cannot decode a request reacts: it closes the connection (an EOF or a reset).
_DROPPED = (ConnectionClosed, trio.BrokenResourceError, ConnectionResetError)


class _RoundTripFailed(Exception):
    pass


class DataProviderTcpClient:
    def __init__(
        self, address: str, secret_key: SecretKey, *, max_frame: int = CLIENT_MAX_FRAME_LENGTH
    ) -> None:
        self.address = address
        self._secret_key = secret_key
        self._max_frame = max_frame
        self._client: TcpClient[ClientToServerMessage, ServerToClientMessage] | None = None
        self.raw_replies: bool | None = None
        """Whether the server answers the raw-token request (None until a request has shown);
        set it to False to use only upstream's messages."""

    @classmethod
    async def connect(
        cls, address: str, secret_key: SecretKey, *, max_frame: int = CLIENT_MAX_FRAME_LENGTH
    ) -> DataProviderTcpClient:
        client = cls(address, secret_key, max_frame=max_frame)
        await client._connection()
        return client

    async def _connection(self) -> TcpClient[ClientToServerMessage, ServerToClientMessage]:
        if self._client is None:
            try:
                self._client = await TcpClient.connect(
                    self.address,
                    self._secret_key,
                    to_server=_REQUEST_CODEC,
                    to_client=_REPLY_CODEC,
                    max_frame=self._max_frame,
                )
            except (*_CONNECTION_ERRORS, trio.TooSlowError) as e:
                raise DataProviderError(f"cannot connect to data server {self.address}: {e}") from e
        return self._client

    async def _round_trip(self, request: ClientToServerMessage) -> ServerToClientMessage:
        if self._client is not None and self._client.closed_by_peer():
            # The server closed it while it sat unused (its idle timeout, a restart): a new one.
            log.debug("data server %s closed an unused connection", self.address)
            await self.aclose()
        client = await self._connection()
        try:
            await client.send(request)
            return await client.receive()
        except BaseException as e:
            # Whatever happened (including cancellation), this connection's request/reply
            # pairing is lost: start over on a new one next time.
            self._client = None
            await client.aclose()
            if isinstance(e, _CONNECTION_ERRORS):
                raise _RoundTripFailed(e) from e
            raise

    async def _request(self, data_ids: BatchId) -> ServerToClientMessage:
        upstream = ClientToServerMessage.RequestTrainingData(RequestTrainingData(data_ids))
        try:
            if self.raw_replies is False:
                return await self._round_trip(upstream)
            raw = ClientToServerMessage.RequestRawTrainingData(RequestTrainingData(data_ids))
            try:
                reply = await self._round_trip(raw)
            except _RoundTripFailed as e:
                if self.raw_replies or not isinstance(e.__cause__, _DROPPED):
                    raise
                log.info(
                    "data server %s dropped the connection on the raw-token request (%s); "
                    "retrying in upstream's form",
                    self.address,
                    e.__cause__,
                )
                try:
                    reply = await self._round_trip(upstream)
                except DataProviderError as again:  # could not even reconnect: the server is gone
                    raise DataProviderError(
                        f"data server {self.address} failed while serving {data_ids}: "
                        f"{e.__cause__} (then: {again})"
                    ) from e.__cause__
                self.raw_replies = False
                return reply
            self.raw_replies = True
            return reply
        except _RoundTripFailed as e:
            raise DataProviderError(
                f"data server {self.address} failed while serving {data_ids}: {e.__cause__}"
            ) from e.__cause__

    async def _fetch(self, data_ids: BatchId) -> TrainingData | RawTrainingData:
        batch_bounds(data_ids)
        data_ids = as_batch_id(data_ids)
        reply = await self._request(data_ids)
        if isinstance(reply, RequestRejected):
            raise DataProviderError(
                f"data server {self.address} rejected {reply.data_ids}: {reply.reason.name}"
            )
        if not isinstance(reply, TrainingData | RawTrainingData):
            raise DataProviderError(f"Unexpected message from server {reply!r}")
        if reply.data_ids != data_ids:
            raise DataProviderError("Received data_id does not match requested data_id")
        if (
            isinstance(reply, TrainingData)
            and len(reply.raw_data) != data_ids.end - data_ids.start + 1
        ):
            raise DataProviderError(
                f"data server {self.address} sent {len(reply.raw_data)} samples for {data_ids}"
            )
        return reply

    async def get_samples(self, data_ids: BatchId) -> list[TokenizedData]:
        reply = await self._fetch(data_ids)
        if isinstance(reply, RawTrainingData):
            return TokenizedData.from_rows(reply.tokens)
        return reply.raw_data

    async def get_batch(self, data_ids: BatchId) -> np.ndarray:
        """The batch as one int32 `[n, seq_len]` array; an error if the server sent samples
        that are not bare token runs of one length (use `get_samples` for those)."""
        reply = await self._fetch(data_ids)
        if isinstance(reply, RawTrainingData):
            return reply.tokens
        samples = reply.raw_data
        if (
            any(
                s.labels is not None or s.position_ids is not None or s.sequence_lengths is not None
                for s in samples
            )
            or len({len(s.input_ids) for s in samples}) != 1
        ):
            raise DataProviderError(
                f"data server {self.address} sent {data_ids} as samples with extras or of "
                "different lengths: read them with get_samples"
            )
        return stack_input_ids(samples)

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()
