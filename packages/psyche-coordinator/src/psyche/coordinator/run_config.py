"""Reading and writing run configuration files.

Two shapes of file exist upstream, and both are accepted:

* a *state file* (`state.toml`, what `psyche-server run --state` takes): a snapshot of a
  `Coordinator` with `run_id`, `run_state`, `[config]` and `[model.LLM]`, optionally progress and
  epoch state from a saved run;
* a *run config* (`config.toml`, what `psyche-solana-client update-config` takes): only
  `[config]` and `[model.LLM]`.

Spellings found in the wild are normalized before validation, each with a warning:

* `data_location = {...}` (upstream) or `data_locations = [{...}, ...]` (the documented list of
  backup locations): either gives one primary location plus an ordered list of backups;
* `rounds_per_epoch` (an older, documented schema) when `epoch_time` is absent:
  `epoch_time = warmup_time + rounds_per_epoch * (max_round_train_time + round_witness_time)`,
  the longest those rounds can take;
* a missing `waiting_for_members_extra_time` defaults to upstream's
  `WAITING_FOR_MEMBERS_EXTRA_SECONDS` (10) and a missing `cold_start_warmup_steps` to 0.

Errors name the file, the TOML path of the field, what was expected and what was found.
"""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import tomli_w

from psyche.coordinator.config import (
    SOLANA_MAX_NUM_CLIENTS,
    WAITING_FOR_MEMBERS_EXTRA_SECONDS,
    ConfigError,
    CoordinatorConfig,
)
from psyche.coordinator.coordinator import Coordinator
from psyche.coordinator.diloco_config import diloco_problems
from psyche.coordinator.distro_config import distro_sparse_problems
from psyche.coordinator.following import CONVICTING_WORDS
from psyche.coordinator.model import LLM, HttpTrainingDataLocation, LLMTrainingDataLocation, Model
from psyche.core.definitions import LearningRateSchedule, OptimizerDefinition
from psyche.core.serde import SerdeError, from_obj, struct, to_obj


class ConfigFileError(ValueError):
    """A configuration file that cannot be used; `problems` are (TOML path, message) pairs."""

    def __init__(self, path: Path | str, problems: list[tuple[str, str]]) -> None:
        self.path = Path(path)
        self.problems = problems
        lines = [f"{where or '<top level>'}: {msg}" for where, msg in problems]
        if len(lines) == 1:
            super().__init__(f"{path}: {lines[0]}")
        else:
            super().__init__(f"{path}: {len(lines)} problems:\n  " + "\n  ".join(lines))


@struct
class RunConfig:
    """The `[config]` and `[model]` of a run: everything its creator chooses."""

    config: CoordinatorConfig
    model: Model


@dataclass
class RunConfigFile:
    """A validated configuration file and what was learned while reading it."""

    path: Path
    config: CoordinatorConfig
    model: Model
    # Set for state files; None for plain run configs.
    run_id: str | None = None
    # The full snapshot for state files.
    coordinator: Coordinator | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def llm(self) -> LLM:
        llm: LLM = self.model.value
        return llm

    @property
    def is_state_file(self) -> bool:
        return self.run_id is not None

    def summary(self) -> str:
        """One line for humans: run id, model, data locations, total steps."""
        llm = self.llm
        locations = ", ".join(describe_data_location(loc) for loc in llm.data_locations)
        run = f"run {self.run_id!r}" if self.run_id is not None else "run config (no run_id)"
        return (
            f"{run}: {llm.architecture.name} model, checkpoint {llm.checkpoint}, "
            f"max_seq_len {llm.max_seq_len}, data [{locations}], "
            f"total_steps {self.config.total_steps}"
        )


def describe_data_location(location: Any) -> str:
    """One line for a data location: the variant and where it points (`Server(addr)`,
    `Local(path)`, `Http(url)`, ...)."""
    match location:
        case LLMTrainingDataLocation.Dummy():
            return "Dummy"
        case LLMTrainingDataLocation.Http(http):
            match http.location:
                case HttpTrainingDataLocation.SingleUrl(url):
                    return f"Http({url})"
                case HttpTrainingDataLocation.NumberedFiles(numbered):
                    return f"Http({numbered.url_template} x{numbered.num_files})"
                case HttpTrainingDataLocation.Gcp(gcp):
                    return f"Http(gs://{gcp.bucket_name}/{gcp.filter_directory})"
        case LLMTrainingDataLocation():  # every other variant carries one address, path or URL
            return f"{location.variant_name}({location.value})"
    return repr(location)


