"""What P2P model sharing hands out and collects: the model config and every parameter as blobs.

`SharableModel` holds the provider's bf16 parameters (serialized on first request) and, on a
joining client, the parameters downloaded so far; `answer_request` is a provider's reply to one
request of the model-sharing protocol (`model_sharing`). Tensors travel as single-tensor
safetensors files (upstream: tch archives), so decoding hostile bytes never runs pickle. torch is
imported lazily: an application that shares a model has it, and psyche-network does not install it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import trio

from psyche.network.ticket import BlobTicket
from psyche.network.transmittable import (
    ModelRequestType,
    SharableModelError,
    SharableModelFailure,
    TicketResult,
    TransmittableModelConfig,
    TransmittableModelParameter,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

CONFIG_TAG = "model-config"
_TENSOR_KEY = "value"


def parameter_tag(name: str) -> str:
    return f"model-{name}"


# ----------------------------------------------------------------------------------------------
# Tensors


def serialize_tensor(tensor: torch.Tensor) -> bytes:
    from safetensors.torch import save

    return save({_TENSOR_KEY: tensor.detach().to("cpu").contiguous()})


def deserialize_tensor(data: bytes) -> torch.Tensor:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(bytes(data))
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise SharableModelFailure(SharableModelError.SerializationError(str(e))) from e
    if set(tensors) != {_TENSOR_KEY}:
        raise SharableModelFailure(
            SharableModelError.SerializationError("expected exactly one tensor")
        )
    return tensors[_TENSOR_KEY]


def model_hash(parameters: Mapping[str, torch.Tensor]) -> bytes:
    """SHA-256 over every parameter (sorted by name): name, dtype, shape and raw bytes.

    Two models with equal hashes hold bit-identical tensors.
    """
    hasher = hashlib.sha256()
    for name in sorted(parameters):
        tensor = parameters[name].detach().to("cpu").contiguous()
        hasher.update(name.encode("utf-8") + b"\0")
        hasher.update(f"{tensor.dtype}|{tuple(tensor.shape)}\0".encode())
        hasher.update(_raw_bytes(tensor))
    return hasher.digest()


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    import torch

    flat = tensor.reshape(-1)
    if flat.dtype in (torch.bfloat16, torch.float16):
        flat = flat.view(torch.int16)
    elif flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.numpy().tobytes()


# ----------------------------------------------------------------------------------------------
# SharableModel


AddDownloadable = Callable[[Any, str], Awaitable[tuple[BlobTicket, int]]]
"""`NetworkConnection.add_downloadable`: encode a blob payload, store it, ticket it."""


class SharableModel:
    """Provider side: `update_parameters` after cooldown, `clear_cache` on RoundTrain, so peers
    are served only in between (warmup), as upstream. Joiner side: `initialize_parameters`,
    `add_parameter`, `add_config`, `take_parameters`."""

    def __init__(self) -> None:
        self.parameters: dict[str, torch.Tensor | None] | None = None
        self.serialized_parameters: dict[str, BlobTicket] | None = None
        self.model_config: str | None = None
        self.tokenizer_config: str | None = None
        self.config_ticket: BlobTicket | None = None
        self.parameters_to_download: list[str] = []

    # provider ---------------------------------------------------------------------------------

    def update_parameters(self, new_parameters: Mapping[str, torch.Tensor]) -> None:
        if self.parameters is not None and set(new_parameters) != set(self.parameters):
            raise SharableModelFailure(SharableModelError.InvalidUpdate())
        self.parameters = dict(new_parameters)
        self.serialized_parameters = {}

    def update_config(self, model_config: str, tokenizer_config: str) -> None:
        self.model_config = model_config
        self.tokenizer_config = tokenizer_config
        self.config_ticket = None

    async def get_transmittable_parameter(
        self, name: str, add_downloadable: AddDownloadable
    ) -> BlobTicket:
        if self.parameters is None or self.serialized_parameters is None:
            raise SharableModelFailure(SharableModelError.ParametersNotInitialized())
        cached = self.serialized_parameters.get(name)
        if cached is not None:
            return cached
        if name not in self.parameters:
            raise SharableModelFailure(SharableModelError.ParameterUnknown(name))
        tensor = self.parameters[name]
        if tensor is None:
            raise SharableModelFailure(SharableModelError.ParameterNotInitialized(name))
        serialized = self.serialized_parameters
        value = await trio.to_thread.run_sync(serialize_tensor, tensor)
        payload = TransmittableModelParameter(name.encode("utf-8"), value)
        try:
            ticket, _ = await add_downloadable(payload, parameter_tag(name))
        except Exception as e:
            raise SharableModelFailure(SharableModelError.P2PAddDownloadError(str(e))) from e
        serialized[name] = ticket
        return ticket

    async def get_transmittable_config(self, add_downloadable: AddDownloadable) -> BlobTicket:
        if self.config_ticket is not None:
            return self.config_ticket
        if self.model_config is None:
            raise SharableModelFailure(SharableModelError.ModelConfigNotInitialized())
        if self.tokenizer_config is None:
            raise SharableModelFailure(SharableModelError.TokenizerConfigNotInitialized())
        if self.parameters is None:
            raise SharableModelFailure(SharableModelError.ModelConfigNotInitialized())
        payload = TransmittableModelConfig(
            self.model_config, self.tokenizer_config, list(self.parameters)
        )
        try:
            ticket, _ = await add_downloadable(payload, CONFIG_TAG)
        except Exception as e:
            raise SharableModelFailure(SharableModelError.P2PAddDownloadError(str(e))) from e
        self.config_ticket = ticket
        return ticket

    def clear_cache(self) -> None:
        self.config_ticket = None
        self.serialized_parameters = None

    def stop_sharing(self) -> None:
        """Serve nothing until the next `update_parameters`: the run went on without this
        client, so the model it holds is no longer the run's (a joiner must not load it)."""
        self.clear_cache()
        self.parameters = None

    # joiner -----------------------------------------------------------------------------------

    def initialize_parameters(self, names: list[str]) -> None:
        self.parameters = dict.fromkeys(names)

    async def add_parameter(self, parameter: TransmittableModelParameter) -> str:
        if self.parameters is None:
            raise SharableModelFailure(SharableModelError.ParametersNotInitialized())
        name = parameter.name()
        if name not in self.parameters:
            raise SharableModelFailure(SharableModelError.ParameterUnknown(name))
        tensor = await trio.to_thread.run_sync(deserialize_tensor, parameter.param_value_bytes)
        if self.parameters[name] is not None:
            logger.warning("Parameter %s was already added to the model, ignoring it", name)
        self.parameters[name] = tensor
        return name

    def add_config(self, config: TransmittableModelConfig) -> None:
        self.model_config = config.config
        self.tokenizer_config = config.tokenizer
        self.parameters_to_download = list(config.parameter_names)

    def take_parameters(self) -> dict[str, torch.Tensor]:
        if self.parameters is None:
            raise SharableModelFailure(SharableModelError.ParametersNotInitialized())
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self.parameters.items():
            if tensor is None:
                raise SharableModelFailure(SharableModelError.ParameterNotInitialized(name))
            out[name] = tensor
        self.parameters = None
        return out


async def answer_request(
    request: ModelRequestType, model: SharableModel, add_downloadable: AddDownloadable
) -> TicketResult:
    """What a provider replies to a parameter or config request."""
    try:
        match request:
            case ModelRequestType.Parameter(name):
                ticket = await model.get_transmittable_parameter(name, add_downloadable)
            case _:
                ticket = await model.get_transmittable_config(add_downloadable)
    except SharableModelFailure as failure:
        return TicketResult.Err(failure.error)
    return TicketResult.Ok(ticket)
