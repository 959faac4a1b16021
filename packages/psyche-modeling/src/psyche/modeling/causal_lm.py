"""Causal language models for training: Hugging Face transformers behind upstream's interface.

Upstream has native Llama and DeepSeek implementations (`HfLlama`, `HfDeepseek`) and a Python
path for anything transformers can build (`HfAuto`). Here all three are transformers models; the
architecture name still selects upstream's checks (model type, no tied embeddings for Llama) and
its gradient-clipping formula. `Torchtitan` builds torchtitan's model definitions
(`psyche.modeling.torchtitan`, the optional `torchtitan` extra) behind the same interface.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from psyche.modeling import fused_loss
from psyche.modeling.distro import sorted_variables
from psyche.modeling.sharding import full_tensor, is_sharded, local_tensor

ARCHITECTURES = ("HfLlama", "HfDeepseek", "HfAuto", "Torchtitan")
_NATIVE = ("HfLlama", "HfDeepseek")
_MODEL_TYPES = {"HfLlama": ("llama",), "HfDeepseek": ("deepseek_v2", "deepseek_v3")}

CHECKPOINT_EXTRA_FILE_NAMES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


class ModelLoadError(ValueError):
    """The model cannot be built or loaded as asked (bad architecture, missing weights, ...)."""


def architecture_name(architecture: object) -> str:
    """Accept `"HfLlama"` or an enum member whose `.name` is that (the run config's enum)."""
    name = getattr(architecture, "name", architecture)
    if not isinstance(name, str) or name not in ARCHITECTURES:
        raise ModelLoadError(
            f"unknown architecture {architecture!r}; expected one of {', '.join(ARCHITECTURES)}"
        )
    return name


def resolve_device(device: str | torch.device) -> torch.device:
    """`auto` is the first CUDA device when there is one, else the CPU."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Upstream trains in bf16; on the CPU, float32 is the default here (bf16 matmuls are slow)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
    value = getattr(torch, names.get(dtype, dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ModelLoadError(f"unknown parameter dtype {dtype!r}")
    return value


@dataclass(frozen=True)
class ModelOptions:
    """How to build a model; `device`/`dtype` accept "auto"."""

    architecture: str = "HfAuto"
    device: str = "auto"
    dtype: str | None = None
    attn_implementation: str = "sdpa"
    max_position_embeddings: int | None = None
    gradient_checkpointing: bool = False
    seed: int = 1337
    fused_loss: str = "off"
    """The training loss without the whole logits tensor (`psyche.modeling.fused_loss`: off,
    auto, chunked, liger); on the CPU always the model's own loss (today's bits)."""


class CausalLM:
    """A transformers causal LM with the operations the trainer and optimizers need."""

    def __init__(
        self,
        model: nn.Module,
        architecture: str,
        *,
        source_dir: Path | None = None,
    ) -> None:
        self.model = model
        self.architecture = architecture
        self.source_dir = source_dir
        self._variables = sorted_variables(model)
        self.fused_loss = "off"
        """`ModelOptions.fused_loss` (`set_fused_loss` checks it)."""

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: Any, options: ModelOptions | None = None) -> CausalLM:
        """Random initialisation from a config (a `PretrainedConfig` or a config.json dict)."""
        from transformers import AutoModelForCausalLM

        options = options or ModelOptions()
        arch = architecture_name(options.architecture)
        config = _prepare_config(_as_config(config), arch, options)
        device = resolve_device(options.device)
        dtype = resolve_dtype(options.dtype, device)
        if arch == "Torchtitan":
            return cls._finish(
                _titan_build(config, device, dtype, options.seed), arch, options, None
            )
        torch.manual_seed(options.seed)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=options.attn_implementation, dtype=dtype
        )
        return cls._finish(model.to(device), arch, options, None)

    @classmethod
    def from_pretrained(
        cls, source: str | os.PathLike[str], options: ModelOptions | None = None
    ) -> CausalLM:
        """Load a local directory (config.json + safetensors, sharded or not) or a hub repo id.

        Every model parameter must be present in the checkpoint (as upstream requires).
        """
        options = options or ModelOptions()
        arch = architecture_name(options.architecture)
        directory = Path(source)
        if not directory.is_dir():
            directory = download_model_repo(str(source), architecture=arch)
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"no config.json in {directory}")
        if not any(p.suffix.lower() == ".safetensors" for p in directory.iterdir()):
            raise ModelLoadError(f"no .safetensors files in {directory}")
        _check_safetensors_format(directory)
        from transformers import AutoConfig, AutoModelForCausalLM

        config = _prepare_config(AutoConfig.from_pretrained(directory), arch, options)
        device = resolve_device(options.device)
        dtype = resolve_dtype(options.dtype, device)
        if arch == "Torchtitan":
            titan = _titan_build(config, device, dtype, options.seed)
            _titan_load(titan, directory)
            return cls._finish(titan, arch, options, directory)
        torch.manual_seed(options.seed)
        # transformers types the result as the model alone; output_loading_info adds the info.
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            directory,
            config=config,
            dtype=dtype,
            attn_implementation=options.attn_implementation,
            output_loading_info=True,
        )
        model: nn.Module
        info: dict[str, list[str]]
        model, info = loaded
        missing = sorted(info.get("missing_keys", []))
        if missing:
            raise ModelLoadError(
                f"checkpoint {directory} lacks {len(missing)} parameters, e.g. {missing[:3]}"
            )
        return cls._finish(model.to(device), arch, options, directory)

    @classmethod
    def _finish(
        cls, model: nn.Module, arch: str, options: ModelOptions, source_dir: Path | None
    ) -> CausalLM:
        if options.gradient_checkpointing and getattr(
            model, "supports_gradient_checkpointing", False
        ):
            # nn.Module types attributes as Tensor | Module; a transformers model has the method.
            getattr(model, "gradient_checkpointing_enable")()  # noqa: B009
        model.train()
        built = cls(model, arch, source_dir=source_dir)
        built.set_fused_loss(options.fused_loss)
        return built

    def set_fused_loss(self, choice: str) -> None:
        """Train with `choice` (`ModelOptions.fused_loss`); a choice that cannot run on this
        model's device (a bad name, Liger not installed) raises `ModelLoadError`."""
        try:
            fused_loss.resolve(choice, self.device)
        except fused_loss.FusedLossError as e:
            raise ModelLoadError(str(e)) from None
        self.fused_loss = choice

    # -- properties --------------------------------------------------------------------------

    @property
    def config(self) -> Any:
        """The Hugging Face config (a Torchtitan model keeps it beside torchtitan's own)."""
        hf_config = getattr(self.model, "hf_config", None)
        return self.model.config if hf_config is None else hf_config

    @property
    def device(self) -> torch.device:
        return self._variables[0][1].device

    @property
    def dtype(self) -> torch.dtype:
        return self._variables[0][1].dtype

    @property
    def bos_token_id(self) -> int | None:
        return getattr(self.config, "bos_token_id", None)

    @property
    def max_context_length(self) -> int:
        return int(self.config.max_position_embeddings)

    def variables(self) -> list[tuple[str, nn.Parameter]]:
        """Named parameters sorted byte-wise by name (the optimizers' order)."""
        return list(self._variables)

    # -- compute -----------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        num_logits_to_keep: int | None = None,
        loss_scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(logits, loss)`; the loss is the mean next-token cross entropy over labels != -100,
        divided by `loss_scale`. With a fused loss that runs here (`fused_loss`, labels given)
        no logits are made: the first element is then an empty tensor."""
        if labels is not None and self.fused_loss != "off":
            path = fused_loss.resolve(self.fused_loss, self.device)
            if path != "model" and self._fusable():
                loss = self._fused_loss(input_ids, labels, position_ids, path)
                return loss.new_empty(0), (loss / loss_scale if loss_scale else loss)
        out = self.model(
            input_ids,
            labels=labels,
            position_ids=position_ids,
            logits_to_keep=num_logits_to_keep or 0,
            use_cache=False,
            return_dict=True,
        )
        loss = out.loss
        if loss is not None and loss_scale:
            loss = loss / loss_scale
        return out.logits, loss

    def _fusable(self) -> bool:
        """Whether the fused loss computes this model's loss: a transformers model whose logits
        are its plain lm_head's output (no bias, scaling or soft-capping) on whole tensors (not
        TP's DTensors). Others take their own loss."""
        model: Any = self.model
        head = model.get_output_embeddings() if self.architecture != "Torchtitan" else None
        config = self.config
        return (
            isinstance(head, nn.Linear)
            and head.bias is None
            and not is_sharded(head.weight)
            and getattr(config, "final_logit_softcapping", None) is None
            and getattr(config, "logit_scale", None) is None
            and hasattr(self.model, "model")
        )

    def _fused_loss(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None,
        path: str,
    ) -> torch.Tensor:
        model: Any = self.model
        hidden = model.model(
            input_ids, position_ids=position_ids, use_cache=False, return_dict=True
        ).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1])
        weight = model.get_output_embeddings().weight
        targets = fused_loss.shifted_labels(labels)
        if path == "liger":
            return fused_loss.liger_linear_cross_entropy(hidden, weight, targets)
        return fused_loss.chunked_linear_cross_entropy(hidden, weight, targets)

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip all gradients to a total 2-norm of `max_norm`; returns the norm before clipping.

        HfLlama/HfDeepseek use upstream's native formula: each gradient's norm is computed (and
        squared) in the parameter dtype, summed in float32, and gradients are scaled by
        `max_norm / (total + 1e-6)` only when `total > max_norm`. torch's `clip_grad_norm_`
        (used for HfAuto, as upstream's Python path does) takes per-tensor norms in the same
        dtype but squares and sums them as one stacked norm, and always multiplies by
        `min(1, max_norm / (total + 1e-6))`; the two can differ in the last bits.
        """
        grads = [p.grad for _, p in self._variables if p.grad is not None]
        if not grads:
            return 0.0
        if any(is_sharded(g) for g in grads):
            return clip_sharded_grad_norm(grads, max_norm, native=self.architecture in _NATIVE)
        if self.architecture in _NATIVE:
            return clip_grad_norm_native(grads, max_norm)
        return float(
            torch.nn.utils.clip_grad_norm_(
                [p for _, p in self._variables if p.grad is not None], max_norm
            )
        )

    def extract(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """CPU copies of the state dict (tied tensors once), optionally cast to `dtype`, in a
        Hugging Face checkpoint's names and layout (what checkpoints, P2P sharing and the ranks'
        hand-over carry): a Torchtitan model's are converted by torchtitan's state-dict adapter
        (`from_checkpoint_names` is the way back), so its cooldown checkpoints load in
        transformers as upstream's do."""
        out: dict[str, torch.Tensor] = {}
        seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
        for name, tensor in self.model.state_dict().items():
            local = local_tensor(tensor)
            key = (local.data_ptr(), tuple(tensor.shape), tuple(local.stride()))
            if key in seen:
                continue
            seen.add(key)
            # sharded tensors are gathered (a collective: every rank extracts)
            t = full_tensor(tensor.detach()).to("cpu", copy=True)
            out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        if self.architecture == "Torchtitan":
            from psyche.modeling import torchtitan

            return torchtitan.to_hf(self.model, out)
        return out

    def from_checkpoint_names(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` in `extract`'s names (a Hugging Face checkpoint's) in this model's own
        state-dict names: a Torchtitan model's through torchtitan's adapter (a tensor it cannot
        place is a `ModelLoadError`), any other's as they are."""
        if self.architecture != "Torchtitan":
            return dict(state)
        from psyche.modeling import torchtitan

        try:
            return torchtitan.from_hf(self.model, dict(state))
        except (KeyError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"a Hugging Face state dict torchtitan cannot place: {e}") from e

    @torch.no_grad()
    def truncate_bf16(self) -> None:
        """Round every parameter through bf16 (upstream does this before sharing a checkpoint)."""
        for _, p in self._variables:
            p.copy_(p.to(torch.bfloat16).to(p.dtype))

    def checkpoint_extra_files(self) -> list[Path]:
        """Files from the source checkpoint a saved checkpoint should carry (config, tokenizer)."""
        if self.source_dir is None:
            return []
        return sorted(
            p
            for p in self.source_dir.iterdir()
            if p.is_file() and (p.name in CHECKPOINT_EXTRA_FILE_NAMES or p.suffix == ".py")
        )


