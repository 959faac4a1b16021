"""Blob payloads and model-sharing wire types (upstream download/manager.rs, p2p_model_sharing.rs).

Variant order is wire order: `TransmittableDownload` is `0 DistroResult`, `1 ModelParameter`,
`2 ModelConfig`; `SharableModelError` lists upstream's 16 variants in order.
"""

from __future__ import annotations

from psyche.core.serde import DataEnum, FixedBytes, struct, variant
from psyche.modeling.serialized_distro import TransmittableDistroResult
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


class TransmittableDownload(DataEnum):
    DistroResult = variant(TransmittableDistroResult)
    ModelParameter = variant(TransmittableModelParameter)
    ModelConfig = variant(TransmittableModelConfig)


class ModelRequestType(DataEnum):
    """What a joining client asks a peer for: the config first, then each parameter by name."""

    Config = variant()
    Parameter = variant(str)


class DownloadType(DataEnum):
    DistroResult = variant(list[FixedBytes[32]])
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
        match self:
            case SharableModelError.TchSerializeError(e):
                return f"Torch serialize error: {e}"
            case SharableModelError.InvalidUpdate():
                return "The update of the sharable model parameters is invalid"
            case SharableModelError.ParameterUnknown(name):
                return f"Parameter with name {name} is unknown"
            case SharableModelError.ParameterAlreadyAdded():
                return "The parameter was already added"
            case SharableModelError.SerializationError(e):
                return f"Serialization error: {e}"
            case SharableModelError.ParametersNotInitialized():
                return "Parameters were not initialized"
            case SharableModelError.ParameterNotInitialized(name):
                return f"Parameter {name} is known but was not yet initialized"
            case SharableModelError.ResponseChannelNotInitialized():
                return "Response channel was not initialized"
            case SharableModelError.ConnectionIOError(e):
                return f"Connection IO error: {e}"
            case SharableModelError.DecodeParameterNameError(e):
                return f"Could not decode UTF-8 string of model parameter name: {e}"
            case SharableModelError.ModelConfigNotInitialized():
                return "Model config not initialized"
            case SharableModelError.TokenizerConfigNotInitialized():
                return "Tokenizer config not initialized"
            case SharableModelError.ParseConfig(e):
                return f"Error parsing string to config: {e}"
            case SharableModelError.SendConfig():
                return "Could not send the config to the client"
            case SharableModelError.LoadThreadCrashed():
                return "Sharable parameter load thread crashed"
            case SharableModelError.P2PAddDownloadError(e):
                return f"P2P add download error: {e}"
        return repr(self)


class SharableModelFailure(Exception):
    """A `SharableModelError` raised in Python code (upstream returns it as `Err`)."""

    def __init__(self, error: SharableModelError) -> None:
        super().__init__(error.message())
        self.error = error


class TicketResult(DataEnum):
    """`Result<BlobTicket, SharableModelError>` as serde writes it: `Ok` = 0, `Err` = 1."""

    Ok = variant(BlobTicket)
    Err = variant(SharableModelError)
