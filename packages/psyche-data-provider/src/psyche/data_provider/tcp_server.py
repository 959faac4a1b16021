"""The TCP data server: hosts a dataset for the clients of one run (upstream
`DataProviderTcpServer`).

Only clients of the run may fetch. Hosted by a coordinator, that is the clients of the current
epoch (`update_from_coordinator` after every state change, as upstream); standalone, it is an
explicit allowlist of ed25519 public keys (`set_allowed`), or anyone with `allow_any`.

A request that cannot be served gets a `RequestRejected` reply and the server carries on:
`NotInThisRound` for a key outside the run, `WrongDataIdForStep` for ids the dataset does not
have, a failed read or a reply too large for one frame (upstream never sends the latter reason;
it panics on a provider error instead).

Upstream's `RequestTrainingData` gets upstream's `TrainingData` reply. The port's
`RequestRawTrainingData` (see `wire`) gets `RawTrainingData` when the batch is plain tokens
of one length, else `TrainingData`. `upstream_only=True` serves exactly as a Rust server does:
the extension request fails to decode and drops the connection.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import trio

from psyche.core.batch_id import BatchId
from psyche.core.drop_log import DropLog
from psyche.data_provider.types import (
    BatchDataProvider,
    DataProviderError,
    TokenizedData,
    TokenizedDataProvider,
    batch_bounds,
)
from psyche.data_provider.wire import (
    ClientToServerMessage,
    RawTrainingData,
    RejectionReason,
    RequestRejected,
    ServerMessageCodec,
    ServerToClientMessage,
    TrainingData,
    UpstreamRequestCodec,
)
from psyche.transport import (
    CLIENT_MAX_FRAME_LENGTH,
    SERVER_MAX_FRAME_LENGTH,
    Codec,
    ConnectionLimits,
    Disconnected,
    FrameTooLarge,
    Message,
    PostcardCodec,
    TcpServer,
)

log = logging.getLogger(__name__)

# Replies with more tokens than these are encoded in a worker thread, so that other clients are
# not stalled meanwhile; below them the thread hop costs more than it saves. Varint encoding
# costs ~30 ns a token, a raw reply ~1 ns (a copy).
THREAD_ENCODE_VARINT_TOKENS = 16_384
THREAD_ENCODE_RAW_TOKENS = 1 << 20


class DataProviderTcpServer:
    def __init__(
        self,
        tcp_server: TcpServer[ClientToServerMessage, ServerToClientMessage],
        provider: TokenizedDataProvider,
        *,
        allowed: Iterable[bytes] = (),
        allow_any: bool = False,
    ) -> None:
        self._tcp = tcp_server
        self._provider = provider
        self._allowed: frozenset[bytes] = frozenset(bytes(k) for k in allowed)
        self.allow_any = allow_any
        self.provided_sequences: dict[bytes, int] = {}
        # Each token takes at least one byte on the wire: a batch of more tokens than the frame
        # limit can never be sent, so it is refused before anything is read.
        self._seq_len: int | None = getattr(provider, "seq_len", None)
        # A stranger may send request after request: one log line per reason and interval.
        self.rejections = DropLog(log, "rejected data requests")

    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        provider: TokenizedDataProvider,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        allowed: Iterable[bytes] = (),
        allow_any: bool = False,
        max_send_frame: int = CLIENT_MAX_FRAME_LENGTH,
        upstream_only: bool = False,
        limits: ConnectionLimits | None = None,
    ) -> AsyncIterator[DataProviderTcpServer]:
        """Serve `provider` on `host:port` (0: any free port) for the duration of the block.

        Replies may be as large as the client's frame limit (upstream's server is capped at its
        own 8 MiB default, so large batches failed there). `limits` bound what connections can
        make the server hold (`psyche.transport`; defaults when None).
        """
        requests: Codec[ClientToServerMessage] = (
            UpstreamRequestCodec() if upstream_only else PostcardCodec(ClientToServerMessage)
        )
        async with (
            TcpServer.start(
                to_server=requests,
                to_client=ServerMessageCodec(),
                host=host,
                port=port,
                max_receive_frame=SERVER_MAX_FRAME_LENGTH,
                max_send_frame=max_send_frame,
                limits=limits,
            ) as tcp,
            trio.open_nursery() as nursery,
        ):
            server = cls(tcp, provider, allowed=allowed, allow_any=allow_any)
            nursery.start_soon(server.run)
            nursery.start_soon(server.rejections.run)
            try:
                yield server
            finally:
                nursery.cancel_scope.cancel()

    @property
    def local_addr(self) -> tuple[str, int]:
        return self._tcp.local_addr

    def connected_clients(self) -> list[bytes]:
        return self._tcp.connected_clients()

    @property
    def limits(self) -> ConnectionLimits:
        return self._tcp.limits

    @property
    def drops(self) -> DropLog:
        """The connections refused and dropped so far (`drops.counts`, by kind)."""
        return self._tcp.drops

    # -- who may fetch

    def set_allowed(self, keys: Iterable[bytes]) -> None:
        self._allowed = frozenset(bytes(k) for k in keys)

    def update_from_coordinator(self, state: Any) -> None:
        """Allow exactly the clients of the coordinator's current epoch (by p2p identity)."""
        self.set_allowed(client.id.p2p_identity for client in state.epoch_state.clients)

    def is_allowed(self, key: bytes) -> bool:
        return self.allow_any or key in self._allowed

    # -- serving

    async def run(self) -> None:
        async for event in self._tcp:
            match event:
                case Message(client, ClientToServerMessage.RequestTrainingData(request)):
                    await self.handle_request(client, request.data_ids)
                case Message(client, ClientToServerMessage.RequestRawTrainingData(request)):
                    await self.handle_request(client, request.data_ids, raw=True)
                case Disconnected(client):
                    log.debug("client %s disconnected", client.hex())

    def _reject(self, client: bytes, data_ids: BatchId, reason: RejectionReason, why: str) -> None:
        self.rejections.note(reason.name, f"rejecting {data_ids} from {client.hex()}: {why}")
        self._tcp.send_to(client, RequestRejected(data_ids, reason))

    async def handle_request(self, client: bytes, data_ids: BatchId, *, raw: bool = False) -> None:
        if not self.is_allowed(client):
            self._reject(client, data_ids, RejectionReason.NotInThisRound, "not in this round")
            return
        try:
            start, end = batch_bounds(data_ids)
            count = end - start + 1
            if self._seq_len is not None and count * self._seq_len > self._tcp.max_send_frame:
                raise DataProviderError(
                    f"{count} samples of {self._seq_len} tokens cannot fit in one frame"
                )
            reply = await self._read(data_ids, raw)
            if isinstance(reply, RawTrainingData):
                in_thread = reply.tokens.size > THREAD_ENCODE_RAW_TOKENS
            else:
                tokens = sum(len(s.input_ids) for s in reply.raw_data)
                in_thread = tokens > THREAD_ENCODE_VARINT_TOKENS
            if in_thread:
                payload = await trio.to_thread.run_sync(self._tcp.encode, reply)
            else:
                payload = self._tcp.encode(reply)
        except (DataProviderError, FrameTooLarge) as e:
            self._reject(client, data_ids, RejectionReason.WrongDataIdForStep, str(e))
            return
        except Exception as e:
            # A provider bug answers this request with a rejection; the server keeps serving.
            log.exception("provider failed on %s", data_ids)
            self._reject(client, data_ids, RejectionReason.WrongDataIdForStep, repr(e))
            return
        self._tcp.send_encoded(client, payload)
        self.provided_sequences[client] = self.provided_sequences.get(client, 0) + count
        log.debug("sent %s to %s", data_ids, client.hex())

    async def _read(self, data_ids: BatchId, raw: bool) -> TrainingData | RawTrainingData:
        if raw and isinstance(self._provider, BatchDataProvider):
            return RawTrainingData(data_ids, await self._provider.get_batch(data_ids))
        samples = await self._provider.get_samples(data_ids)
        if raw and (block := _plain_block(samples)) is not None:
            return RawTrainingData(data_ids, block)
        return TrainingData(data_ids, samples)


def _plain_block(samples: list[TokenizedData]) -> np.ndarray | None:
    """The samples as one `[n, seq_len]` array when they are bare token runs of one length
    (anything with labels, position ids or packing goes in upstream's form)."""
    if not samples or any(
        s.labels is not None or s.position_ids is not None or s.sequence_lengths is not None
        for s in samples
    ):
        return None
    seq_len = len(samples[0].input_ids)
    if seq_len == 0 or any(len(s.input_ids) != seq_len for s in samples):
        return None
    return np.stack([s.input_ids for s in samples])