def _native_norm(grads: Sequence[torch.Tensor], max_norm: float) -> tuple[float, float | None]:
    """Upstream's native-model total norm of `grads`, and the factor that clips them to
    `max_norm` (None when they are within it)."""
    total_sq = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for g in grads:
        n = g.norm()
        total_sq += n * n
    total = float(total_sq.sqrt().item())
    return total, (max_norm / (total + 1e-6) if total > max_norm else None)


def clip_grad_norm_native(grads: Sequence[torch.Tensor], max_norm: float) -> float:
    """Upstream's native-model clipping (see `CausalLM.clip_grad_norm`)."""
    total, scale = _native_norm(grads, max_norm)
    if scale is not None:
        for g in grads:
            g.mul_(scale)
    return total


def clip_sharded_grad_norm(
    grads: Sequence[torch.Tensor], max_norm: float, *, native: bool
) -> float:
    """Clipping with sharded gradients: the norm is taken of the gathered full gradients, by
    the same formula as the unsharded model's (so the total, the scale and the clipped bits of
    each slice are those of a one-device client given the same gradients), then every local
    slice is scaled."""
    full = [full_tensor(g) for g in grads]
    if native:
        total, scale = _native_norm(full, max_norm)
        if scale is not None:
            for g in grads:
                local_tensor(g).mul_(scale)
        return total
    norm = torch.nn.utils.get_total_norm(full, 2.0)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        local = local_tensor(g)
        local.mul_(coef.to(local.device))
    return float(norm)


