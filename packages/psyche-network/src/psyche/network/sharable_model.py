"""What P2P model sharing hands out and collects: the model config and every parameter as blobs.

`SharableModel` holds the provider's parameters (serialized on first request) and, on a joining
client, the parameters downloaded so far; `answer_request` is a provider's reply to one request
of the model-sharing protocol (`model_sharing`). What a parameter is, and how it becomes bytes,
is the application's: a `ParameterCodec` it hands `NetworkConnection.open` (the client's is
`psyche.modeling.sharing.TENSOR_CODEC`: one-tensor safetensors files, so decoding hostile bytes
never runs pickle), as it hands it the DisTrO payload type. psyche.network never imports torch.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

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

logger = logging.getLogger(__name__)

CONFIG_TAG = "model-config"

_generations = itertools.count(1)


def parameter_tag(name: str) -> str:
    return f"model-{name}"


# ----------------------------------------------------------------------------------------------
# Parameters


class ParameterCodec(Protocol):
    """How the application's model parameters become blob bytes and back."""

    def encode(self, parameter: Any) -> bytes: ...

    def decode(self, data: bytes | memoryview) -> Any:
        """The parameter; `ValueError` for bytes that are not one."""
        ...


class NoModelCodec:
    """The codec of a node opened without one: it shares and fetches no parameters."""

    def encode(self, parameter: Any) -> bytes:
        raise ValueError("this node was opened without a model codec: it shares no parameters")

    def decode(self, data: bytes | memoryview) -> Any:
        raise ValueError("this node was opened without a model codec: it fetches no parameters")


# ----------------------------------------------------------------------------------------------
# SharableModel


AddDownloadable = Callable[[Any, str], Awaitable[tuple[BlobTicket, int]]]
"""`NetworkConnection.add_downloadable`: encode a blob payload, store it, ticket it."""


