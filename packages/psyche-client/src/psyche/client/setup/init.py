"""Joining a run at warmup: the model, the data provider and the trainer (upstream `init.rs`).

Runs when the client first sees a Warmup state that lists it. The model and the data provider
are set up concurrently; model loading runs in a worker thread. With a P2P checkpoint the model
comes from the other clients, through `fetch_from_peers` (the client loop feeds that download
its network events).

Where the model comes from, first that applies:

1. this run instance's local checkpoint of the epoch's start step (`--checkpoint-dir`);
2. the epoch's other clients, when the checkpoint is P2P, and also when it is the stored one
   (Hub, GCS) after the run has trained (a port addition, issue 24 item 9): the coordinator
   names the stored checkpoint again when no client of the last epoch is back as one of the
   new epoch's (an epoch that ended with every client withdrawn), although clients that trained
   on may be among the new epoch's and still hold the run's latest model. They are asked
   first, for a bounded time (`peer_wait_secs`), so that the run goes on from the trained model
   rather than from the stored one, and honest clients start the epoch with identical weights;
3. the stored checkpoint, when no peer serves the model.

A model the run's clients hold as it is (from peers, or this instance's checkpoint) is served to
the epoch's other joiners at once (`InitializedRun.shared`), as a cooldown's is.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import trio

from psyche.client.checkpoints.cooldown import extract_for_sharing, live_model_hash
from psyche.client.checkpoints.store import CheckpointConfig, RunInstance
from psyche.client.observe.logs import log_event
from psyche.client.setup.model_loading import (
    LoadedModel,
    ModelUnreachable,
    build_from_parameters,
    check_device,
    load_from_directory,
    load_gcs_checkpoint,
    load_hub_checkpoint,
    preload_modeling,
    resume_checkpoint,
)
from psyche.client.setup.trainer_settings import TrainerSettings
from psyche.coordinator.coordinator import Coordinator
from psyche.coordinator.following import exact_class_problem
from psyche.coordinator.model import Checkpoint
from psyche.core.cli import UserError, single_cause
from psyche.core.identity import SecretKey
from psyche.core.log_markers import IntegrationTestLogMarker
from psyche.core.node_identity import NodeIdentity

if TYPE_CHECKING:
    import torch

    from psyche.modeling.trainer import Trainer
    from psyche.network import DownloadedModel

logger = logging.getLogger(__name__)


class InitRunError(UserError):
    """The client cannot take part in this run (model, data or configuration): what it says is
    the whole story, one line (`psyche.core.cli`), and trying again changes nothing."""


class InitUnavailable(InitRunError):
    """Something the init needs is out of reach now (the run's remote data locations, the peers
    that serve the model, the hub or GCS bucket that stores it, the worker thread a given-up init
    still holds): the client leaves the epoch and joins again, as a client the run went on
    without, instead of ending."""


class TrainerBuilder(Protocol):
    """What builds the trainer when the client has several ranks (`workers.WorkerGroup`):
    every rank builds its part of the model and trainer from `loaded`."""

    def build_trainer(
        self, loaded: LoadedModel, llm: Any, settings: TrainerSettings
    ) -> Trainer: ...


@dataclass(frozen=True)
class RunInitConfig:
    """What the client needs beyond the coordinator state (upstream `RunInitConfig`)."""

    identity: NodeIdentity
    secret_key: SecretKey
    run_id: str
    """`--run-id`: the run this client joined; a coordinator state of any other is refused."""
    device: str = "auto"
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    """Upstream's `micro_batch_size`, `grad_accum_in_fp32` and `optim_stats_every_n_steps`."""
    max_concurrent_parameter_requests: int = 8
    write_gradients_dir: Path | None = None
    checkpoint: CheckpointConfig | None = None
    workers: TrainerBuilder | None = None
    """The client's ranks when it has several (or a memory option): they build the trainer."""