# --------------------------------------------------------------------------------------------
# Helpers


def _titan_build(config: Any, device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    from psyche.modeling import torchtitan

    try:
        return torchtitan.build(config, device, dtype, seed)
    except torchtitan.TorchtitanError as e:
        raise ModelLoadError(str(e)) from e


def _titan_load(model: nn.Module, directory: Path) -> None:
    """Copy a Hugging Face checkpoint's tensors into a Torchtitan model (torchtitan's adapter
    renames them); every parameter must be present, as for the other architectures."""
    from safetensors.torch import load_file

    from psyche.modeling import torchtitan

    hf_state: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        hf_state.update(load_file(path))
    state = torchtitan.from_hf(model, hf_state)  # CausalLM.from_checkpoint_names, before one exists
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise ModelLoadError(
            f"checkpoint {directory} lacks {len(missing)} parameters, e.g. {missing[:3]}"
        )
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name])


def _as_config(config: Any) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, Mapping):
        data = dict(config)
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise ModelLoadError("model_type not present in the config")
        try:
            return AutoConfig.for_model(model_type, **data)
        except ValueError as e:
            raise ModelLoadError(f"unknown model_type {model_type!r}") from e
    raise ModelLoadError(f"expected a PretrainedConfig or a dict, got {type(config).__name__}")


