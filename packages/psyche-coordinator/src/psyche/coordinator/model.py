"""What is trained: the `[model.LLM]` section of a run (upstream `model.rs`).

Field order is wire order. Strings have the capacities of upstream's on-chain `FixedString`s.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

from psyche.core.data_shuffle import Shuffle
from psyche.core.definitions import ConstantLR, LearningRateSchedule, OptimizerDefinition
from psyche.core.serde import U8, U32, DataEnum, FixedStr, RustEnum, struct, variant
from psyche.core.token_size import TokenSize

SOLANA_MAX_STRING_LEN = 64
SOLANA_MAX_URL_STRING_LEN = 192


class LLMArchitecture(RustEnum):
    HfLlama = 0
    HfDeepseek = 1
    HfAuto = 2
    Torchtitan = 3

    def __str__(self) -> str:
        return self.name


class LLMTrainingDataType(RustEnum):
    Pretraining = 0
    Finetuning = 1


@struct(frozen=True)
class NumberedFiles:
    url_template: Annotated[str, FixedStr(SOLANA_MAX_STRING_LEN)]
    start_index: U32
    n_left_pad_zeros: U8
    num_files: U32


@struct(frozen=True)
class Gcp:
    bucket_name: Annotated[str, FixedStr(SOLANA_MAX_STRING_LEN)]
    # Empty means the whole bucket.
    filter_directory: Annotated[str, FixedStr(SOLANA_MAX_URL_STRING_LEN)]


class HttpTrainingDataLocation(DataEnum):
    SingleUrl = variant(Annotated[str, FixedStr(SOLANA_MAX_URL_STRING_LEN)])
    NumberedFiles = variant(NumberedFiles)
    Gcp = variant(Gcp)


@struct(frozen=True)
class HttpLLMTrainingDataLocation:
    location: HttpTrainingDataLocation
    token_size_in_bytes: TokenSize
    shuffle: Shuffle


class LLMTrainingDataLocation(DataEnum):
    Dummy = variant()
    # "ip:port" of the centralized server's TCP data server.
    Server = variant(Annotated[str, FixedStr(SOLANA_MAX_STRING_LEN)])
    Local = variant(Annotated[str, FixedStr(SOLANA_MAX_URL_STRING_LEN)])
    Http = variant(HttpLLMTrainingDataLocation)
    # URL of a JSON list of weighted HTTP locations.
    WeightedHttp = variant(Annotated[str, FixedStr(SOLANA_MAX_URL_STRING_LEN)])
    Preprocessed = variant(Annotated[str, FixedStr(SOLANA_MAX_URL_STRING_LEN)])

    def is_bad(self) -> bool:
        """Upstream `Model::check`'s test of a data location (an empty address or URL)."""
        match self:
            case LLMTrainingDataLocation.Dummy() | LLMTrainingDataLocation.Local(_):
                return False
            case (
                LLMTrainingDataLocation.Server(text)
                | LLMTrainingDataLocation.WeightedHttp(text)
                | LLMTrainingDataLocation.Preprocessed(text)
            ):
                return bool(text == "")
            case LLMTrainingDataLocation.Http(http):
                match http.location:
                    case HttpTrainingDataLocation.SingleUrl(url):
                        return bool(url == "")
                    case HttpTrainingDataLocation.NumberedFiles(numbered):
                        return bool(numbered.url_template == "" or numbered.num_files == 0)
                    case HttpTrainingDataLocation.Gcp(gcp):
                        return bool(gcp.bucket_name == "")
        raise TypeError(f"not a data location: {self!r}")


@struct(frozen=True)
class HubRepo:
    repo_id: Annotated[str, FixedStr(SOLANA_MAX_STRING_LEN)]
    revision: Annotated[str, FixedStr(SOLANA_MAX_STRING_LEN)] | None = None

    @classmethod
    def dummy(cls) -> HubRepo:
        return cls("")


@struct(frozen=True)
class GcsRepo:
    bucket: Annotated[str, FixedStr(SOLANA_MAX_STRING_LEN)]
    prefix: Annotated[str, FixedStr(SOLANA_MAX_STRING_LEN)] | None = None

    @classmethod
    def dummy(cls) -> GcsRepo:
        return cls("")