# --------------------------------------------------------------------------------------------
# Reading


def read_toml(path: Path | str) -> dict[str, Any]:
    """Parse a TOML file, turning I/O and syntax errors into `ConfigFileError`."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigFileError(path, [("", "file not found")]) from None
    except IsADirectoryError:
        raise ConfigFileError(path, [("", "is a directory, expected a TOML file")]) from None
    except OSError as e:
        raise ConfigFileError(path, [("", f"cannot read: {e.strerror}")]) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigFileError(path, [("", f"invalid TOML: {e}")]) from None
    except UnicodeDecodeError as e:
        raise ConfigFileError(path, [("", f"not UTF-8 text: {e}")]) from None
    except RecursionError:
        # tomllib parses nested arrays and tables recursively; no run config nests deeply
        raise ConfigFileError(path, [("", TOO_DEEP)]) from None


TOO_DEEP = "invalid TOML: arrays or tables nested too deeply"
MAX_EXACT_VERIFICATION_THREADS = 1024
"""The most CPU intra-op threads `config.exact_verification_threads` may name."""


def load_run_config(path: Path | str) -> RunConfigFile:
    """Load and fully validate a state file or a run config (see the module docstring)."""
    path = Path(path)
    return parse_run_config(read_toml(path), path)


def load_state_toml(path: Path | str) -> Coordinator:
    """Load a state file (`state.toml`), fully validated; raises `ConfigFileError`."""
    loaded = load_run_config(path)
    if loaded.coordinator is None:
        raise ConfigFileError(
            path, [("run_id", "missing: a state file needs run_id and run_state")]
        )
    return loaded.coordinator


def parse_run_config(raw: dict[str, Any], path: Path | str = "<config>") -> RunConfigFile:
    path = Path(path)
    warnings: list[str] = []
    problems: list[tuple[str, str]] = []
    try:
        doc = copy.deepcopy(raw)
    except RecursionError:
        raise ConfigFileError(path, [("", TOO_DEEP)]) from None
    remap = _normalize(doc, warnings, problems)
    if problems:
        raise ConfigFileError(path, problems)

    is_state = "run_id" in doc or "run_state" in doc
    try:
        coordinator: Coordinator | None
        if is_state:
            coordinator = from_obj(doc, Coordinator)
            config, model, run_id = coordinator.config, coordinator.model, coordinator.run_id
        else:
            run_config = from_obj(doc, RunConfig)
            coordinator, run_id = None, None
            config, model = run_config.config, run_config.model
    except SerdeError as e:
        raise ConfigFileError(path, [(remap(where), msg) for where, msg in e.problems]) from None

    problems.extend(semantic_problems(config, model))
    if problems:
        raise ConfigFileError(path, problems)
    for problem in model.check_problems():
        warnings.append(
            f"model.LLM: {problem} (fine for a centralized run; the Solana coordinator "
            "program rejects such a model)"
        )
    return RunConfigFile(path, config, model, run_id, coordinator, warnings)


def semantic_problems(config: CoordinatorConfig, model: Model) -> list[tuple[str, str]]:
    """Checks beyond the types: upstream's `check_error`, then what upstream would panic on."""
    problems: list[tuple[str, str]] = []
    error = config.check_error()
    if error is ConfigError.InitMinClients:
        problems.append(_client_counts_problem(config))
    elif error is not None:
        found = getattr(config, error.field)
        problems.append(
            (
                f"config.{error.field}",
                f"invalid coordinator config ({error.name}): {error.value}; found {found}",
            )
        )
    if error is None and config.global_batch_size_start < config.init_min_clients:
        # upstream issue #48: the first round's clients would outnumber its batches
        problems.append(
            (
                "config.global_batch_size_start",
                f"global_batch_size_start ({config.global_batch_size_start}) must be at least "
                f"init_min_clients ({config.init_min_clients}): every client of an epoch's "
                "first round needs a batch",
            )
        )
    if config.verification_percent > 100:
        problems.append(
            (
                "config.verification_percent",
                f"must be at most 100, found {config.verification_percent}",
            )
        )
    if config.exact_verification_threads and config.verification_percent == 0:
        problems.append(
            (
                "config.exact_verification_threads",
                "needs verification_percent > 0 (exact verification is a verifying run's)",
            )
        )
    elif config.exact_verification_threads and config.init_min_clients <= CONVICTING_WORDS:
        problems.append(
            (
                "config.exact_verification_threads",
                f"needs init_min_clients >= {CONVICTING_WORDS + 1} (a trainer is convicted only "
                f"on the words of {CONVICTING_WORDS} followers besides it), found "
                f"{config.init_min_clients}",
            )
        )
    if not 0 <= config.exact_verification_threads <= MAX_EXACT_VERIFICATION_THREADS:
        problems.append(
            (
                "config.exact_verification_threads",
                f"must be 0 to {MAX_EXACT_VERIFICATION_THREADS}, found "
                f"{config.exact_verification_threads}",
            )
        )
    if config.verifiers_train and config.verification_percent == 0:
        problems.append(
            (
                "config.verifiers_train",
                "needs verification_percent > 0 (without verifiers every client trains anyway)",
            )
        )
    llm: LLM = model.value
    if isinstance(llm.lr_schedule, LearningRateSchedule.WarmupStableDecay):
        wsd = llm.lr_schedule.value
        where = "model.LLM.lr_schedule.WarmupStableDecay"
        if not wsd.cosine_decay_final_lr <= wsd.base_lr:
            problems.append((f"{where}.cosine_decay_final_lr", "must be at most base_lr"))
        if not wsd.linear_decay_final_lr <= wsd.cosine_decay_final_lr:
            problems.append(
                (f"{where}.linear_decay_final_lr", "must be at most cosine_decay_final_lr")
            )
    if isinstance(llm.optimizer, OptimizerDefinition.DiLoCo):
        problems.extend(diloco_problems(config, llm.optimizer.value, llm.lr_schedule))
    if isinstance(llm.optimizer, OptimizerDefinition.DistroSparse):
        problems.extend(distro_sparse_problems(config, llm.optimizer.value))
    return problems