@dataclass
class InitializedRun:
    """What an init built; whoever holds it owns its data provider (`aclose`)."""

    trainer: Trainer
    data_provider: Any
    loaded: LoadedModel
    shared: dict[str, torch.Tensor] | None = None
    """The weights to serve to the epoch's joiners now (bf16), when they are the run's."""

    async def aclose(self) -> None:
        """Release what the init opened (the data provider's connection or files): the init
        was given up after it finished."""
        await _close_provider(self.data_provider)


FetchFromPeers = Callable[[Coordinator, "float | None"], Awaitable["DownloadedModel"]]
"""Fetch the model from the epoch's other clients; the second argument is when to give up
(`trio.current_time()`) if no peer has served its configuration by then. Raises
`psyche.network.PeersUnreachable` when no peer serves it."""

PEER_RETRY_SECS = 1.0


def peer_wait_secs(state: Coordinator) -> float:
    """How long a client at a stored-checkpoint epoch asks its peers for the run's model before
    it loads the stored checkpoint: half the warmup (3 to 60 s), so it still starts the epoch.
    A peer that restarted with this instance's checkpoint serves it once it has loaded it."""
    return min(max(state.config.warmup_time / 2, 3.0), 60.0)


def peers_may_hold_the_model(state: Coordinator, identity: NodeIdentity) -> bool:
    """Whether the epoch's other clients may hold a newer model than the stored checkpoint: the
    run has trained (its step is past the first), and someone else is in the epoch."""
    return state.progress.step > 1 and any(c.id != identity for c in state.epoch_state.clients)


async def init_run(
    config: RunInitConfig, run: RunInstance, state: Coordinator, fetch_from_peers: FetchFromPeers
) -> InitializedRun:
    """The model (this instance's local checkpoint of the epoch's start, else the run's
    checkpoint), the data provider and the trainer, for the client of `run` at `state`.

    The data provider is the caller's once this returns; whatever ends it before (an error, a
    cancel: the run dropped the client) closes the provider it opened. A cancel takes effect
    once the worker thread under way (a model build, which nothing can stop) has returned."""
    from psyche.modeling.causal_lm import ModelLoadError, architecture_name

    llm = state.model.value
    await trio.to_thread.run_sync(preload_modeling)
    try:
        architecture = architecture_name(llm.architecture)
        device = await trio.to_thread.run_sync(check_device, config.device)
    except ModelLoadError as e:
        raise InitRunError(str(e)) from e
    problem = exact_class_problem(state, device.type, _outside_class(config.workers))
    if problem is not None:  # its followers would convict it though honest
        raise InitRunError(problem)

    loaded: LoadedModel | None = None
    provider: Any = None

    async def load_model() -> None:
        nonlocal loaded
        resume = None
        if config.checkpoint is not None:
            resume = await trio.to_thread.run_sync(
                resume_checkpoint, config.checkpoint.checkpoint_dir, run, state.progress.step - 1
            )
        if resume is not None:
            logger.info("Resuming from the local checkpoint %s", resume)
            loaded = await _load_local(resume, architecture, device)
        else:
            loaded = await _load_model(
                llm.checkpoint, architecture, device, state, fetch_from_peers, config.identity
            )

    async def open_data() -> None:
        nonlocal provider
        provider = await _open_data(llm, config.secret_key)

    try:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(load_model)
                nursery.start_soon(open_data)
        except BaseExceptionGroup as group:  # the nursery's wrapping: the reason, unwrapped
            errors, rest = group.split(InitRunError)
            if errors is None or rest is not None:
                raise
            raise single_cause(errors)  # noqa: B904 (its own cause says why)
        assert loaded is not None

        def make_trainer() -> Trainer:
            from psyche.modeling.trainer import Trainer

            if config.workers is not None:
                return config.workers.build_trainer(loaded, llm, config.trainer)

            return config.trainer.build(Trainer, loaded.model, llm.lr_schedule, llm.optimizer)

        trainer = await trio.to_thread.run_sync(make_trainer)
        shared = None
        if loaded.from_run:  # bf16 already: rounding changes nothing, as at a cooldown
            shared, model_hash = await trio.to_thread.run_sync(extract_for_sharing, trainer)
        else:
            model_hash = await trio.to_thread.run_sync(live_model_hash, trainer)
        log_event(
            logger,
            "loaded_model",
            text=f"model loaded from {loaded.source} on {device}, hash {model_hash.hex()[:16]}",
            marker=IntegrationTestLogMarker.LoadedModel,
            client_id=str(config.identity),
            epoch=state.progress.epoch,
            step=state.progress.step,
            checkpoint=str(llm.checkpoint),
            source=loaded.source,
            device=str(device),
            dtype=str(loaded.model.dtype).removeprefix("torch."),
            model_hash=model_hash,
        )
        return InitializedRun(trainer, provider, loaded, shared)
    except BaseException:
        if provider is not None:
            with trio.CancelScope(shield=True):  # closing is local work: it cannot hang
                await _close_provider(provider)
        raise