class SharableModel:
    """Provider side: `update_parameters` after cooldown, `clear_cache` on RoundTrain, so peers
    are served only in between (warmup), as upstream. Joiner side: `initialize_parameters`,
    `add_parameter`, `add_config`, `take_parameters`."""

    def __init__(self) -> None:
        self.version: int | None = None
        """Which model the parameters are (`update_parameters`); None: not said."""
        self.generation = next(_generations)
        """The serving window: a new number (unique in the process) whenever what is served
        changes (`update_parameters`, `clear_cache`, `stop_sharing`), so that two answers of
        one generation are of one model even where no version names it."""
        self.parameters: dict[str, Any | None] | None = None
        self.serialized_parameters: dict[str, BlobTicket] | None = None
        self._serializing: dict[str, trio.Event] = {}
        """Parameters being serialized now (for `serialized_parameters`), set when done."""
        self._ahead: dict[str, BlobTicket] | None = None
        """The `serialized_parameters` a `serialize_ahead` was started for (one per model)."""
        self.model_config: str | None = None
        self.tokenizer_config: str | None = None
        self.config_ticket: BlobTicket | None = None
        self.parameters_to_download: list[str] = []

    # provider ---------------------------------------------------------------------------------

    def update_parameters(
        self, new_parameters: Mapping[str, Any], version: int | None = None
    ) -> None:
        """Serve `new_parameters` from now on; `version` names the model so that joiners can
        tell two serving windows' models apart: the client gives the run's step the model
        starts (one past the last step trained into it), which every honest provider of the
        same model gives alike, the ones that trained the epoch and the ones that loaded the
        model in the warmup."""
        if self.parameters is not None and set(new_parameters) != set(self.parameters):
            raise SharableModelFailure(SharableModelError.InvalidUpdate())
        self.version = version
        self.generation = next(_generations)
        self.parameters = dict(new_parameters)
        self.serialized_parameters = {}
        self._serializing = {}

    def update_config(self, model_config: str, tokenizer_config: str) -> None:
        self.model_config = model_config
        self.tokenizer_config = tokenizer_config
        self.config_ticket = None

    async def get_transmittable_parameter(
        self, name: str, add_downloadable: AddDownloadable, codec: ParameterCodec
    ) -> BlobTicket:
        """The parameter's ticket, serializing it on first request; a request for a parameter
        already being serialized (another joiner's, or `serialize_ahead`) waits for that one
        instead of serializing it twice."""
        while True:
            if self.parameters is None or self.serialized_parameters is None:
                raise SharableModelFailure(SharableModelError.ParametersNotInitialized())
            cached = self.serialized_parameters.get(name)
            if cached is not None:
                return cached
            under_way = self._serializing.get(name)
            if under_way is None:
                break
            await under_way.wait()  # then its ticket, or (it failed) serialize it here
        if name not in self.parameters:
            raise SharableModelFailure(SharableModelError.ParameterUnknown(name))
        tensor = self.parameters[name]
        if tensor is None:
            raise SharableModelFailure(SharableModelError.ParameterNotInitialized(name))
        serialized, serializing = self.serialized_parameters, self._serializing
        done = serializing[name] = trio.Event()
        try:
            value = await trio.to_thread.run_sync(codec.encode, tensor)
            payload = TransmittableModelParameter(name.encode("utf-8"), value)
            try:
                ticket, _ = await add_downloadable(payload, parameter_tag(name))
            except Exception as e:
                raise SharableModelFailure(SharableModelError.P2PAddDownloadError(str(e))) from e
            serialized[name] = ticket
        finally:
            done.set()
            if serializing.get(name) is done:
                del serializing[name]
        return ticket

    async def serialize_ahead(
        self, add_downloadable: AddDownloadable, codec: ParameterCodec
    ) -> None:
        """Serialize every parameter now, one at a time, so that the first joiner's ticket
        requests find them ready (a provider serializing on request answered a cold fetch's
        first ticket batch 0.3-0.5 s late on a loaded machine: the serialization, and its
        first-use costs, under the load of the new connections). Stops early when the model is
        replaced or no longer served; a second call for the same model does nothing. The
        serialized model stays in the blob store for the serving window (a model-sized copy,
        which serving it whole to one joiner makes too): the client starts it only when a
        member may fetch the model (`fetchers_expected`)."""
        serialized = self.serialized_parameters
        if self.parameters is None or serialized is None or self._ahead is serialized:
            return  # not served, or already started for this model
        self._ahead = serialized
        for name in list(self.parameters):
            if self.serialized_parameters is not serialized:  # replaced, or serving ended
                break
            try:
                await self.get_transmittable_parameter(name, add_downloadable, codec)
            except SharableModelFailure as e:  # no longer served, or the store refused it
                logger.debug("serializing the model ahead stopped at %s: %s", name, e)
                break
            except Exception as e:  # an optimization: a request serializes it (or says why)
                logger.warning("serializing the model ahead stopped at %s: %r", name, e)
                break

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
        self.generation = next(_generations)
        self.config_ticket = None
        self.serialized_parameters = None
        self._serializing = {}
        self._ahead = None

    def stop_sharing(self) -> None:
        """Serve nothing until the next `update_parameters`: the run went on without this
        client, so the model it holds is no longer the run's (a joiner must not load it)."""
        self.clear_cache()
        self.parameters = None

    # joiner -----------------------------------------------------------------------------------

    def initialize_parameters(self, names: list[str]) -> None:
        self.parameters = dict.fromkeys(names)

    async def add_parameter(
        self, parameter: TransmittableModelParameter, codec: ParameterCodec
    ) -> str:
        if self.parameters is None:
            raise SharableModelFailure(SharableModelError.ParametersNotInitialized())
        name = parameter.name()
        if name not in self.parameters:
            raise SharableModelFailure(SharableModelError.ParameterUnknown(name))
        try:
            tensor = await trio.to_thread.run_sync(codec.decode, parameter.param_value_bytes)
        except ValueError as e:
            raise SharableModelFailure(SharableModelError.SerializationError(str(e))) from e
        if self.parameters[name] is not None:
            logger.warning("Parameter %s was already added to the model, ignoring it", name)
        self.parameters[name] = tensor
        return name

    def add_config(self, config: TransmittableModelConfig) -> None:
        self.model_config = config.config
        self.tokenizer_config = config.tokenizer
        self.parameters_to_download = list(config.parameter_names)

    def take_parameters(self) -> dict[str, Any]:
        if self.parameters is None:
            raise SharableModelFailure(SharableModelError.ParametersNotInitialized())
        out: dict[str, Any] = {}
        for name, tensor in self.parameters.items():
            if tensor is None:
                raise SharableModelFailure(SharableModelError.ParameterNotInitialized(name))
            out[name] = tensor
        self.parameters = None
        return out


