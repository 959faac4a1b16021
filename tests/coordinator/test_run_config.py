"""Run configuration: loading every spelling in the wild, precise errors, round trips."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from psyche.coordinator import Coordinator, RunState
from psyche.coordinator.config import ConfigError, CoordinatorConfig
from psyche.coordinator.model import (
    Checkpoint,
    Gcp,
    HttpLLMTrainingDataLocation,
    HttpTrainingDataLocation,
    HubRepo,
    LLMArchitecture,
    LLMTrainingDataLocation,
    NumberedFiles,
)
from psyche.coordinator.run_config import (
    ConfigFileError,
    describe_data_location,
    dumps_toml,
    load_run_config,
    load_state_toml,
    parse_run_config,
    run_config_to_obj,
    state_to_toml_obj,
)
from psyche.core.data_shuffle import Shuffle
from psyche.core.definitions import LearningRateSchedule, OptimizerDefinition
from psyche.core.token_size import TokenSize

from ..upstream_data import UpstreamData
from .examples import CONSILIENCE, TEST_STATE

REPO = Path(__file__).resolve().parents[2]

# The two examples of the run-configuration documentation, values only: the first with upstream's
# single `data_location` table (and the legacy `rounds_per_epoch`), the second with the list of
# backup locations.
DOC_EXAMPLE_CONFIG = """
[config]
warmup_time = 30
cooldown_time = 30
rounds_per_epoch = 20
max_round_train_time = 30
round_witness_time = 1
min_clients = 1
init_min_clients = 1
verification_percent = 0
witness_nodes = 1
global_batch_size_start = 8
global_batch_size_end = 8
global_batch_size_warmup_tokens = 0
total_steps = 25000
"""

# The schedule and optimizer both examples end with.
DOC_EXAMPLE_TRAINING = """
[model.LLM.lr_schedule.Cosine]
base_lr = 4.0e-4
warmup_steps = 250
warmup_init_lr = 0.0
total_steps = 25000
final_lr = 4.0e-5

[model.LLM.optimizer.Distro]
clip_grad_norm = 1.0
compression_decay = 0.999
compression_chunk = 64
compression_topk = 8
quantize_1bit = true
"""

DOC_EXAMPLE_MODEL_SINGLE = (
    """
[model.LLM]
architecture = "HfLlama"
data_type = "Pretraining"
max_seq_len = 2048

[model.LLM.checkpoint.Hub]
repo_id = "emozilla/llama2-20m-init"

[model.LLM.data_location.Http]
token_size_in_bytes = "TwoBytes"
shuffle = "DontShuffle"

[model.LLM.data_location.Http.location.Gcp]
bucket_name = "nous-pretraining-public-us"
filter_directory = "fineweb-edu-tokenized-llama2"
"""
    + DOC_EXAMPLE_TRAINING
)

DOC_EXAMPLE_MODEL_LIST = (
    """
[model.LLM]
architecture = "HfLlama"
data_type = "Pretraining"
max_seq_len = 2048
data_locations = [
    { Http = { location = { Gcp = { bucket_name = "nous-pretraining-public-us", filter_directory = "fineweb-edu-tokenized-llama2" } }, token_size_in_bytes = "TwoBytes", shuffle = "DontShuffle" } },
    { Http = { location = { SingleUrl = "https://example.org/backup/000.ds" }, token_size_in_bytes = "TwoBytes", shuffle = "DontShuffle" } },
]