def _outside_class(workers: TrainerBuilder | None) -> list[str]:
    """The rank options by which this client computes otherwise than one rank of the model's
    dtype on the run's thread count does (exact verification's class): its ranks set their own
    thread counts and split reductions, and casts change the bits."""
    layout = getattr(workers, "layout", None)
    if layout is None:
        return []
    options = []
    ranks = int(layout.dp) * int(layout.tp)
    if ranks > 1 or layout.fsdp:
        options.append(f"{ranks} ranks (--dp {layout.dp} --tp {layout.tp})")
    if layout.param_dtype != "auto":
        options.append(f"--param-dtype {layout.param_dtype}")
    if layout.reduce_dtype != "fp32":
        options.append(f"--reduce-dtype {layout.reduce_dtype}")
    if layout.fused_loss != "off":
        options.append(f"--fused-loss {layout.fused_loss}")
    return options


async def _from_peers(
    fetch_from_peers: FetchFromPeers,
    state: Coordinator,
    architecture: str,
    device: Any,
    give_up_at: float | None = None,
) -> LoadedModel:
    downloaded = await fetch_from_peers(state, give_up_at)
    return await trio.to_thread.run_sync(
        build_from_parameters,
        downloaded.config.config,
        downloaded.config.tokenizer,
        downloaded.parameters,
        architecture,
        device,
    )


async def _from_peers_while_they_may_serve(
    fetch_from_peers: FetchFromPeers, state: Coordinator, architecture: str, device: Any
) -> LoadedModel | None:
    """The run's model from the epoch's other clients, asked again every second for
    `peer_wait_secs`; None when none served it by then."""
    from psyche.network import PeersUnreachable

    deadline = trio.current_time() + peer_wait_secs(state)
    logger.info(
        "epoch %d starts from the stored checkpoint, but the run trained to step %d: asking the "
        "epoch's other clients for the run's model first (for up to %.0f s)",
        state.progress.epoch,
        state.progress.step - 1,
        peer_wait_secs(state),
    )
    while True:
        try:
            return await _from_peers(fetch_from_peers, state, architecture, device, deadline)
        except PeersUnreachable:
            if trio.current_time() >= deadline:
                return None
            await trio.sleep(PEER_RETRY_SECS)