def fetchers_expected(
    members: Iterable[bytes], last_members: frozenset[bytes] | None, me: bytes
) -> bool:
    """Whether an epoch whose clients are `members` (as its warmup names them) may have one that
    fetches the model from its peers: a member other than `me` that was not a client of the
    epoch before (`last_members`; None when this node did not see that epoch: assumed so).

    The clients of the epoch before hold the model (they trained it, or were dropped and load
    it anew: then they count as joiners only if they left the list), so an epoch of the same
    clients, or fewer, fetches nothing, and serializing the model ahead for it would only hold
    a second model-sized copy in host memory on every client. Who joins is known only at the
    warmup (the pending clients are the coordinator's, not in its state), so a provider's
    head start over a joiner is the joiner's own setup before it asks."""
    if last_members is None:
        return True
    return any(m != me and m not in last_members for m in members)


class ModelsAnswered(set[int | None]):
    """The versions of the models tickets were answered from (`noting_model_versions`), and
    the serving generations (`SharableModel.generation`) they were answered in."""

    def __init__(self) -> None:
        super().__init__()
        self.generations: set[int] = set()


_versions_answered: ContextVar[ModelsAnswered | None] = ContextVar(
    "model_versions_answered", default=None
)


@contextmanager
def noting_model_versions() -> Iterator[ModelsAnswered]:
    """The versions of the models `answer_request` answered from with a ticket, inside this
    block, in this task or the tasks it starts: how a batch's server (`model_sharing`) learns
    which model its tickets are of, through the node's answer function, which passes only the
    request (and, in `ModelsAnswered.generations`, in which serving windows)."""
    noted = ModelsAnswered()
    token = _versions_answered.set(noted)
    try:
        yield noted
    finally:
        _versions_answered.reset(token)


async def answer_request(
    request: ModelRequestType,
    model: SharableModel,
    add_downloadable: AddDownloadable,
    codec: ParameterCodec,
) -> TicketResult:
    """What a provider replies to a parameter or config request; a ticket's model version is
    noted (`noting_model_versions`). A ticket may be had after a wait (a parameter's
    serialization under way, the configuration's storing) in which the model was replaced, its
    ticket then of either model:
    it is refused as "not serving now" (the joiner asks again, and the new model's version
    names the next answer), never labelled with the version read when the request came. So is
    one had across any change of the serving window (`SharableModel.generation`: the window
    closed, or closed and opened again, meanwhile), versioned or not."""
    version, generation = model.version, model.generation
    try:
        match request:
            case ModelRequestType.Parameter(name):
                ticket = await model.get_transmittable_parameter(name, add_downloadable, codec)
            case _:
                ticket = await model.get_transmittable_config(add_downloadable)
        if model.generation != generation:
            raise SharableModelFailure(SharableModelError.ParametersNotInitialized())
    except SharableModelFailure as failure:
        refused: TicketResult = TicketResult.Err(failure.error)
        return refused
    noted = _versions_answered.get()
    if noted is not None:
        noted.add(version)
        noted.generations.add(generation)
    answered: TicketResult = TicketResult.Ok(ticket)
    return answered