def _client_counts_problem(config: CoordinatorConfig) -> tuple[str, str]:
    """Upstream's `InitMinClients` error names one field for three faults; say which it is."""
    init, least = config.init_min_clients, config.min_clients
    if least > SOLANA_MAX_NUM_CLIENTS:
        return (
            "config.min_clients",
            f"min_clients ({least}) must be at most {SOLANA_MAX_NUM_CLIENTS} and at most "
            f"init_min_clients ({init})",
        )
    if init > SOLANA_MAX_NUM_CLIENTS:
        return (
            "config.init_min_clients",
            f"init_min_clients ({init}) must be at most {SOLANA_MAX_NUM_CLIENTS}",
        )
    return (
        "config.min_clients",
        f"min_clients ({least}) must be at most init_min_clients ({init}): an epoch starts with "
        "init_min_clients and goes on while min_clients remain",
    )


def _normalize(
    doc: dict[str, Any], warnings: list[str], problems: list[tuple[str, str]]
) -> Callable[[str], str]:
    """Rewrite legacy and list spellings in place; returns a mapper from validated-field paths
    back to the paths the user wrote."""
    config = doc.get("config")
    if isinstance(config, dict):
        rounds = _other_spelling(
            config,
            "config",
            "rounds_per_epoch",
            "epoch_time",
            "legacy key given together with epoch_time; remove rounds_per_epoch",
            problems,
        )
        if rounds is not _ABSENT:
            parts = [
                config.get(k) for k in ("warmup_time", "max_round_train_time", "round_witness_time")
            ]
            if _all_ints(parts) and _all_ints([rounds]):
                warmup, train, witness = parts
                config["epoch_time"] = warmup + rounds * (train + witness)
                warnings.append(
                    f"config.rounds_per_epoch is a legacy key: epochs are now timed; using "
                    f"epoch_time = warmup_time + rounds_per_epoch * (max_round_train_time + "
                    f"round_witness_time) = {config['epoch_time']} s"
                )
            else:
                problems.append(
                    (
                        "config.rounds_per_epoch",
                        "legacy key: replace it with epoch_time (seconds); it needs integer "
                        "warmup_time, max_round_train_time and round_witness_time to convert",
                    )
                )
        _default(
            config,
            "config",
            "waiting_for_members_extra_time",
            WAITING_FOR_MEMBERS_EXTRA_SECONDS,
            f"{WAITING_FOR_MEMBERS_EXTRA_SECONDS} s",
            warnings,
        )

    used_list = False
    model = doc.get("model")
    llm = model.get("LLM") if isinstance(model, dict) else None
    if isinstance(llm, dict):
        if "backup_data_locations" in llm:
            problems.append(
                (
                    "model.LLM.backup_data_locations",
                    "unknown key; list backup locations as data_locations = [primary, backup, ...]",
                )
            )
        locations = _other_spelling(
            llm,
            "model.LLM",
            "data_locations",
            "data_location",
            "give either data_location or data_locations, not both",
            problems,
        )
        if locations is not _ABSENT:
            if not isinstance(locations, list) or not locations:
                problems.append(
                    ("model.LLM.data_locations", "expected a non-empty array of data locations")
                )
            else:
                used_list = True
                llm["data_location"] = locations[0]
                llm["backup_data_locations"] = locations[1:]
        _default(llm, "model.LLM", "cold_start_warmup_steps", 0, "0", warnings)

    def remap(where: str) -> str:
        if not used_list:
            return where
        primary = "model.LLM.data_location"
        backups = "model.LLM.backup_data_locations["
        if where == primary or where.startswith(primary + "."):
            return "model.LLM.data_locations[0]" + where[len(primary) :]
        if where.startswith(backups):
            index, rest = where[len(backups) :].split("]", 1)
            return f"model.LLM.data_locations[{int(index) + 1}]{rest}"
        return where

    return remap