def _prepare_config(config: Any, arch: str, options: ModelOptions) -> Any:
    allowed = _MODEL_TYPES.get(arch)
    if allowed is not None and config.model_type not in allowed:
        raise ModelLoadError(
            f"architecture {arch} needs model_type {' or '.join(allowed)}, "
            f"the config has {config.model_type!r}"
        )
    if arch == "HfLlama" and getattr(config, "tie_word_embeddings", False):
        raise ModelLoadError("HfLlama does not support tied embeddings (as upstream)")
    if options.max_position_embeddings is not None:
        config.max_position_embeddings = options.max_position_embeddings
    return config


def _check_safetensors_format(directory: Path) -> None:
    from safetensors import safe_open

    for path in sorted(directory.iterdir()):
        if path.suffix.lower() != ".safetensors":
            continue
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
        if metadata is not None and metadata.get("format", "pt") != "pt":
            raise ModelLoadError(f"{path.name} is not a PyTorch safetensors file")


REPO_FILE_SUFFIXES = (".safetensors", ".json", ".py")
MAX_REPO_FILES = 256
MAX_AUX_FILE_BYTES = 64 * 2**20
"""The most a repo's `.json` or `.py` file may hold (a large tokenizer.json is tens of MB)."""
WEIGHT_HEADER_ALLOWANCE = 16 * 2**20
"""Bytes the safetensors files may hold beyond their tensors (their JSON headers, together)."""


