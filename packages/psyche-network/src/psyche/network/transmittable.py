"""Blob payloads and model-sharing wire types (upstream download/manager.rs, p2p_model_sharing.rs).

A blob is upstream's `TransmittableDownload` enum in postcard, generic here in its first
variant: `TransmittableDownload<D> { DistroResult(D), ModelParameter(..), ModelConfig(..) }`.
Variant order is wire order (0 DistroResult, 1 ModelParameter, 2 ModelConfig). The model-sharing
payloads are this package's; the DisTrO result is the application's, so its type reaches the
network as a parameter (`download_codec(distro_result_type)`) and psyche.network never imports the
package that defines it. `SharableModelError` lists upstream's 16 variants in order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from psyche.core.serde import (
    DataEnum,
    FixedBytes,
    from_bytes,
    prepare_decoder,
    struct,
    to_bytes,
    variant,
)
from psyche.network.ticket import BlobTicket


@struct(frozen=True)
class TransmittableModelParameter:
    param_name_bytes: bytes
    param_value_bytes: bytes

    def name(self) -> str:
        try:
            return str(self.param_name_bytes, "utf-8")  # bytes or a view of a received blob
        except UnicodeDecodeError as e:
            raise SharableModelFailure(SharableModelError.DecodeParameterNameError(str(e))) from e


@struct(frozen=True)
class TransmittableModelConfig:
    config: str
    tokenizer: str
    parameter_names: list[str]


@dataclass(frozen=True)
class DownloadCodec:
    """How blobs are written and read: `TransmittableDownload<D>` for one payload type `D`.

    Payloads travel bare through the network's API (`add_downloadable(payload, tag)`,
    `DownloadComplete.data`): the variant follows from the payload's type, so the three payload
    types must differ. `decode` copies nothing: its `bytes` fields are read-only views into the
    blob, which the downloader has already checked against the ticket's hash.
    """

    wire_enum: type[DataEnum]
    """The enum as serde declares it: its bytes are exactly upstream's."""
    variant_of: Mapping[type, Callable[[Any], DataEnum]]
    """Each payload type's variant of `wire_enum` (the payload's exact type picks it)."""

    def encode(self, payload: Any) -> bytes:
        variant_of = self.variant_of.get(type(payload))
        if variant_of is None:
            names = ", ".join(t.__name__ for t in self.variant_of)
            raise TypeError(f"{type(payload).__name__} is not a blob payload (one of {names})")
        return to_bytes(variant_of(payload), self.wire_enum)

    def decode(self, blob: bytes | bytearray | memoryview) -> Any:
        """The payload; `PostcardError` for bytes that are not a `TransmittableDownload<D>`."""
        return from_bytes(blob, self.wire_enum, borrow=True).value


@functools.cache
def download_codec(distro_result_type: Any) -> DownloadCodec:
    """The codec whose DistroResult variant carries `distro_result_type` (one per type)."""

    class TransmittableDownload(DataEnum):
        DistroResult = variant(distro_result_type)
        ModelParameter = variant(TransmittableModelParameter)
        ModelConfig = variant(TransmittableModelConfig)

    # Compiled now, on the event loop, before any worker thread decodes.
    prepare_decoder(TransmittableDownload, borrow=True)
    return DownloadCodec(
        TransmittableDownload,
        {
            distro_result_type: TransmittableDownload.DistroResult,
            TransmittableModelParameter: TransmittableDownload.ModelParameter,
            TransmittableModelConfig: TransmittableDownload.ModelConfig,
        },
    )


class ModelRequestType(DataEnum):
    """What a joining client asks a peer for: the config first, then each parameter by name."""

    Config = variant()
    Parameter = variant(str)


class DownloadType(DataEnum):
    DistroResult = variant(list[Annotated[bytes, FixedBytes(32)]])
    """Other peers to try when the ticket's provider fails."""
    ModelSharing = variant(ModelRequestType)

    def kind(self) -> str:
        return "distro_result" if isinstance(self, DownloadType.DistroResult) else "model_sharing"


class SharableModelError(DataEnum):
    TchSerializeError = variant(str)
    InvalidUpdate = variant()
    ParameterUnknown = variant(str)
    ParameterAlreadyAdded = variant()
    SerializationError = variant(str)
    ParametersNotInitialized = variant()
    ParameterNotInitialized = variant(str)
    ResponseChannelNotInitialized = variant()
    ConnectionIOError = variant(str)
    DecodeParameterNameError = variant(str)
    ModelConfigNotInitialized = variant()
    TokenizerConfigNotInitialized = variant()
    ParseConfig = variant(str)
    SendConfig = variant()
    LoadThreadCrashed = variant()
    P2PAddDownloadError = variant(str)

    def message(self) -> str:
        """Upstream's `#[error(...)]` text for this variant (`_ERROR_MESSAGES`)."""
        template = _ERROR_MESSAGES.get(type(self))
        if template is None:
            return repr(self)
        # a unit variant has no payload; `format` ignores the unused argument
        return template.format(getattr(self, "value", None))


_ERROR_MESSAGES: dict[type, str] = {
    SharableModelError.TchSerializeError: "Torch serialize error: {}",
    SharableModelError.InvalidUpdate: "The update of the sharable model parameters is invalid",
    SharableModelError.ParameterUnknown: "Parameter with name {} is unknown",
    SharableModelError.ParameterAlreadyAdded: "The parameter was already added",
    SharableModelError.SerializationError: "Serialization error: {}",
    SharableModelError.ParametersNotInitialized: "Parameters were not initialized",
    SharableModelError.ParameterNotInitialized: "Parameter {} is known but was not yet initialized",
    SharableModelError.ResponseChannelNotInitialized: "Response channel was not initialized",
    SharableModelError.ConnectionIOError: "Connection IO error: {}",
    SharableModelError.DecodeParameterNameError: (
        "Could not decode UTF-8 string of model parameter name: {}"
    ),
    SharableModelError.ModelConfigNotInitialized: "Model config not initialized",
    SharableModelError.TokenizerConfigNotInitialized: "Tokenizer config not initialized",
    SharableModelError.ParseConfig: "Error parsing string to config: {}",
    SharableModelError.SendConfig: "Could not send the config to the client",
    SharableModelError.LoadThreadCrashed: "Sharable parameter load thread crashed",
    SharableModelError.P2PAddDownloadError: "P2P add download error: {}",
}
"""Each `SharableModelError` variant's message (upstream's `#[error(...)]`), `{}` its payload."""


class SharableModelFailure(Exception):
    """A `SharableModelError` raised in Python code (upstream returns it as `Err`)."""

    def __init__(self, error: SharableModelError) -> None:
        super().__init__(error.message())
        self.error = error


class TicketResult(DataEnum):
    """`Result<BlobTicket, SharableModelError>` as serde writes it: `Ok` = 0, `Err` = 1."""

    Ok = variant(BlobTicket)
    Err = variant(SharableModelError)