_ABSENT = object()


def _other_spelling(
    table: dict[str, Any],
    where: str,
    key: str,
    canonical: str,
    clash: str,
    problems: list[tuple[str, str]],
) -> Any:
    """Takes `key`, another spelling of `canonical` (a legacy key, a list form), out of `table`
    (at `where`): its value, for the caller to rewrite as `canonical`; `_ABSENT` when it is not
    there, or when `canonical` is given too (the problem `clash`, at `where.key`)."""
    if key not in table:
        return _ABSENT
    value = table.pop(key)
    if canonical in table:
        problems.append((f"{where}.{key}", clash))
        return _ABSENT
    return value


def _default(
    table: dict[str, Any], where: str, key: str, value: Any, said: str, warnings: list[str]
) -> None:
    """`key` that files written before it existed lack: set to `value`, with a warning saying
    `said` is used."""
    if key not in table:
        table[key] = value
        warnings.append(f"{where}.{key} is missing: using {said}")


def _all_ints(values: list[Any]) -> TypeGuard[list[int]]:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


# --------------------------------------------------------------------------------------------
# Writing


def run_config_to_obj(config: CoordinatorConfig, model: Model) -> dict[str, Any]:
    """The TOML document of a run config, with backups written as `data_locations`."""
    return {"config": to_obj(config), "model": model_to_obj(model)}


def state_to_toml_obj(coordinator: Coordinator) -> dict[str, Any]:
    """A state as a TOML document (backup data locations as `data_locations`)."""
    obj: dict[str, Any] = to_obj(coordinator, Coordinator)
    obj["model"] = model_to_obj(coordinator.model)
    return obj


def model_to_obj(model: Model, *, json: bool = False) -> dict[str, Any]:
    obj: dict[str, Any] = to_obj(model, Model, json=json)
    llm = obj["LLM"]
    backups = llm.pop("backup_data_locations", [])
    if backups:
        llm["data_locations"] = [llm.pop("data_location"), *backups]
    return obj


def dumps_toml(doc: dict[str, Any]) -> str:
    return tomli_w.dumps(doc)
