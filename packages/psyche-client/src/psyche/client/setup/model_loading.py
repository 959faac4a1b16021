"""Where a client's model comes from at the start of an epoch (upstream `state/init.rs`).

* A `Hub` checkpoint naming an existing local directory (and no revision) is read from disk;
  otherwise the repo is downloaded from the Hugging Face hub.
* A directory with `config.json` but no `.safetensors` is a run that starts from scratch: the
  model is built from the config with random weights under `torch.manual_seed(1337)` on the CPU
  (then moved to the device), so every client starts from identical weights.
* A `P2P` checkpoint is fetched from the run's other clients (config, then every parameter); the
  model is built from the config and the received tensors are loaded into it.
* A `Gcs` checkpoint is downloaded from the bucket (`gcs`) and read like a local directory.
* A hub or GCS download that failed to reach its store (a refused or dropped connection, a
  timeout, a host name that did not resolve) or that its store answered with "try later" (an
  HTTP 5xx, 408 or 429) is a `ModelUnreachable`: the same load may work at the next warmup. Any
  other failure (not found, no permission, a malformed checkpoint) is a plain `ModelLoadError`.
* Resume (a port addition): a client whose `--checkpoint-dir` holds a complete checkpoint of
  this run instance at the step the epoch starts from loads it instead (`resume_checkpoint`):
  the same bf16-rounded weights its peers would send. Another instance's (the same run config
  started afresh) is never taken.

These functions block (torch, file I/O); the client runs them in a worker thread.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psyche.client.checkpoints.gcs import GcsError, download_checkpoint_from_gcs
from psyche.client.checkpoints.store import RunInstance, latest_complete
from psyche.modeling.causal_lm import (
    CausalLM,
    ModelLoadError,
    ModelOptions,
    download_model_repo,
    load_config_json,
    resolve_device,
    resolve_dtype,
)

if TYPE_CHECKING:
    import torch


INIT_SEED = 1337
TOKENIZER_FILE = "tokenizer.json"

# Several clients in one process (tests, simulations) load models in concurrent threads: the
# transformers lazy imports are not thread safe, and the seeded random init uses torch's global
# generator, so imports and seeded builds take this lock.
_BUILD_LOCK = threading.Lock()


def preload_modeling() -> None:
    """Import torch and what transformers imports lazily when it first builds a model (about
    ten seconds on a small machine): building a minute Llama pulls it all in."""
    with _BUILD_LOCK:
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(
            vocab_size=8,
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
        )
        AutoModelForCausalLM.from_config(config)


class ModelUnreachable(ModelLoadError):
    """The checkpoint's store (the hub, a GCS bucket) was out of reach or said to come back
    later, somewhere in the error's causes: a connection refused or dropped, a timeout, a name
    lookup that failed, or an HTTP 5xx, 408 or 429 answer. Trying again later may work."""


# HTTP answers that say "not now" rather than "no": the server's own failure (5xx), a request
# it timed out (408), too many requests (429).
_RETRY_LATER_STATUSES = frozenset({408, 429})


def _transient(error: BaseException) -> bool:
    """Whether `error` itself is the network failing rather than the store refusing: builtin
    connection errors and timeouts (what every HTTP client raises from), a failed name lookup
    (`socket.gaierror`: DNS down or the name unknown for now), or an HTTP error whose response
    (`.response.status_code`, as both requests' and httpx's errors carry it) is a 5xx, 408 or
    429. A 4xx such as 404 (no such repo or revision) or 401/403 is not: it will say the same
    at the next warmup."""
    if isinstance(error, ConnectionError | TimeoutError | socket.gaierror):
        return True
    status = getattr(getattr(error, "response", None), "status_code", None)
    return isinstance(status, int) and (status >= 500 or status in _RETRY_LATER_STATUSES)


def _load_error(message: str, error: BaseException) -> ModelLoadError:
    """`message` as a `ModelUnreachable` when some error in `error`'s chain of causes is
    `_transient`, else as a `ModelLoadError`."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if _transient(cause):
            return ModelUnreachable(message)
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return ModelLoadError(message)


@dataclass
class LoadedModel:
    model: CausalLM
    # What model sharing hands to joiners (upstream sends the config and tokenizer JSON).
    config_json: str
    tokenizer_json: str
    # Files of the source checkpoint that checkpoints of this model should carry.
    extra_files: list[Path] = field(default_factory=list)
    source: str = ""
    from_run: bool = False
    """The run's model as its clients hold it (bf16-rounded): the peers' model, or this
    instance's local checkpoint. A client can serve such weights to others at once."""


def check_device(device: str) -> torch.device:
    """The torch device for `--device` (auto, cpu, cuda, cuda:N); fails early when absent."""
    import torch

    if device not in ("auto", "cpu", "cuda") and not (
        device.startswith("cuda:") and device[5:].isdigit()
    ):
        raise ModelLoadError(
            f"unsupported --device {device!r}: use auto, cpu, cuda or cuda:N "
            "(multiple devices need data or tensor parallelism, which is not built)"
        )
    resolved = resolve_device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"--device {device}: no CUDA device is available")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"--device {device}: only {torch.cuda.device_count()} CUDA devices exist"
            )
    return resolved


def config_json_of(model: CausalLM) -> str:
    return json.dumps(model.config.to_dict(), sort_keys=True)


