"""The TCP data server's messages (upstream `remote/shared.rs`) and their postcard codecs.

The serde declarations below are the wire format. Requests are small and use the serde codec.
Replies carry whole batches of tokens, which the generic serde walk would encode one Python int
at a time; `ServerMessageCodec` produces the same bytes with numpy instead. That works because
every field of a reply is a varint or a single byte below 0x80 (variant indices, `BatchId` u64s,
lengths, zigzagged i32 tokens, `Option` tags), so a reply is a flat run of LEB128 varints: it is
encoded from, and decoded into, one array of integers and then (de)structured by index.
The tests check the codec against the serde declarations byte for byte.

Port extension (Python peers only; see the package README): varint-encoding every token caps
the server at a few million tokens per second, so a client may instead send
`RequestRawTrainingData`, answered by `RawTrainingData`, whose tokens are one run of
little-endian bytes. Both variants come after upstream's, so upstream's Rust code does not know
their indices: a Rust server fails to decode the request and drops the connection, which the
client takes as "upstream only" (`tcp_client`). The upstream messages are unchanged, so Rust
clients and servers interoperate with ours as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from psyche.core.batch_id import BatchId
from psyche.core.serde import (
    I32,
    U8,
    U32,
    DataEnum,
    PostcardError,
    RustEnum,
    decode_varint,
    encode_varint,
    from_bytes,
    struct,
    to_bytes,
    variant,
)
from psyche.data_provider.types import TokenizedData

# --------------------------------------------------------------------------------------------
# serde declarations (the wire format)


@struct(frozen=True)
class TokenizedDataWire:
    input_ids: list[I32]
    labels: list[I32] | None
    position_ids: list[I32] | None
    sequence_lengths: list[I32] | None


@struct(frozen=True)
class TrainingDataWire:
    data_ids: BatchId
    raw_data: list[TokenizedDataWire]


class RejectionReason(RustEnum):
    NotInThisRound = 0
    # Never sent upstream; here it answers a request for ids the server does not have.
    WrongDataIdForStep = 1


@struct(frozen=True)
class RequestRejected:
    data_ids: BatchId
    reason: RejectionReason


@struct(frozen=True)
class RawTrainingDataWire:
    """Port extension: `n = end - start + 1` sequences of `seq_len` tokens, row after row, each
    token `token_width` little-endian bytes (2: u16, 4: i32), so `len(tokens)` is exactly
    `n * seq_len * token_width`."""

    data_ids: BatchId
    seq_len: U32
    token_width: U8
    tokens: bytes


class ServerToClientMessageWire(DataEnum):
    TrainingData = variant(TrainingDataWire)
    RequestRejected = variant(RequestRejected)
    RawTrainingData = variant(RawTrainingDataWire)  # port extension


@struct(frozen=True)
class RequestTrainingData:
    data_ids: BatchId


_Request = RequestTrainingData  # the variant below shadows the struct's name in the class body


class ClientToServerMessage(DataEnum):
    RequestTrainingData = variant(_Request)
    # Port extension: "answer with RawTrainingData if you can" (or with TrainingData).
    RequestRawTrainingData = variant(_Request)


@dataclass(frozen=True)
class UpstreamRequestCodec:
    """Decodes only upstream's requests; anything else is a decode error that drops the
    connection, exactly as in a Rust server (for tests and upstream-faithful serving)."""

    def encode(self, value: ClientToServerMessage) -> bytes:
        if not isinstance(value, ClientToServerMessage.RequestTrainingData):
            raise PostcardError(f"{value!r} is not one of upstream's requests")
        return to_bytes(value, ClientToServerMessage)

    def decode(self, data: bytes | memoryview) -> ClientToServerMessage:
        message: ClientToServerMessage = from_bytes(data, ClientToServerMessage)
        requested = isinstance(message, ClientToServerMessage.RequestTrainingData)
        if not requested:
            raise PostcardError("invalid variant index 1 for ClientToServerMessage")
        return message


# --------------------------------------------------------------------------------------------
# In-memory replies (numpy token arrays)


@dataclass(frozen=True, eq=False)
class TrainingData:
    data_ids: BatchId
    raw_data: list[TokenizedData]


@dataclass(frozen=True, eq=False)
class RawTrainingData:
    """A batch as one int32 `[n, seq_len]` array (sent as `RawTrainingDataWire`)."""

    data_ids: BatchId
    tokens: np.ndarray


ServerToClientMessage = TrainingData | RequestRejected | RawTrainingData

_TRAINING_DATA = ServerToClientMessageWire.TrainingData.index
_REQUEST_REJECTED = ServerToClientMessageWire.RequestRejected.index
_RAW_TRAINING_DATA = ServerToClientMessageWire.RawTrainingData.index
_U16_MAX = 0xFFFF
_U32_MAX = 0xFFFF_FFFF
_MAX_U64_VARINT = 10
_MAX_U32_VARINT = 5


def encode_varints(values: np.ndarray) -> bytes:
    """LEB128 of each uint64 value, concatenated."""
    v = np.asarray(values, dtype=np.uint64)
    if len(v) == 0:
        return b""
    if int(v.max()) < _SMALL_LIMIT:
        return _encode_small(v.astype(np.uint32))
    return _encode_any(v)


# Values below 2**28 take at most four varint bytes: they are packed into one u32 each.
_SMALL_LIMIT = 1 << 28


def _encode_small(z: np.ndarray) -> bytes:
    more1 = (z >= 0x80).astype(np.uint32)
    more2 = (z >= 0x4000).astype(np.uint32)
    more3 = (z >= 0x20_0000).astype(np.uint32)
    packed = (
        (z & 0x7F)
        | (more1 << 7)
        | ((z << 1) & 0x7F00)
        | (more2 << 15)
        | ((z << 2) & 0x7F_0000)
        | (more3 << 23)
        | ((z << 3) & 0x7F00_0000)
    )
    rows = packed.astype("<u4").view(np.uint8).reshape(-1, 4)
    nbytes = 1 + more1 + more2 + more3
    lo, hi = int(nbytes.min()), int(nbytes.max())
    if lo == hi:
        return np.ascontiguousarray(rows[:, :lo]).tobytes()
    # Write every value's four packed bytes at its offset, last byte first: the bytes past a
    # value's length land where later values start, and the later (lower) passes overwrite them.
    ends = np.cumsum(nbytes, dtype=np.int64)
    offsets = ends - nbytes
    out = np.empty(int(ends[-1]) + 3, dtype=np.uint8)
    for k in range(hi - 1, -1, -1):
        out[offsets + k] = rows[:, k]
    return out[: int(ends[-1])].tobytes()


def _encode_any(v: np.ndarray) -> bytes:
    nbytes = np.ones(len(v), dtype=np.int64)
    for k in range(1, _MAX_U64_VARINT):
        more = v >= np.uint64(1 << (7 * k))
        if not more.any():
            break
        nbytes += more
    width = int(nbytes.max())
    digits = np.arange(width, dtype=np.uint64)
    groups = (v[:, None] >> (np.uint64(7) * digits)) & np.uint64(0x7F)
    continued = digits[None, :].astype(np.int64) < (nbytes[:, None] - 1)
    groups |= continued.astype(np.uint64) << np.uint64(7)
    present = digits[None, :].astype(np.int64) < nbytes[:, None]
    encoded: bytes = groups[present].astype(np.uint8).tobytes()
    return encoded


def decode_varints(data: bytes | memoryview) -> tuple[np.ndarray, np.ndarray]:
    """All LEB128 varints of `data` (which must end with a complete one): (values, byte lengths)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    if len(buf) == 0:
        return np.empty(0, np.uint64), np.empty(0, np.int64)
    ends = np.flatnonzero(buf < 0x80)
    if len(ends) == 0 or ends[-1] != len(buf) - 1:
        raise PostcardError("unexpected end of input in varint")
    starts = np.empty(len(ends), dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    longest = int(lengths.max())
    if longest == 1:
        return buf.astype(np.uint64), lengths
    if longest <= 4:
        # The little-endian u32 at every byte offset, then one gather per varint.
        padded = np.zeros(len(buf) + 3, dtype=np.uint32)
        padded[: len(buf)] = buf
        word = padded[:-3] | (padded[1:-2] << 8) | (padded[2:-1] << 16) | (padded[3:] << 24)
        w = word[starts] & _LENGTH_MASKS[lengths]
        values = (w & 0x7F) | ((w >> 1) & 0x3F80) | ((w >> 2) & 0x1F_C000) | ((w >> 3) & 0xFE0_0000)
        return values.astype(np.uint64), lengths
    if longest > _MAX_U64_VARINT:
        raise PostcardError(f"varint longer than {_MAX_U64_VARINT} bytes")
    if longest == _MAX_U64_VARINT and (buf[ends[lengths == _MAX_U64_VARINT]] > 1).any():
        raise PostcardError("varint does not fit in 64 bits")
    position = np.arange(len(buf), dtype=np.int64) - np.repeat(starts, lengths)
    parts = (buf & 0x7F).astype(np.uint64) << (np.uint64(7) * position.astype(np.uint64))
    return np.add.reduceat(parts, starts), lengths


_LENGTH_MASKS = np.array([0, 0xFF, 0xFFFF, 0xFF_FFFF, 0xFFFF_FFFF], dtype=np.uint32)


def _zigzag_i32(values: np.ndarray) -> np.ndarray:
    x = values.astype(np.int64)
    return (((x << 1) ^ (x >> 31)) & _U32_MAX).astype(np.uint64)


class ServerMessageCodec:
    """postcard of upstream's `ServerToClientMessage`, vectorized over the token arrays."""

    def encode(self, message: ServerToClientMessage) -> bytes:
        if isinstance(message, RawTrainingData):
            return encode_raw_training_data(message)
        if isinstance(message, RequestRejected):
            head = [_REQUEST_REJECTED, message.data_ids.start, message.data_ids.end]
            return encode_varints(np.array([*head, message.reason.value], dtype=np.uint64))
        if not isinstance(message, TrainingData):
            raise PostcardError(f"{message!r} is not a ServerToClientMessage")
        ids = message.data_ids
        parts = [
            np.array([_TRAINING_DATA, ids.start, ids.end, len(message.raw_data)], dtype=np.uint64)
        ]
        for sample in message.raw_data:
            parts.append(np.array([len(sample.input_ids)], dtype=np.uint64))
            parts.append(_zigzag_i32(sample.input_ids))
            for extra in (sample.labels, sample.position_ids, sample.sequence_lengths):
                if extra is None:
                    parts.append(np.zeros(1, dtype=np.uint64))
                else:
                    parts.append(np.array([1, len(extra)], dtype=np.uint64))
                    parts.append(_zigzag_i32(extra))
        return encode_varints(np.concatenate(parts))

    def decode(self, data: bytes | memoryview) -> ServerToClientMessage:
        view = memoryview(data)
        if len(view) and view[0] == _RAW_TRAINING_DATA:  # one byte: a varint below 0x80
            return decode_raw_training_data(view)
        values, lengths = decode_varints(view)
        return _Reader(values, lengths).message()


def encode_raw_training_data(message: RawTrainingData) -> bytes:
    """The narrowest exact width: u16 when every token fits (as pre-tokenized 2-byte data
    always does, halving the bytes), else i32."""
    tokens = message.tokens
    if tokens.ndim != 2 or tokens.dtype != np.int32:
        raise PostcardError("RawTrainingData needs a 2-D int32 token array")
    n, seq_len = tokens.shape
    ids = message.data_ids
    if n == 0 or n != ids.end - ids.start + 1 or seq_len == 0 or seq_len > _U32_MAX:
        raise PostcardError(f"a {tokens.shape} token array does not fit {ids}")
    narrow = int(tokens.min()) >= 0 and int(tokens.max()) <= _U16_MAX
    body = tokens.astype("<u2" if narrow else "<i4")
    head = bytearray([_RAW_TRAINING_DATA])
    for value in (ids.start, ids.end, seq_len):
        encode_varint(value, head)
    head.append(2 if narrow else 4)
    encode_varint(body.nbytes, head)
    return b"".join((head, body.data))


def decode_raw_training_data(view: memoryview) -> RawTrainingData:
    """Every field is checked before anything is allocated: the variant, the widths, and that
    the token bytes are exactly `n * seq_len * width` and end the message."""
    index, pos = decode_varint(view, 0, 32)
    if index != _RAW_TRAINING_DATA:
        raise PostcardError(f"expected RawTrainingData, got variant {index}")
    start, pos = decode_varint(view, pos, 64)
    end, pos = decode_varint(view, pos, 64)
    seq_len, pos = decode_varint(view, pos, 32)
    if pos >= len(view):
        raise PostcardError("unexpected end of input reading token_width")
    width = view[pos]
    length, pos = decode_varint(view, pos + 1, 64)
    if width not in (2, 4):
        raise PostcardError(f"RawTrainingData: token width {width} is neither 2 nor 4")
    if start > end or seq_len == 0:
        raise PostcardError(f"RawTrainingData: empty batch B[{start}, {end}] x {seq_len}")
    n = end - start + 1
    if length != n * seq_len * width:
        raise PostcardError(
            f"RawTrainingData: {length} token bytes, but B[{start}, {end}] of {seq_len} tokens "
            f"of {width} bytes needs {n * seq_len * width}"
        )
    if len(view) - pos != length:
        raise PostcardError(
            f"RawTrainingData: {len(view) - pos} bytes follow the header, expected {length}"
        )
    raw = np.frombuffer(view, dtype="<u2" if width == 2 else "<i4", offset=pos)
    return RawTrainingData(BatchId(start, end), raw.astype(np.int32).reshape(n, seq_len))


class _Reader:
    def __init__(self, values: np.ndarray, lengths: np.ndarray) -> None:
        self.values = values
        self.lengths = lengths
        self.pos = 0
        # Zigzag-decoded view of every value; only read where a value is an i32.
        v = values
        self.signed = ((v >> np.uint64(1)) ^ (np.uint64(0) - (v & np.uint64(1)))).view(np.int64)

    def take(self, what: str, bits: int = 64) -> int:
        if self.pos >= len(self.values):
            raise PostcardError(f"unexpected end of input reading {what}")
        value = int(self.values[self.pos])
        if bits == 32 and (value > _U32_MAX or self.lengths[self.pos] > _MAX_U32_VARINT):
            raise PostcardError(f"{what}: varint does not fit in 32 bits")
        self.pos += 1
        return value

    def i32_array(self, what: str) -> np.ndarray:
        n = self.take(f"length of {what}")
        end = self.pos + n
        if end > len(self.values):
            raise PostcardError(f"{what} claims {n} items but the input ends first")
        if n and (
            self.lengths[self.pos : end].max() > _MAX_U32_VARINT
            or self.values[self.pos : end].max() > _U32_MAX
        ):
            raise PostcardError(f"{what}: varint does not fit in 32 bits")
        out = self.signed[self.pos : end].astype(np.int32)
        self.pos = end
        return out

    def option(self, what: str) -> np.ndarray | None:
        if self.pos < len(self.lengths) and self.lengths[self.pos] != 1:
            raise PostcardError(f"invalid option tag for {what}")  # a u8, not a varint
        tag = self.take(f"option tag of {what}")
        if tag == 0:
            return None
        if tag == 1:
            return self.i32_array(what)
        raise PostcardError(f"invalid option tag {tag} for {what}")

    def message(self) -> ServerToClientMessage:
        variant_index = self.take("variant index", 32)
        data_ids = BatchId(self.take("data_ids.start"), self.take("data_ids.end"))
        if variant_index == _REQUEST_REJECTED:
            reason_index = self.take("reason", 32)
            reasons = list(RejectionReason)
            if reason_index >= len(reasons):
                raise PostcardError(f"invalid variant index {reason_index} for RejectionReason")
            result: ServerToClientMessage = RequestRejected(data_ids, reasons[reason_index])
        elif variant_index == _TRAINING_DATA:
            count = self.take("raw_data length")
            # Each sample takes at least four varints: a larger count is a lie.
            if count > (len(self.values) - self.pos) // 4:
                raise PostcardError(f"raw_data claims {count} samples but the input ends first")
            samples = []
            for i in range(count):
                input_ids = self.i32_array(f"raw_data[{i}].input_ids")
                labels = self.option(f"raw_data[{i}].labels")
                position_ids = self.option(f"raw_data[{i}].position_ids")
                sequence_lengths = self.option(f"raw_data[{i}].sequence_lengths")
                samples.append(TokenizedData(input_ids, labels, position_ids, sequence_lengths))
            result = TrainingData(data_ids, samples)
        else:
            raise PostcardError(f"invalid variant index {variant_index} for ServerToClientMessage")
        if self.pos != len(self.values):
            raise PostcardError(f"{len(self.values) - self.pos} trailing values after the message")
        return result


def to_wire(message: ServerToClientMessage) -> ServerToClientMessageWire:
    """The serde form of a reply (for checks against the serde codec; slow for big batches)."""
    wire: ServerToClientMessageWire
    if isinstance(message, RequestRejected):
        wire = ServerToClientMessageWire.RequestRejected(message)
        return wire
    if isinstance(message, RawTrainingData):
        wire = from_bytes(encode_raw_training_data(message), ServerToClientMessageWire)
        return wire

    def lst(a: np.ndarray | None) -> list[int] | None:
        return None if a is None else a.tolist()

    wire = ServerToClientMessageWire.TrainingData(
        TrainingDataWire(
            message.data_ids,
            [
                TokenizedDataWire(
                    s.input_ids.tolist(),
                    lst(s.labels),
                    lst(s.position_ids),
                    lst(s.sequence_lengths),
                )
                for s in message.raw_data
            ],
        )
    )
    return wire
