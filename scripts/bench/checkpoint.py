"""Checkpoint cost: save and upload time of a cooldown checkpoint, and the client's round time while
an upload runs in the background.

Part 1, the 20M model's bf16 weights (the cooldown's `extract`), median of `--repeats` (the
baseline and the local checkpoint alternate, each into a new path, after an untimed round):

* baseline: one bare `safetensors.torch.save_file` of the weights (no staging, fsync or hashes);
* local: `save_checkpoint_locally` (staging directory, fsync of every file, the manifest's
  SHA-256 of every file, rename) as a ratio to the baseline;
* GCS: `upload_checkpoint_to_gcs` to a gcp-storage-emulator process, then the join's download;
* hub: `HubUpload.upload` (one commit through `huggingface_hub`) to the loopback hub stand-in
  (tests/client/hub_endpoint.py) in its own process, then `snapshot_download`.

Part 2, one in-process run (InProcessServer, two clients, real libp2p on loopback): client 1
checkpoints every other epoch (a temporary-checkpoint interval of 1.5 epochs) and uploads to the
hub stand-in behind a link of `--link-mbps`, so an upload overlaps the next epoch's first
rounds. The round time (from one step's `round_start` to the next) of the rounds an upload
overlaps is compared, in the same run, with the rounds at the same positions (round heights) of
the epochs no upload overlaps: ratio = median round with an upload / median of those.

Run: .venv/bin/python scripts/bench/checkpoint.py [--repeats 3] [--round-model tiny|20m]
     [--epochs 4] [--link-mbps 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HUB_ENDPOINT = REPO / "tests" / "client" / "hub_endpoint.py"


def timed(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@contextmanager
def hub_process(repo: str, bytes_per_sec: float | None = None) -> Iterator[str]:
    argv = [sys.executable, str(HUB_ENDPOINT), repo]
    if bytes_per_sec:
        argv.append(str(bytes_per_sec))
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        if not url.startswith("http://"):
            raise SystemExit("the hub stand-in did not start")
        yield url
    finally:
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@contextmanager
def gcs_process(bucket: str) -> Iterator[None]:
    from psyche.client.testing import gcs_emulator_process

    with gcs_emulator_process(bucket) as url:
        os.environ["STORAGE_EMULATOR_HOST"] = url
        os.environ.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
        yield


def use_hub(url: str, home: Path) -> None:
    from huggingface_hub import constants

    os.environ.update(HF_ENDPOINT=url, HF_HOME=str(home), HF_HUB_DISABLE_XET="1")
    os.environ.pop("HF_HUB_OFFLINE", None)
    constants.ENDPOINT = url
    constants.HUGGINGFACE_CO_URL_TEMPLATE = url + "/{repo_id}/resolve/{revision}/{filename}"
    constants.HF_HUB_CACHE = str(home / "hub")
    constants.HF_HUB_DISABLE_XET = True
    constants.HF_HUB_OFFLINE = False


def save_and_upload(args: argparse.Namespace, work: Path) -> None:
    import torch
    from huggingface_hub import snapshot_download
    from safetensors.torch import save_file

    from psyche.client.checkpoints.gcs import download_checkpoint_from_gcs, upload_checkpoint_to_gcs
    from psyche.client.checkpoints.store import RunInstance, save_checkpoint_locally
    from psyche.client.checkpoints.upload import HubUpload, UploadJob
    from psyche.client.setup.model_loading import config_json_of
    from psyche.modeling.causal_lm import CausalLM, ModelOptions
    from psyche.modeling.configs import llama_config_dict

    model = CausalLM.from_config(
        llama_config_dict("20m"), ModelOptions(architecture="HfLlama", device="cpu", seed=1337)
    )
    variables = {k: v.to(torch.bfloat16) for k, v in model.extract(None).items()}
    size = sum(t.numel() * t.element_size() for t in variables.values())
    config_json = config_json_of(model)
    n = args.repeats

    # alternated, each into a new path, after one untimed round of both
    work.mkdir(parents=True)
    bare_times, local_times = [], []
    for i in range(n + 1):
        started = time.perf_counter()
        save_file(variables, str(work / f"bare-{i}.safetensors"))
        bare_times.append(time.perf_counter() - started)
        path = work / f"run-step{i}"
        started = time.perf_counter()
        save_checkpoint_locally(
            path, variables, [], config_json, "", run=RunInstance("run", "bench"), step=i
        )
        local_times.append(time.perf_counter() - started)
    baseline = statistics.median(bare_times[1:])
    local = statistics.median(local_times[1:])
    files = sorted(p for p in path.iterdir() if p.is_file())
    with gcs_process("bench"):
        gcs_up = timed(lambda: upload_checkpoint_to_gcs("bench", "ckpt", files, "run", 0, 9), n)

        def gcs_download() -> None:
            shutil.rmtree(work / "hf-home" / "psyche", ignore_errors=True)
            os.environ["HF_HOME"] = str(work / "hf-home")
            download_checkpoint_from_gcs("bench", "ckpt")

        gcs_down = timed(gcs_download, n)
    with hub_process("org/bench") as url:
        use_hub(url, work / "hf-home")
        target = HubUpload("org/bench", "token")
        revisions: list[str] = []

        def hub_upload() -> None:
            checkpoint = target.upload(UploadJob("run", 0, 9, path))
            revisions.append(str(checkpoint.value.revision))  # type: ignore[attr-defined]

        hub_up = timed(hub_upload, n)

        def hub_download() -> None:
            shutil.rmtree(work / "hf-home" / "hub", ignore_errors=True)
            snapshot_download("org/bench", revision=revisions[-1], token="token")

        hub_down = timed(hub_download, n)
    print(f"20M model: {len(variables)} tensors, {size / 1e6:.1f} MB in bf16, median of {n}")
    print(f"{'':>36}{'seconds':>10}{'x baseline':>12}")
    rows = [
        ("baseline: bare safetensors write", baseline),
        ("local checkpoint (fsync, manifest)", local),
        ("upload to the GCS emulator", gcs_up),
        ("download from the GCS emulator", gcs_down),
        ("upload to the hub stand-in (1 commit)", hub_up),
        ("download from the hub stand-in", hub_down),
    ]
    for name, secs in rows:
        print(f"{name:>36}{secs:>10.3f}{secs / baseline:>12.2f}")


# ---- part 2: rounds with and without an upload behind them ------------------------------------


class Events(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[float, str, dict[str, Any]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "psyche_fields", None)
        if fields is not None:
            self.records.append((record.created, record.getMessage(), fields))


def rounds_with_uploads(args: argparse.Namespace, work: Path) -> None:
    import torch
    import trio

    from psyche.client.checkpoints.keep_policy import KeepPolicy
    from psyche.client.checkpoints.store import CheckpointConfig
    from psyche.client.checkpoints.upload import HubUpload
    from psyche.client.client import Client
    from psyche.client.round.broadcast import open_network
    from psyche.client.setup.init import RunInitConfig
    from psyche.client.setup.model_loading import preload_modeling
    from psyche.client.testing import InProcessServer, local_run_state
    from psyche.core.identity import SecretKey
    from psyche.core.node_identity import NodeIdentity
    from psyche.modeling.configs import llama_config_dict
    from psyche.network.connection import NetworkConfig

    torch.set_num_threads(1)
    seq = args.seq_len
    model_dir = work / "model"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps(llama_config_dict(args.round_model)))
    data_dir = work / "data"
    data_dir.mkdir()
    import numpy as np

    rng = np.random.default_rng(0)
    vocab = 256 if args.round_model == "tiny" else 32000
    tokens = rng.integers(0, vocab, size=seq * 4000).astype("<u2")
    (data_dir / "tokens.ds").write_bytes(tokens.tobytes())
    state = local_run_state(
        model_dir,
        data_dir,
        run_id="bench",
        seq_len=seq,
        lr=1e-3,
        warmup_time=3,
        max_round_train_time=20,
        epoch_time=args.epoch_time,
        total_steps=100_000,
    )
    events = Events()
    psyche_logger = logging.getLogger("psyche")
    psyche_logger.addHandler(events)
    psyche_logger.setLevel(logging.INFO)
    psyche_logger.propagate = False  # the events only, not on the console
    preload_modeling()
    server = InProcessServer(state)

    async def client(number: int, checkpoint: CheckpointConfig | None) -> None:
        key = SecretKey.from_bytes(number.to_bytes(32, "big"))
        identity = NodeIdentity.from_single_key(key.public_key)
        network = NetworkConfig(run_id="bench", secret_key=key, bind_host="127.0.0.1")
        init = RunInitConfig(identity, key, "bench", device="cpu", checkpoint=checkpoint)
        async with open_network(network) as net, server.connect(identity, "bench") as backend:
            await Client(backend, net, init).run()

    def uploads_done() -> int:
        return sum(1 for _, name, _ in events.records if name == "checkpoint_uploaded")

    bytes_per_sec = args.link_mbps * 1e6 / 8
    with hub_process("org/bench", bytes_per_sec) as url:
        use_hub(url, work / "hf-home")
        keep = KeepPolicy(temporary_interval_secs=1.5 * (args.epoch_time + 4))
        checkpoint = CheckpointConfig(work / "ckpt", HubUpload("org/bench", "token"), keep)

        async def scenario() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server.run)
                nursery.start_soon(client, 1, checkpoint)
                nursery.start_soon(client, 2, None)
                with trio.fail_after(args.timeout):
                    while uploads_done() < args.epochs:
                        await trio.sleep(0.2)
                nursery.cancel_scope.cancel()

        trio.run(scenario)
    psyche_logger.removeHandler(events)
    psyche_logger.propagate = True

    starts: dict[int, tuple[float, int, int]] = {}  # step: (time, epoch, round height)
    for created, name, fields in events.records:
        if name == "round_start":
            starts.setdefault(fields["step"], (created, fields["epoch"], fields["round"]))
    saved = [(c, f["step"]) for c, n, f in events.records if n == "checkpoint_saved"]
    uploaded = {f["step"]: c for c, n, f in events.records if n == "checkpoint_uploaded"}
    windows = [(c, uploaded[step]) for c, step in saved if step in uploaded]
    rounds = []  # (epoch, height, seconds, overlaps an upload)
    for step in sorted(starts):
        if step + 1 not in starts:
            continue
        (begin, epoch, height), (end, next_epoch, _) = starts[step], starts[step + 1]
        if next_epoch != epoch:  # an epoch boundary, not a round
            continue
        overlaps = any(b < end and e > begin for b, e in windows)
        rounds.append((epoch, height, end - begin, overlaps))
    busy_epochs = {r[0] for r in rounds if r[3]}
    with_upload = [r for r in rounds if r[3]]
    heights = {r[1] for r in with_upload}
    control = [r for r in rounds if r[0] not in busy_epochs and r[1] in heights]
    upload_secs = [e - b for b, e in windows]
    print(
        f"\nround time, {args.round_model} model, 2 clients in one process, batch 4 x {seq}, "
        f"uploads behind a {args.link_mbps:g} Mbit/s link: {len(windows)} uploads "
        f"(median {statistics.median(upload_secs):.1f} s from save to commit)"
    )
    if not with_upload or not control:
        raise SystemExit(f"need rounds with an upload and matching ones without: {rounds}")
    a = statistics.median(r[2] for r in with_upload)
    b = statistics.median(r[2] for r in control)
    print(f"  rounds an upload overlaps:                  {len(with_upload):>3}, median {a:.3f} s")
    print(f"  same round heights, epochs without uploads: {len(control):>3}, median {b:.3f} s")
    print(f"  ratio (with / without): {a / b:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--round-model", choices=("tiny", "20m"), default="tiny")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=4, help="uploads to wait for in part 2")
    parser.add_argument("--epoch-time", type=int, default=12)
    parser.add_argument("--link-mbps", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--skip-save", action="store_true", help="part 2 only")
    parser.add_argument("--skip-rounds", action="store_true", help="part 1 only")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="psyche-checkpoint-bench-"))
    try:
        if not args.skip_save:
            save_and_upload(args, work / "save")
        if not args.skip_rounds:
            rounds_with_uploads(args, work / "rounds")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
