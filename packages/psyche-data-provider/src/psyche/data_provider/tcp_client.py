"""Client of the TCP data server (upstream `DataProviderTcpClient`).

One request, one reply, on a connection authenticated with the node's ed25519 key. A connection
that fails or is abandoned mid-request (a cancelled fetch leaves a reply in flight) is dropped and
the next request opens a new one, so a restarted server is picked up again.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from psyche.core.batch_id import BatchId
from psyche.data_provider.types import DataProviderError, TokenizedData, as_batch_id, batch_bounds
from psyche.data_provider.wire import (
    ClientToServerMessage,
    RequestRejected,
    RequestTrainingData,
    ServerMessageCodec,
    ServerToClientMessage,
    TrainingData,
)
from psyche.network.tcp import (
    CLIENT_MAX_FRAME_LENGTH,
    ConnectionClosed,
    PostcardCodec,
    TcpClient,
    TcpProtocolError,
)

log = logging.getLogger(__name__)

_REQUEST_CODEC = PostcardCodec(ClientToServerMessage)
_REPLY_CODEC = ServerMessageCodec()

_CONNECTION_ERRORS = (
    ConnectionClosed,
    TcpProtocolError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    OSError,
    ValueError,
)


class DataProviderTcpClient:
    def __init__(self, address: str, secret_key: Any, *, max_frame: int = CLIENT_MAX_FRAME_LENGTH):
        self.address = address
        self._secret_key = secret_key
        self._max_frame = max_frame
        self._client: TcpClient[ClientToServerMessage, ServerToClientMessage] | None = None

    @classmethod
    async def connect(
        cls, address: str, secret_key: Any, *, max_frame: int = CLIENT_MAX_FRAME_LENGTH
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

    async def get_samples(self, data_ids: BatchId) -> list[TokenizedData]:
        batch_bounds(data_ids)
        data_ids = as_batch_id(data_ids)
        client = await self._connection()
        try:
            await client.send(
                ClientToServerMessage.RequestTrainingData(RequestTrainingData(data_ids))
            )
            reply = await client.receive()
        except BaseException as e:
            # Whatever happened (including cancellation), this connection's request/reply
            # pairing is lost: start over on a new one next time.
            self._client = None
            await client.aclose()
            if isinstance(e, _CONNECTION_ERRORS):
                raise DataProviderError(
                    f"data server {self.address} failed while serving {data_ids}: {e}"
                ) from e
            raise
        if isinstance(reply, RequestRejected):
            raise DataProviderError(
                f"data server {self.address} rejected {reply.data_ids}: {reply.reason.name}"
            )
        if not isinstance(reply, TrainingData):
            raise DataProviderError(f"Unexpected message from server {reply!r}")
        if reply.data_ids != data_ids:
            raise DataProviderError("Received data_id does not match requested data_id")
        return reply.raw_data

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()