class Checkpoint(DataEnum):
    """Where a client joining the run gets the model."""

    Ephemeral = variant()
    Dummy = variant(HubRepo)
    Hub = variant(HubRepo)
    # Fetch from the other clients; the repo is kept to fall back to when none is left.
    P2P = variant(HubRepo)
    Gcs = variant(GcsRepo)
    P2PGcs = variant(GcsRepo)

    def __str__(self) -> str:
        match self:
            case Checkpoint.Dummy(_):
                return "Dummy"
            case Checkpoint.Ephemeral():
                return "Ephemeral"
            case Checkpoint.Hub(repo):
                return str(repo.repo_id)
            case Checkpoint.P2P(repo):
                return f"P2P - Hub repo: {repo.repo_id}"
            case Checkpoint.Gcs(repo) | Checkpoint.P2PGcs(repo):
                if repo.prefix is not None:
                    return f"gs://{repo.bucket}/{repo.prefix}"
                return f"gs://{repo.bucket}"
        raise TypeError(f"not a checkpoint: {self!r}")

    def is_bad(self) -> bool:
        """Upstream `Model::check`'s test of a checkpoint."""
        match self:
            case Checkpoint.Dummy(_):
                return False
            case Checkpoint.Ephemeral():
                return True
            case Checkpoint.Hub(repo) | Checkpoint.P2P(repo):
                return bool(repo.repo_id == "")
            case Checkpoint.Gcs(repo) | Checkpoint.P2PGcs(repo):
                return bool(repo.bucket == "")
        raise TypeError(f"not a checkpoint: {self!r}")


@struct(kw_only=True)
class LLM:
    """A language model to train.

    `data_location` is the run's primary data location (upstream has exactly one). Run configs may
    list more (`data_locations = [...]`): the rest are kept in `backup_data_locations`, which is
    not part of upstream's wire format (see `RunConfig` and the centralized protocol).
    """

    max_seq_len: U32
    cold_start_warmup_steps: U32
    architecture: LLMArchitecture
    checkpoint: Checkpoint
    data_type: LLMTrainingDataType
    data_location: LLMTrainingDataLocation
    lr_schedule: LearningRateSchedule
    optimizer: OptimizerDefinition
    backup_data_locations: list[LLMTrainingDataLocation] = dataclasses.field(
        default_factory=list, metadata={"wire": False}
    )

    @property
    def data_locations(self) -> list[LLMTrainingDataLocation]:
        """Every data location in the order a client should try them."""
        return [self.data_location, *self.backup_data_locations]

    @classmethod
    def dummy(cls) -> LLM:
        return cls(
            max_seq_len=2048,
            cold_start_warmup_steps=0,
            architecture=LLMArchitecture.HfLlama,
            checkpoint=Checkpoint.Dummy(HubRepo.dummy()),
            data_type=LLMTrainingDataType.Pretraining,
            data_location=LLMTrainingDataLocation.Dummy(),
            lr_schedule=LearningRateSchedule.Constant(ConstantLR(0.0, 0.0, 0)),
            optimizer=OptimizerDefinition.Dummy(),
        )


class Model(DataEnum):
    LLM = variant(LLM)

    def check(self) -> bool:
        """Upstream `Model::check` (run by the Solana program before a run may start)."""
        return not self.check_problems()

    def check_problems(self) -> list[str]:
        """Why `check` fails, in upstream's order (empty when the model is usable)."""
        llm: LLM = self.value
        problems = []
        if llm.max_seq_len == 0:
            problems.append("max_seq_len is 0")
        for i, location in enumerate(llm.data_locations):
            if location.is_bad():
                problems.append(f"bad LLM training data location #{i}: {location!r}")
        if llm.checkpoint.is_bad():
            problems.append(f"bad checkpoint: {llm.checkpoint!r}")
        if isinstance(llm.optimizer, OptimizerDefinition.Dummy):
            problems.append("bad optimizer: Dummy cannot train")
        return problems