[model.LLM.checkpoint.Hub]
repo_id = "emozilla/llama2-20m-init"
"""
    + DOC_EXAMPLE_TRAINING
)


def write(tmp_path: Path, text: str, name: str = "state.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems_of(path: Path) -> list[tuple[str, str]]:
    with pytest.raises(ConfigFileError) as info:
        load_run_config(path)
    assert info.value.path == path
    assert str(path) in str(info.value)
    return info.value.problems


def test_state_file_loads_into_a_coordinator(tmp_path: Path) -> None:
    loaded = load_run_config(write(tmp_path, TEST_STATE))
    assert loaded.is_state_file
    assert loaded.run_id == "test"
    coordinator = loaded.coordinator
    assert isinstance(coordinator, Coordinator)
    assert coordinator.run_state is RunState.WaitingForMembers
    assert coordinator.config.total_steps == 10
    assert coordinator.config.waiting_for_members_extra_time == 3
    # serde defaults: progress starts at step 1 and the epoch starts with a first round
    assert coordinator.progress.step == 1
    assert coordinator.epoch_state.first_round is True
    llm = loaded.llm
    assert llm.max_seq_len == 512
    assert llm.architecture is LLMArchitecture.HfLlama
    assert llm.checkpoint == Checkpoint.Dummy(HubRepo(""))
    assert llm.data_locations == [LLMTrainingDataLocation.Dummy()]
    assert llm.optimizer == OptimizerDefinition.Dummy()
    assert isinstance(llm.lr_schedule, LearningRateSchedule.Cosine)
    assert llm.lr_schedule.value.total_steps == 2000
    assert loaded.warnings == [
        "model.LLM: bad optimizer: Dummy cannot train (fine for a centralized run; the Solana "
        "coordinator program rejects such a model)"
    ]


def test_load_state_toml_requires_a_run_id(tmp_path: Path) -> None:
    path = write(tmp_path, DOC_EXAMPLE_CONFIG + DOC_EXAMPLE_MODEL_SINGLE)
    with pytest.raises(ConfigFileError, match="run_id"):
        load_state_toml(path)
    assert load_state_toml(write(tmp_path, TEST_STATE, "s.toml")).run_id == "test"


def test_documented_example_with_single_location_and_legacy_keys(tmp_path: Path) -> None:
    loaded = load_run_config(write(tmp_path, DOC_EXAMPLE_CONFIG + DOC_EXAMPLE_MODEL_SINGLE))
    assert not loaded.is_state_file
    # warmup + rounds * (train + witness) = 30 + 20 * 31
    assert loaded.config.epoch_time == 650
    assert loaded.config.waiting_for_members_extra_time == 10
    assert loaded.llm.cold_start_warmup_steps == 0
    assert any("rounds_per_epoch" in w for w in loaded.warnings)
    assert any("waiting_for_members_extra_time" in w for w in loaded.warnings)
    (location,) = loaded.llm.data_locations
    assert isinstance(location, LLMTrainingDataLocation.Http)
    gcp = location.value.location
    assert isinstance(gcp, HttpTrainingDataLocation.Gcp)
    assert gcp.value.bucket_name == "nous-pretraining-public-us"
    distro = loaded.llm.optimizer.value
    assert distro.compression_topk == 8
    assert distro.quantize_1bit is True
    assert distro.compression_decay == pytest.approx(0.999, rel=1e-7)
    assert distro.weight_decay is None


def test_documented_example_with_backup_locations(tmp_path: Path) -> None:
    loaded = load_run_config(write(tmp_path, DOC_EXAMPLE_CONFIG + DOC_EXAMPLE_MODEL_LIST))
    primary, backup = loaded.llm.data_locations
    assert isinstance(primary.value.location, HttpTrainingDataLocation.Gcp)
    assert backup.value.location == HttpTrainingDataLocation.SingleUrl(
        "https://example.org/backup/000.ds"
    )
    assert loaded.llm.data_location == primary
    assert loaded.llm.backup_data_locations == [backup]


def test_both_spellings_give_the_same_model(tmp_path: Path) -> None:
    single = load_run_config(write(tmp_path, DOC_EXAMPLE_CONFIG + DOC_EXAMPLE_MODEL_SINGLE, "a"))
    listed = DOC_EXAMPLE_MODEL_SINGLE.replace(
        "[model.LLM.data_location.Http]",
        "[[model.LLM.data_locations]]\n[model.LLM.data_locations.Http]",
    ).replace(
        "[model.LLM.data_location.Http.location.Gcp]",
        "[model.LLM.data_locations.Http.location.Gcp]",
    )
    as_list = load_run_config(write(tmp_path, DOC_EXAMPLE_CONFIG + listed, "b"))
    assert as_list.model == single.model


@pytest.mark.parametrize("text", [TEST_STATE, DOC_EXAMPLE_CONFIG + DOC_EXAMPLE_MODEL_LIST])
def test_round_trip_load_dump_load(tmp_path: Path, text: str) -> None:
    first = load_run_config(write(tmp_path, text))
    if first.coordinator is not None:
        doc = state_to_toml_obj(first.coordinator)
    else:
        doc = run_config_to_obj(first.config, first.model)
    second = load_run_config(write(tmp_path, dumps_toml(doc), "again.toml"))
    assert second.model == first.model
    assert second.config == first.config
    assert second.warnings == [
        w for w in first.warnings if "missing" not in w and "legacy" not in w
    ]


def test_round_trip_keeps_f32_values(tmp_path: Path) -> None:
    first = load_run_config(write(tmp_path, DOC_EXAMPLE_CONFIG + DOC_EXAMPLE_MODEL_SINGLE))
    text = dumps_toml(run_config_to_obj(first.config, first.model))
    # f32 values are written in their shortest form, not widened to f64 digits
    assert "compression_decay = 0.999\n" in text
    assert load_run_config(write(tmp_path, text, "b.toml")).model == first.model


def test_project_configs_are_valid() -> None:
    paths = sorted((REPO / "configs").glob("*/state.toml"))
    assert len(paths) >= 3
    for path in paths:
        loaded = load_run_config(path)
        assert loaded.is_state_file, path


# ---- precise errors ---------------------------------------------------------------------------


def test_missing_field_is_named(tmp_path: Path) -> None:
    text = TEST_STATE.replace("min_clients = 2\ninit", "init")
    assert problems_of(write(tmp_path, text)) == [("config.min_clients", "missing required field")]


def test_wrong_type_is_named_with_what_was_found(tmp_path: Path) -> None:
    text = TEST_STATE.replace("max_seq_len = 512", 'max_seq_len = "512"')
    ((where, msg),) = problems_of(write(tmp_path, text))
    assert where == "model.LLM.max_seq_len"
    assert msg == "expected an integer (u32), found string '512'"


def test_unknown_variant_lists_the_expected_ones(tmp_path: Path) -> None:
    text = TEST_STATE.replace('architecture = "HfLlama"', 'architecture = "HfLLama"')
    ((where, msg),) = problems_of(write(tmp_path, text))
    assert where == "model.LLM.architecture"
    assert "'HfLLama'" in msg
    assert "'HfLlama', 'HfDeepseek', 'HfAuto', 'Torchtitan'" in msg

    text = TEST_STATE.replace("[model.LLM.checkpoint.Dummy]", "[model.LLM.checkpoint.Hubb]")
    ((where, msg),) = problems_of(write(tmp_path, text, "b.toml"))
    assert where == "model.LLM.checkpoint"
    assert "unknown Checkpoint variant 'Hubb'" in msg


def test_out_of_range_integer(tmp_path: Path) -> None:
    text = TEST_STATE.replace("min_clients = 2\ninit", "min_clients = 70000\ninit")
    ((where, msg),) = problems_of(write(tmp_path, text))
    assert where == "config.min_clients"
    assert msg == "70000 is out of range for u16 (0..=65535)"
    text = TEST_STATE.replace("warmup_time = 5", "warmup_time = -5")
    assert problems_of(write(tmp_path, text, "b.toml"))[0][0] == "config.warmup_time"


def test_unknown_key_is_an_error(tmp_path: Path) -> None:
    text = TEST_STATE.replace("total_steps = 10\n", "total_steps = 10\ntotal_step = 11\n")
    ((where, msg),) = problems_of(write(tmp_path, text))
    assert where == "config.total_step"
    assert msg.startswith("unknown key")
    text = TEST_STATE.replace('repo_id = ""', 'repo_id = ""\nrevison = "main"')
    ((where, _),) = problems_of(write(tmp_path, text, "b.toml"))
    assert where == "model.LLM.checkpoint.Dummy.revison"


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    text = TEST_STATE.replace("min_clients = 2\ninit", "init").replace(
        "max_seq_len = 512", "max_seq_len = 1.5"
    )
    wheres = [w for w, _ in problems_of(write(tmp_path, text))]
    assert sorted(wheres) == ["config.min_clients", "model.LLM.max_seq_len"]


def test_errors_inside_a_backup_location_use_the_list_path(tmp_path: Path) -> None:
    text = DOC_EXAMPLE_CONFIG + DOC_EXAMPLE_MODEL_LIST.replace(
        '{ SingleUrl = "https://example.org/backup/000.ds" }', "{ SingleUrl = 7 }"
    )
    ((where, msg),) = problems_of(write(tmp_path, text))
    assert where == "model.LLM.data_locations[1].Http.location.SingleUrl"
    assert "expected a string" in msg


def test_data_location_and_data_locations_together_is_an_error(tmp_path: Path) -> None:
    text = TEST_STATE.replace(
        'data_location = "Dummy"', 'data_location = "Dummy"\ndata_locations = ["Dummy"]'
    )
    ((where, _),) = problems_of(write(tmp_path, text))
    assert where == "model.LLM.data_locations"


def test_string_too_long_for_its_fixed_capacity(tmp_path: Path) -> None:
    text = TEST_STATE.replace('run_id = "test"', f'run_id = "{"r" * 33}"')
    ((where, msg),) = problems_of(write(tmp_path, text))
    assert where == "run_id"
    assert "FixedString<32>" in msg


def test_coordinator_rules_run_in_upstream_order(tmp_path: Path) -> None:
    # warmup_time >= epoch_time and witness_nodes > min_clients: the first check wins
    text = TEST_STATE.replace("warmup_time = 5", "warmup_time = 60").replace(
        "witness_nodes = 1", "witness_nodes = 3"
    )
    ((where, msg),) = problems_of(write(tmp_path, text))
    assert where == "config.warmup_time"
    assert "WarmupTime" in msg
    assert "found 60" in msg


def test_verification_percent_above_100_is_rejected(tmp_path: Path) -> None:
    text = TEST_STATE.replace("verification_percent = 0", "verification_percent = 101")
    ((where, _),) = problems_of(write(tmp_path, text))
    assert where == "config.verification_percent"


def test_syntax_errors_and_missing_files(tmp_path: Path) -> None:
    ((where, msg),) = problems_of(write(tmp_path, "run_id = \n"))
    assert where == ""
    assert msg.startswith("invalid TOML")
    ((_, msg),) = problems_of(tmp_path / "nope.toml")
    assert msg == "file not found"


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        # min_clients above what any run can have (upstream's error names init_min_clients)
        (
            {"\nmin_clients = 2": "\nmin_clients = 500"},
            "config.min_clients",
            ["(500)", "256", "(2)"],
        ),
        ({"init_min_clients = 2": "init_min_clients = 1"}, "config.min_clients", ["(2)", "(1)"]),
        (
            {"init_min_clients = 2": "init_min_clients = 300", "= 4\n": "= 400\n"},
            "config.init_min_clients",
            ["(300)", "at most 256"],
        ),
    ],
)
def test_client_counts_name_the_field_at_fault(
    tmp_path: Path, change: dict[str, str], field: str, words: list[str]
) -> None:
    text = TEST_STATE
    for old, new in change.items():
        assert old in text
        text = text.replace(old, new)
    ((where, msg),) = problems_of(write(tmp_path, text))
    assert where == field, msg
    assert all(w in msg for w in words), msg


def test_a_global_batch_smaller_than_init_min_clients_is_rejected(tmp_path: Path) -> None:
    # upstream issue #48: a first round with more clients than batches
    text = TEST_STATE.replace("init_min_clients = 2", "init_min_clients = 6")
    ((where, msg),) = problems_of(write(tmp_path, text))
    assert where == "config.global_batch_size_start"
    assert "global_batch_size_start (4)" in msg
    assert "init_min_clients (6)" in msg
    load_run_config(write(tmp_path, text.replace("= 4\n", "= 6\n")))  # equal is fine


@pytest.mark.parametrize(
    "nesting", ["[" * 100_000 + "]" * 100_000, "{a=" * 100_000 + "}" * 100_000]
)
def test_toml_nested_too_deeply_is_one_clear_error(tmp_path: Path, nesting: str) -> None:
    ((where, msg),) = problems_of(write(tmp_path, f"run_id = {nesting}\n"))
    assert where == ""
    assert msg == "invalid TOML: arrays or tables nested too deeply"
    deep: dict = {}
    for _ in range(100_000):
        deep = {"a": deep}
    with pytest.raises(ConfigFileError, match="nested too deeply"):
        parse_run_config({"run_id": "x", "config": deep})


@pytest.mark.parametrize(
    ("error", "change"),
    [
        (ConfigError.EpochTime, {"epoch_time": 0}),
        (ConfigError.WarmupTime, {"warmup_time": 60}),
        (ConfigError.MaxRoundTrainTime, {"max_round_train_time": 0}),
        (ConfigError.RoundWitnessTime, {"round_witness_time": 0}),
        (ConfigError.MinClients, {"min_clients": 0}),
        (ConfigError.InitMinClients, {"init_min_clients": 1}),
        (ConfigError.GlobalBatchSize, {"global_batch_size_end": 3}),
        (ConfigError.TotalSteps, {"total_steps": 0}),
        (ConfigError.WitnessNodes, {"witness_nodes": 33}),
        (ConfigError.CooldownTime, {"cooldown_time": 0}),
        (ConfigError.WaitingForMembersExtraTime, {"waiting_for_members_extra_time": 0}),
    ],
)
def test_check_error_each_rule(error: ConfigError, change: dict[str, int]) -> None:
    base = parse_run_config(read_toml_text(TEST_STATE)).config
    fields = {**base.__dict__, **change}
    assert CoordinatorConfig(**fields).check_error() is error
    assert base.check_error() is None


def read_toml_text(text: str) -> dict:
    import tomllib

    return tomllib.loads(text)


def test_batch_size_warmup_matches_upstream_rounding() -> None:
    # consilience: 12288 -> 32768 sequences over 549755813888 tokens [derived vectors]
    config = CONSILIENCE
    warmup = 549755813888
    assert config.get_batch_size(0) == 12288
    assert config.get_batch_size(warmup // 4) == 17408
    assert config.get_batch_size(warmup // 2) == 22528
    assert config.get_batch_size(warmup - 1) == 32768
    assert config.get_batch_size(warmup) == 32768
    # a tie rounds away from zero (Python's round() would give 2)
    tie = CoordinatorConfig(
        **{
            **config.__dict__,
            "global_batch_size_start": 1,
            "global_batch_size_end": 4,
            "global_batch_size_warmup_tokens": 2,
        }
    )
    assert tie.get_batch_size(1) == 3


# ---- upstream's own files ----------------------------------------------------------------------


def test_every_upstream_config_loads(upstream_data: UpstreamData) -> None:
    paths = upstream_data.glob("config", "*/*.toml")
    state_files = [p for p in paths if p.name != "data.toml"]
    assert len(state_files) >= 11
    for path in state_files:
        loaded = load_run_config(path)
        assert loaded.llm.max_seq_len > 0, path
        if path.parent.name == "solana-test":
            assert not loaded.is_state_file
        else:
            assert loaded.is_state_file
            assert loaded.run_id


def test_consilience_values(upstream_data: UpstreamData) -> None:
    loaded = load_run_config(upstream_data.path("config", "consilience", "state.toml"))
    assert loaded.run_id == "consilience-40b"
    assert loaded.llm.architecture is LLMArchitecture.HfDeepseek
    assert loaded.llm.cold_start_warmup_steps == 100
    assert loaded.config.global_batch_size_warmup_tokens == 549755813888
    schedule = loaded.llm.lr_schedule
    assert isinstance(schedule, LearningRateSchedule.WarmupStableDecay)
    assert schedule.value.stable_steps == 161000
    distro = loaded.llm.optimizer.value
    assert distro.weight_decay == pytest.approx(0.1, rel=1e-7)
    assert isinstance(loaded.llm.data_location, LLMTrainingDataLocation.WeightedHttp)


def test_documented_examples_from_the_reference_docs(upstream_data: UpstreamData) -> None:
    doc = upstream_data.path("..", "reference", "psyche-run-config.md")  # kept beside the data
    blocks = re.findall(r"```toml\n(.*?)```", doc.read_text(), flags=re.S)
    assert len(blocks) == 2
    loaded = parse_run_config(read_toml_text("\n".join(blocks)), doc)
    assert loaded.llm.data_locations
    assert loaded.config.epoch_time > loaded.config.warmup_time


def _http(location: HttpTrainingDataLocation) -> LLMTrainingDataLocation:
    return LLMTrainingDataLocation.Http(
        HttpLLMTrainingDataLocation(location, TokenSize.TwoBytes, Shuffle.DontShuffle())
    )


@pytest.mark.parametrize(
    ("location", "described"),
    [
        (LLMTrainingDataLocation.Dummy(), "Dummy"),
        (LLMTrainingDataLocation.Server("10.0.0.1:5000"), "Server(10.0.0.1:5000)"),
        (LLMTrainingDataLocation.Local("/data/fineweb"), "Local(/data/fineweb)"),
        (
            LLMTrainingDataLocation.WeightedHttp("https://w/x.json"),
            "WeightedHttp(https://w/x.json)",
        ),
        (LLMTrainingDataLocation.Preprocessed("/data/pre"), "Preprocessed(/data/pre)"),
        (_http(HttpTrainingDataLocation.SingleUrl("https://h/a.ds")), "Http(https://h/a.ds)"),
        (
            _http(
                HttpTrainingDataLocation.NumberedFiles(NumberedFiles("https://h/{}.ds", 0, 3, 12))
            ),
            "Http(https://h/{}.ds x12)",
        ),
        (_http(HttpTrainingDataLocation.Gcp(Gcp("bucket", "dir"))), "Http(gs://bucket/dir)"),
        ("not a location", "'not a location'"),
    ],
)
def test_a_data_location_is_described_in_one_line(location: object, described: str) -> None:
    """What the run summary and the Solana client's `show` print for each data location."""
    assert describe_data_location(location) == described