def _read_tokenizer(directory: Path) -> str:
    path = directory / TOKENIZER_FILE
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def _move(model: CausalLM, device: torch.device) -> CausalLM:
    if model.device == device:
        return model
    moved = CausalLM(model.model.to(device), model.architecture, source_dir=model.source_dir)
    return moved


def load_from_directory(directory: Path, architecture: str, device: torch.device) -> LoadedModel:
    """A local checkpoint directory, or a config-only directory (random init, seed 1337)."""
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"no config.json in {directory}")
    dtype = resolve_dtype(None, device)
    has_weights = any(p.suffix.lower() == ".safetensors" for p in directory.iterdir())
    if has_weights:
        model = _seeded(
            CausalLM.from_pretrained,
            directory,
            ModelOptions(architecture=architecture, device=str(device), seed=INIT_SEED),
        )
        source = f"{directory} (weights)"
    else:
        # Built on the CPU so the random draws are the same whatever the device.
        model = _seeded(
            CausalLM.from_config,
            load_config_json(directory / "config.json"),
            ModelOptions(
                architecture=architecture, device="cpu", dtype=_dtype_name(dtype), seed=INIT_SEED
            ),
        )
        model.source_dir = directory
        model = _move(model, device)
        source = f"{directory} (config only: random init, seed {INIT_SEED})"
    extras = model.checkpoint_extra_files()
    return LoadedModel(model, config_json_of(model), _read_tokenizer(directory), extras, source)


def load_hub_checkpoint(
    repo_id: str,
    revision: str | None,
    architecture: str,
    device: torch.device,
) -> LoadedModel:
    """Upstream's rule: a repo id that is an existing path (and no revision) is local; anything
    else is downloaded, bounded by the model the repo's config.json declares
    (`download_model_repo`)."""
    local = Path(repo_id)
    if revision is None and local.is_dir():
        directory = local
    else:
        try:
            directory = download_model_repo(repo_id, revision, architecture=architecture)
        except ModelLoadError as e:
            raise _load_error(str(e), e) from e
    return load_from_directory(directory, architecture, device)


def load_gcs_checkpoint(
    bucket: str, prefix: str | None, architecture: str, device: torch.device
) -> LoadedModel:
    """The bucket's newest checkpoint (upstream's manifest, or every model file without one)."""
    try:
        directory = download_checkpoint_from_gcs(bucket, prefix)
    except GcsError as e:
        raise ModelLoadError(str(e)) from e
    except Exception as e:  # the storage client's errors (network, permissions, not found)
        raise _load_error(f"cannot fetch gs://{bucket}/{prefix or ''}: {e}", e) from e
    loaded = load_from_directory(directory, architecture, device)
    loaded.source = f"gs://{bucket}/{prefix or ''} ({directory})"
    return loaded


def resume_checkpoint(checkpoint_dir: Path, run: RunInstance, step: int) -> Path | None:
    """This run instance's complete local checkpoint of `step` (the model the epoch starts
    from), if any: the step must match exactly, since an older model would put this client
    apart from its peers; a partial one, or another instance's, is never chosen."""
    if step < 0:
        return None
    found = latest_complete(checkpoint_dir, run, step)
    return None if found is None else found.path


def build_from_parameters(
    config_json: str,
    tokenizer_json: str,
    parameters: Mapping[str, torch.Tensor],
    architecture: str,
    device: torch.device,
) -> LoadedModel:
    """The model a joiner assembles from what its peers sent: every parameter of the config's
    model must arrive, and nothing else."""
    import torch

    try:
        config = json.loads(config_json)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"peers sent a model config that is not JSON: {e}") from e
    if not isinstance(config, dict):
        raise ModelLoadError("peers sent a model config that is not a JSON object")
    dtype = resolve_dtype(None, device)
    model = _seeded(
        CausalLM.from_config,
        config,
        ModelOptions(
            architecture=architecture, device="cpu", dtype=_dtype_name(dtype), seed=INIT_SEED
        ),
    )
    state = _shared_once(model.model.state_dict())
    parameters = model.from_checkpoint_names(parameters)  # a Torchtitan model's own names
    missing = sorted(set(state) - set(parameters))
    unexpected = sorted(set(parameters) - set(state))
    if missing or unexpected:
        raise ModelLoadError(
            f"peers' parameters do not match the config: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    with torch.no_grad():
        for name, target in state.items():
            value = parameters[name]
            if tuple(value.shape) != tuple(target.shape):
                raise ModelLoadError(
                    f"parameter {name} has shape {tuple(value.shape)}, the config's model "
                    f"{tuple(target.shape)}"
                )
            target.copy_(value.to(target.dtype))
    model = _move(model, device)
    return LoadedModel(
        model, config_json_of(model), tokenizer_json, [], "peers (P2P)", from_run=True
    )


def _seeded(build: Callable[..., CausalLM], *args: Any) -> CausalLM:
    """`build(*args)` right after `torch.manual_seed(INIT_SEED)`, with no other build between."""
    import torch

    with _BUILD_LOCK:
        torch.manual_seed(INIT_SEED)
        return build(*args)


def _shared_once(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with tied tensors once (the names `CausalLM.extract` sends)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if key not in seen:
            seen.add(key)
            out[name] = tensor
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
