"""`psyche-client`: identity, flags from the command line and the environment, refusal of the
features the port does not build, and a `--help` that imports nothing heavy."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from psyche.cli.client.main import build_parser, main
from psyche.client.setup.options import TrainOptions, field_docs

# upstream-coordinator.md §4.1: test key n=1
KEY1_PUBLIC = "4cb5abf6ad79fbf5abbccafcc269d85cd2651ed4b885b5869f241aedf0a5ba29"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RAW_IDENTITY_SECRET_KEY", "RUN_ID", "SERVER_ADDR", "HF_TOKEN", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)


def parse(argv: list[str]):  # type: ignore[no-untyped-def]
    parser, env = build_parser()
    args = parser.parse_args(argv)
    env.resolve(parser, args)
    return args


def test_show_identity_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RAW_IDENTITY_SECRET_KEY", f"{1:064x}")
    assert main(["show-identity"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"Public key: {KEY1_PUBLIC}", f"Secret key: {1:064x}"]


def test_show_identity_from_a_key_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "secret.key"
    path.write_bytes((1).to_bytes(32, "big"))
    assert main(["show-identity", "--identity-secret-key-path", str(path)]) == 0
    assert KEY1_PUBLIC in capsys.readouterr().out
    path.write_bytes(b"short")
    assert main(["show-identity", "--identity-secret-key-path", str(path)]) == 2
    assert "holds exactly 32 raw bytes, found 5" in capsys.readouterr().err


def test_identity_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show-identity"]) == 2
    assert "RAW_IDENTITY_SECRET_KEY" in capsys.readouterr().err
    monkeypatch.setenv("RAW_IDENTITY_SECRET_KEY", "ab" * 31)
    assert main(["show-identity"]) == 2
    assert "must be 64 hex digits (32 bytes), got 62" in capsys.readouterr().err
    monkeypatch.setenv("RAW_IDENTITY_SECRET_KEY", "zz")
    assert main(["show-identity"]) == 2


def test_upstream_defaults_and_environment_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUN_ID", '"my-run"')
    monkeypatch.setenv("SERVER_ADDR", "127.0.0.1:20000")
    monkeypatch.setenv("MICRO_BATCH_SIZE", "4")
    monkeypatch.setenv("DELETE_OLD_STEPS", "false")
    args = parse(["train", "--grad-accum-in-fp32"])
    assert args.run_id == "my-run"  # quotes trimmed, as upstream
    assert args.server_addr == "127.0.0.1:20000"
    assert args.micro_batch_size == 4
    assert args.grad_accum_in_fp32 is True
    assert args.delete_old_steps is False
    # console by default (upstream: tui; a dashboard is opt-in here, docs/client.md)
    assert (args.logs, args.device, args.keep_steps) == ("console", "auto", 3)
    assert (args.max_concurrent_parameter_requests, args.max_concurrent_downloads) == (8, 4)
    assert (args.hub_max_concurrent_downloads, args.eval_seed, args.data_parallelism) == (3, 42, 1)
    assert args.prompt_task is False
    assert args.oltp_report_interval == 60.0
    assert TrainOptions.from_args(args).problems() == []
    # the command line wins over the environment
    assert parse(["train", "--micro-batch-size", "2"]).micro_batch_size == 2


def test_required_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["train", "--server-addr", "x:1"])
    assert "--run-id (or RUN_ID)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--wandb-project", "p"], "WANDB_API_KEY"),
        (["--eval-tasks", "hellaswag,nope"], "unknown evaluation task 'nope'"),
        (["--eval-task-max-docs", "3"], "need --eval-tasks"),
        (["--data-parallelism", "2", "--device", "cuda:0"], "names 1 device(s) for --data-"),
        (["--tensor-parallelism", "2", "--fsdp"], "--fsdp shards over the data-parallel"),
        (["--param-dtype", "bf16"], "apply to --fsdp only"),
        (["--num-local-ranks", "1"], "--num-local-ranks needs --main-host"),
        (["--main-host", "10.0.0.1", "--num-local-ranks", "3"], "exceeds --data-parallelism 1"),
        (
            [
                "--main-host",
                "10.0.0.1",
                "--data-parallelism",
                "4",
                "--num-local-ranks",
                "2",
                "--device",
                "cuda:0,1,2,3",
            ],
            "names 4 device(s) for --num-local-ranks 2",
        ),
        (["--gcs-bucket", "b"], "--checkpoint-dir"),
        (["--oltp-metrics-url", "x:4318"], "--oltp-metrics-url must be an http"),
        (["--oltp-auth-header", "Bearer t"], "without any --oltp-*-url"),
        (["--dummy-training-delay-secs", "2"], "dummy model"),
        (["--iroh-relay", "n0"], "relays"),
        (["--device", "mps"], "--device mps"),
        (["--device", "cuda:0,1"], "names 2 device(s) for --data-parallelism 1"),
        (["--tensor-parallelism", "2", "--device", "cuda:1,1"], "listed twice"),
        (["--hub-repo", "me/model"], "--checkpoint-dir"),
    ],
)
def test_features_not_built_are_refused(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--run-id", "r", "--server-addr", "127.0.0.1:1", *flags]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--tensor-parallelism", "2", "--eval-tasks", "hellaswag"],
        ["--data-parallelism", "2", "--fsdp", "--prompt-task"],
    ],
)
def test_evaluations_with_a_sharded_rank_0_keep_a_whole_replica(flags: list[str]) -> None:
    """TP or FSDP with evaluations: accepted, and rank 0 keeps a gathered whole replica to
    evaluate on (tests/client/test_eval_replica.py runs it); without evaluations, none."""
    base = ["train", "--run-id", "r", "--server-addr", "127.0.0.1:1"]
    options = TrainOptions.from_args(parse([*base, *flags]))
    assert options.problems() == []
    assert options.ranks.keeps_replica
    sharded_only = [f for f in flags if f not in ("--eval-tasks", "hellaswag", "--prompt-task")]
    assert not TrainOptions.from_args(parse([*base, *sharded_only])).ranks.keeps_replica


def test_the_fused_loss_option_reaches_the_ranks_layout() -> None:
    """`--fused-loss`: a memory option every rank applies (shared with other hosts' ranks), so
    even one rank builds its trainer through the group's path; off by default."""
    from psyche.client.setup.ranks import FUSED_LOSS_CHOICES, SHARED_FIELDS
    from psyche.modeling import fused_loss

    base = ["train", "--run-id", "r", "--server-addr", "127.0.0.1:1"]
    assert FUSED_LOSS_CHOICES == fused_loss.FUSED_LOSS_CHOICES
    assert "fused_loss" in SHARED_FIELDS
    default = TrainOptions.from_args(parse(base)).ranks
    assert (default.fused_loss, default.needed) == ("off", False)
    options = TrainOptions.from_args(parse([*base, "--fused-loss", "auto"]))
    assert options.problems() == []
    assert (options.ranks.fused_loss, options.ranks.needed) == ("auto", True)
    with pytest.raises(SystemExit):
        parse([*base, "--fused-loss", "fast"])


def test_a_one_rank_client_with_a_fused_loss_trains_a_model_that_uses_it(tmp_path: Path) -> None:
    import json
    import sys
    from types import SimpleNamespace

    import torch

    from psyche.client.setup.model_loading import load_from_directory
    from psyche.client.setup.ranks import RankLayout
    from psyche.client.setup.trainer_settings import TrainerSettings
    from psyche.client.setup.workers import WorkerGroup
    from psyche.core.definitions import ConstantLR, LearningRateSchedule
    from psyche.modeling.configs import llama_config_dict

    sys.path.insert(0, str(Path(__file__).parents[1] / "modeling"))
    from tiny_trainer import distro

    (tmp_path / "config.json").write_text(json.dumps(llama_config_dict("tiny")))
    group = WorkerGroup(RankLayout(device="cpu", fused_loss="auto"))
    group.start()
    llm = SimpleNamespace(
        architecture="HfLlama",
        lr_schedule=LearningRateSchedule.Constant(ConstantLR(1e-3, 0.0, 0)),
        optimizer=distro(),
    )
    settings = TrainerSettings(micro_batch_size=2)
    loaded = load_from_directory(tmp_path, "HfLlama", torch.device("cpu"))
    try:
        trainer = group.build_trainer(loaded, llm, settings)
    finally:
        group.close(timeout=10)
    assert group.processes == []
    assert trainer.model.fused_loss == "auto"


def test_refusal_also_applies_to_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WANDB_PROJECT", "p")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert main(["train", "--run-id", "r", "--server-addr", "127.0.0.1:1"]) == 2
    assert "WANDB_API_KEY" in capsys.readouterr().err


def test_hub_upload_needs_a_token_and_kept_steps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    base = ["train", "--run-id", "r", "--server-addr", "h:1", "--checkpoint-dir", str(tmp_path)]
    problems = TrainOptions.from_args(parse([*base, "--hub-repo", "me/m"])).problems()
    assert problems == ["hub-repo and checkpoint-dir set, but no HF_TOKEN env variable."]
    monkeypatch.setenv("HF_TOKEN", "t")
    assert TrainOptions.from_args(parse([*base, "--hub-repo", "me/m"])).problems() == []
    problems = TrainOptions.from_args(
        parse([*base, "--hub-repo", "me/m", "--keep-steps", "0"])
    ).problems()
    assert problems == ["keep_steps must be >= 1 for checkpoint uploads (got 0)"]


def test_help_is_fast_and_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "from psyche.cli.client.main import build_parser\n"
        "parser, _ = build_parser()\n"
        "parser.format_help()\n"
        "heavy = [m for m in ('torch', 'transformers', 'libp2p', 'numpy') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    help_text = subprocess.run(
        [sys.executable, "-m", "psyche.cli.client", "train", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    help_text = " ".join(help_text.split())
    for flag in ("--run-id", "--server-addr", "--checkpoint-dir", "[env: MICRO_BATCH_SIZE]"):
        assert flag in help_text


def test_every_train_option_is_declared_once_with_its_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A `TrainOptions` field is the whole declaration of a flag: its docstring is the help
    both client commands show, its default the `[default: ...]`, its name the flag and the
    environment variable."""
    docs = field_docs()
    assert set(docs) == {f.name for f in fields(TrainOptions)}
    assert all(docs.values())
    parser, _ = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for f in fields(TrainOptions):
        flag = "--" + f.name.replace("_", "-")
        assert flag in help_text
        assert f"[env: {f.name.upper()}]" in help_text
        assert docs[f.name] in help_text
    assert "[env: KEEP_STEPS] [default: 3]" in help_text
    assert "[env: DELETE_OLD_STEPS] [default: true]" in help_text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--start-rank", "2"], "runs ranks up to 2, beyond --world-size 2"),
        (["--start-rank", "1", "--num-local-ranks", "2"], "runs ranks up to 2, beyond"),
        (["--start-rank", "0"], "--start-rank must be at least 1 (rank 0 is the client itself)"),
    ],
)
def test_sidecar_options_say_what_is_wrong_in_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`psyche-client sidecar` (upstream's psyche-sidecar flags): a rank range that does not
    fit the world is refused before anything connects; train's required options are not."""
    argv = ["sidecar", "--main-host", "127.0.0.1", "--world-size", "2", *flags]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