def declared_weight_bytes(config: Mapping[str, Any], architecture: str = "HfAuto") -> int:
    """The bytes of the model `config` (a config.json) declares, every state-dict entry (tied
    ones once per name) at 4 bytes a value: the most its safetensors can hold, headers aside.
    The model is built on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    arch = architecture_name(architecture)
    prepared = _prepare_config(_as_config(config), arch, ModelOptions(architecture=arch))
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(prepared)
    except Exception as e:  # transformers' errors for a config it cannot build
        raise ModelLoadError(f"cannot build the model its config.json declares: {e}") from e
    return sum(t.numel() * 4 for t in model.state_dict().values())


def download_model_repo(
    repo_id: str, revision: str | None = None, *, architecture: str = "HfAuto"
) -> Path:
    """Fetch a hub repo's model files, bounded by the model its `config.json` declares (the
    repo id comes from a coordinator's state, which may be hostile; needs network, or a hub
    stand-in in tests):

    1. the revision is resolved to one commit, whose file list (with sizes) is read;
    2. only top-level `.safetensors`, `.json` and `.py` files with plain names are taken (at
       most 256), each `.json`/`.py` at most 64 MiB;
    3. `config.json` is fetched first, and the safetensors together may hold at most
       `declared_weight_bytes` of its model plus 16 MiB of headers: a repo with more is
       refused before any weight is fetched;
    4. the files are fetched at that commit and checked against the listed sizes.

    Every failure is a `ModelLoadError` naming the repo."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import validate_repo_id

    token = os.environ.get("HF_TOKEN")
    api = HfApi(token=token)
    try:
        validate_repo_id(repo_id)
        commit = api.model_info(repo_id, revision=revision or "main", token=token).sha
        if commit is None or len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
            raise ModelLoadError(f"the hub named no commit for {repo_id!r} at {revision!r}")
        listed = {
            entry.path: entry.size
            for entry in api.list_repo_tree(repo_id, revision=commit, token=token)
            if isinstance(entry, RepoFile)
        }
    except ModelLoadError:
        raise
    except Exception as e:  # huggingface_hub's errors (validation, network, not found)
        raise ModelLoadError(f"cannot fetch {repo_id!r} from the hub: {e}") from e
    files = {
        name: int(size)
        for name, size in listed.items()
        if name.endswith(REPO_FILE_SUFFIXES) and "/" not in name and not name.startswith(".")
    }
    if "config.json" not in files:
        raise ModelLoadError(f"the hub repo {repo_id!r} has no config.json")
    if len(files) > MAX_REPO_FILES:
        raise ModelLoadError(
            f"the hub repo {repo_id!r} lists {len(files)} model files (limit {MAX_REPO_FILES})"
        )
    for name, size in files.items():
        if not name.endswith(".safetensors") and size > MAX_AUX_FILE_BYTES:
            raise ModelLoadError(
                f"{name} of the hub repo {repo_id!r} holds {size:,} bytes "
                f"(limit {MAX_AUX_FILE_BYTES:,})"
            )
    try:
        config_path = Path(hf_hub_download(repo_id, "config.json", revision=commit, token=token))
    except Exception as e:
        raise ModelLoadError(f"cannot fetch {repo_id!r} from the hub: {e}") from e
    _check_size(config_path, files["config.json"], repo_id)
    weights = sum(size for name, size in files.items() if name.endswith(".safetensors"))
    limit = declared_weight_bytes(load_config_json(config_path), architecture)
    limit += WEIGHT_HEADER_ALLOWANCE
    if weights > limit:
        raise ModelLoadError(
            f"the hub repo {repo_id!r} holds {weights:,} bytes of safetensors, more than the "
            f"model its config.json declares can ({limit:,} bytes): not downloaded"
        )
    try:
        path = Path(
            snapshot_download(repo_id, revision=commit, allow_patterns=sorted(files), token=token)
        )
    except Exception as e:
        raise ModelLoadError(f"cannot fetch {repo_id!r} from the hub: {e}") from e
    for name, size in files.items():
        _check_size(path / name, size, repo_id)
    return path


def _check_size(path: Path, size: int, repo_id: str) -> None:
    try:
        got = path.stat().st_size
    except OSError as e:
        raise ModelLoadError(f"{path.name} of the hub repo {repo_id!r} is missing: {e}") from e
    if got != size:
        raise ModelLoadError(
            f"{path.name} of the hub repo {repo_id!r} has {got:,} bytes, the hub listed {size:,}"
        )


def load_config_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data