async def _load_model(
    checkpoint: Checkpoint,
    architecture: str,
    device: Any,
    state: Coordinator,
    fetch_from_peers: FetchFromPeers,
    identity: NodeIdentity,
) -> LoadedModel:
    from psyche.modeling.causal_lm import ModelLoadError
    from psyche.network import PeersUnreachable

    try:
        if isinstance(checkpoint, Checkpoint.Hub | Checkpoint.Gcs) and peers_may_hold_the_model(
            state, identity
        ):
            loaded = await _from_peers_while_they_may_serve(
                fetch_from_peers, state, architecture, device
            )
            if loaded is not None:
                return loaded
            log_event(
                logger,
                "stored_checkpoint_loaded",
                logging.WARNING,
                text=f"no client of epoch {state.progress.epoch} served the run's model: "
                f"loading the stored checkpoint {checkpoint} (what the run trained since it was "
                "written is not in it)",
                epoch=state.progress.epoch,
                step=state.progress.step,
            )
        match checkpoint:
            case Checkpoint.Hub(repo):
                logger.info("Loading model from %s", repo.repo_id)
                return await trio.to_thread.run_sync(
                    load_hub_checkpoint, repo.repo_id, repo.revision, architecture, device
                )
            case Checkpoint.P2P(_) | Checkpoint.P2PGcs(_):
                logger.info("Checkpoint is p2p, requesting the model from peers")
                try:
                    return await _from_peers(fetch_from_peers, state, architecture, device)
                except PeersUnreachable as e:  # they may serve it at the next warmup
                    raise InitUnavailable(f"no peer served the model: {e}") from e
            case Checkpoint.Ephemeral():
                raise InitRunError("Model is Ephemeral, it's impossible to join this run.")
            case Checkpoint.Dummy(_):
                raise InitRunError(
                    "Dummy checkpoints (upstream's test-only dummy model) are not supported by "
                    "the Python client; use a Hub checkpoint (a hub repo or a local directory)"
                )
            case Checkpoint.Gcs(repo):
                logger.info("Loading model from %s", checkpoint)
                prefix = None if repo.prefix is None else str(repo.prefix)
                return await trio.to_thread.run_sync(
                    load_gcs_checkpoint, str(repo.bucket), prefix, architecture, device
                )
    except ModelUnreachable as e:  # a network blip: the store may answer at the next warmup
        raise InitUnavailable(f"failed to load model: {e}") from e
    except ModelLoadError as e:
        raise InitRunError(f"failed to load model: {e}") from e
    raise InitRunError(f"unknown checkpoint {checkpoint!r}")


async def _load_local(path: Path, architecture: str, device: Any) -> LoadedModel:
    from psyche.modeling.causal_lm import ModelLoadError

    try:
        loaded = await trio.to_thread.run_sync(load_from_directory, path, architecture, device)
    except ModelLoadError as e:
        raise InitRunError(f"failed to load the local checkpoint {path}: {e}") from e
    loaded.source = f"{path} (resumed)"
    loaded.from_run = True
    # The keep policy may delete that directory later: later checkpoints write the config and
    # tokenizer from what the client holds, as a P2P joiner's do.
    loaded.extra_files = []
    return loaded


async def _close_provider(provider: Any) -> None:
    from psyche.data_provider.factory import aclose_provider

    await aclose_provider(provider)


async def _open_data(llm: Any, secret_key: SecretKey) -> Any:
    from psyche.data_provider import DataProviderError, ProviderOptions, open_data_provider

    try:
        return await open_data_provider(
            llm.data_locations, ProviderOptions(max_seq_len=llm.max_seq_len, secret_key=secret_key)
        )
    except (DataProviderError, OSError) as e:
        if _only_on_this_machine(llm.data_locations):
            # files on this machine (a wrong path): waiting for the next warmup changes nothing
            raise InitRunError(f"Couldn't initialize data provider: {e}") from e
        # the run's remote data locations (a data server restarting, a network blip): tried
        # again at the next warmup that lists this client
        raise InitUnavailable(f"Couldn't initialize data provider: {e}") from e


def _only_on_this_machine(locations: Any) -> bool:
    """Whether every data location is read from this machine's disk (or made up), so that a
    failure to open them is the user's to mend, not the network's to heal. A preprocessed
    dataset is a local directory here (the port downloads none from the hub)."""
    from psyche.coordinator.model import LLMTrainingDataLocation

    local = (
        LLMTrainingDataLocation.Local
        | LLMTrainingDataLocation.Preprocessed
        | LLMTrainingDataLocation.Dummy
    )
    return all(isinstance(location, local) for location in locations)
