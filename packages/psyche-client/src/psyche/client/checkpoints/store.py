"""Checkpoints of the model an epoch ended with (upstream `state/cooldown.rs`, its checkpoint
half): written in Hugging Face layout to `{dir}/{run_id}-step{step}`, uploaded to the hub
(`--hub-repo`) or a GCS bucket (`--gcs-bucket`) in the background (`upload`; the coordinator is
then told the new checkpoint), old steps removed by the keep policy (`keep_policy`).

A checkpoint belongs to one instance of a run (`RunInstance`): its run id and the coordinator's
identity of that instance, both in its manifest. The same run config started twice is two
instances; a server resumed from its saved state is the same one. Only the instance's own
checkpoints are resumed, counted by the keep policy or deleted; another instance's are left as
they are, and when one holds the plain directory name a checkpoint of this instance is written
as `{run_id}-{tag}-step{step}` instead (`RunInstance.tag`). The run id is made a safe file name
(`psyche.core.safe_path`): the coordinator's state never chooses where a checkpoint goes.

A checkpoint is complete when its manifest (`psyche-manifest.json`: run, instance, step, epoch,
kind, and every file's size and SHA-256) is there and every file matches it. It is written into a staging
directory `.{run_id}-step{step}.pid{pid}.{random}.tmp` next to it: the files, each fsynced, then
the manifest, then the directory is renamed to its step's name and the parent fsynced. A client
killed meanwhile leaves its staging directory behind; `remove_stale_staging` (called when a client
starts) removes those whose writer is no longer running (on this machine). `latest_complete`
never chooses a directory whose manifest is missing or does not match its files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psyche.client.checkpoints.keep_policy import KeepPolicy, Kind
from psyche.client.checkpoints.upload import UploadTarget
from psyche.core.atomic_file import fsync_directory
from psyche.core.safe_path import path_component

if TYPE_CHECKING:
    import torch


logger = logging.getLogger(__name__)

MANIFEST_NAME = "psyche-manifest.json"
MANIFEST_VERSION = 2
"""2 adds `run_identity`; a version 1 manifest (written before) belongs to no instance known
now: its checkpoint is never resumed or deleted."""
_READABLE_VERSIONS = (1, 2)


@dataclass(frozen=True)
class RunInstance:
    """One instance of a run: its id (`--run-id`, which every coordinator state must carry) and
    the coordinator's identity of the instance (`psyche.coordinator.backend.RunIdentity`; a
    token of this client process when the backend names none, so that nothing written by
    another process is taken for this instance's)."""

    run_id: str
    identity: str

    @property
    def tag(self) -> str:
        """8 hex digits of the identity's hash: the directory name's mark when the plain name
        is another instance's."""
        return hashlib.sha256(self.identity.encode("utf-8")).hexdigest()[:8]

    def owns(self, manifest: Manifest) -> bool:
        return (
            bool(self.identity)
            and manifest.run_id == self.run_id
            and manifest.run_identity == self.identity
        )


@dataclass(frozen=True)
class CheckpointConfig:
    checkpoint_dir: Path
    upload: UploadTarget | None = None
    keep: KeepPolicy = field(default_factory=KeepPolicy)


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    run_id: str
    step: int
    epoch: int
    kind: Kind
    written_at: float
    files: dict[str, FileEntry]
    run_identity: str = ""
    """The coordinator's identity of the run instance ("" in a version 1 manifest)."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": MANIFEST_VERSION,
                "run_id": self.run_id,
                "run_identity": self.run_identity,
                "step": self.step,
                "epoch": self.epoch,
                "kind": self.kind.value,
                "written_at": self.written_at,
                "files": {
                    name: {"size": e.size, "sha256": e.sha256}
                    for name, e in sorted(self.files.items())
                },
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Raises ValueError (or KeyError/TypeError) for anything not a manifest."""
        doc: Any = json.loads(text)
        if doc.get("version") not in _READABLE_VERSIONS:
            raise ValueError(f"unknown manifest version {doc.get('version')!r}")
        files = {
            str(name): FileEntry(int(e["size"]), str(e["sha256"]))
            for name, e in doc["files"].items()
        }
        for name in files:
            if "/" in name or name in ("", ".", "..", MANIFEST_NAME):
                raise ValueError(f"bad file name {name!r} in manifest")
        return cls(
            str(doc["run_id"]),
            int(doc["step"]),
            int(doc["epoch"]),
            Kind(doc["kind"]),
            float(doc["written_at"]),
            files,
            str(doc.get("run_identity", "")),
        )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_path(checkpoint_dir: Path, run: RunInstance, step: int) -> Path:
    """Where this instance's checkpoint of `step` goes: `{run_id}-step{step}` (the run id made
    a safe file name: whatever it is, the checkpoint lands in `checkpoint_dir`), unless that
    directory holds anything but this instance's checkpoint (another instance's, one from
    before instances were recorded, something unreadable): then `{run_id}-{tag}-step{step}`."""
    name = path_component(run.run_id, "run")
    plain = checkpoint_dir / f"{name}-step{step}"
    if not os.path.lexists(plain):
        return plain
    manifest = read_manifest(plain) if plain.is_dir() and not plain.is_symlink() else None
    if manifest is not None and run.owns(manifest) and manifest.step == step:
        return plain
    return checkpoint_dir / f"{name}-{run.tag}-step{step}"


_STEP_DIR = re.compile(r"^(?P<name>[^.].*)-step(?P<step>\d+)$")


def save_checkpoint_locally(
    path: Path,
    variables: dict[str, torch.Tensor],
    extra_files: Sequence[Path],
    model_config_json: str,
    tokenizer_json: str,
    *,
    run: RunInstance,
    step: int,
    epoch: int = 0,
    kind: Kind = Kind.recent,
) -> list[Path]:
    """The safetensors parts, the source checkpoint's config/tokenizer files, a config.json
    (and tokenizer.json) written from what the client knows when the source had none, and the
    manifest (`run`'s id and identity, `step`, `epoch`, `kind`). `path` is replaced when it
    exists: the caller chose it (`checkpoint_path`).

    Everything is written into a temporary sibling directory that is renamed to `path` once
    complete, so a failed save (a full disk) leaves no half checkpoint under a step's name.
    Returns the files written, the manifest last.
    """
    from psyche.modeling.checkpoint import save_tensors_into_safetensors

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(
        tempfile.mkdtemp(prefix=f".{path.name}.pid{os.getpid()}.", suffix=".tmp", dir=path.parent)
    )
    try:
        written = save_tensors_into_safetensors(variables, staging)
        names = set()
        for src in extra_files:
            if src.name == MANIFEST_NAME:
                continue
            shutil.copyfile(src, staging / src.name)
            written.append(staging / src.name)
            names.add(src.name)
        if "config.json" not in names:
            (staging / "config.json").write_text(model_config_json + "\n")
            written.append(staging / "config.json")
        if "tokenizer.json" not in names and tokenizer_json:
            (staging / "tokenizer.json").write_text(tokenizer_json)
            written.append(staging / "tokenizer.json")
        entries = {}
        for file in written:
            with open(file, "rb") as f:
                os.fsync(f.fileno())
            entries[file.name] = FileEntry(file.stat().st_size, file_sha256(file))
        manifest = Manifest(
            run.run_id, step, epoch, kind, time.time(), entries, run_identity=run.identity
        )
        manifest_path = staging / MANIFEST_NAME
        with open(manifest_path, "w") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        written.append(manifest_path)
        fsync_directory(staging)
        if path.exists():
            shutil.rmtree(path)  # the same step saved again
        os.replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_directory(path.parent)
    return [path / file.name for file in written]


def read_manifest(path: Path) -> Manifest | None:
    """The manifest of a checkpoint directory, unchecked (None when absent or unreadable)."""
    try:
        return Manifest.from_json((path / MANIFEST_NAME).read_text())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def verify_checkpoint(path: Path) -> Manifest | None:
    """The manifest when the directory is a complete checkpoint: every file it names is there
    with its size and SHA-256; None otherwise (logged at debug level)."""
    manifest = read_manifest(path)
    if manifest is None:
        logger.debug("%s: no readable manifest", path)
        return None
    for name, entry in manifest.files.items():
        file = path / name
        try:
            if file.stat().st_size != entry.size or file_sha256(file) != entry.sha256:
                logger.debug("%s: %s does not match the manifest", path, name)
                return None
        except OSError:
            logger.debug("%s: %s is missing", path, name)
            return None
    return manifest


@dataclass(frozen=True)
class FoundCheckpoint:
    path: Path
    manifest: Manifest


def find_checkpoints(checkpoint_dir: Path, run: RunInstance) -> list[FoundCheckpoint]:
    """This run instance's step directories (`*-step{N}`, not symlinks) whose readable manifest
    names its run id, its identity and step N, oldest first (files not checked:
    `verify_checkpoint` does that). Other runs' and instances' are not listed."""
    found = []
    try:
        entries = list(os.scandir(checkpoint_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        match = _STEP_DIR.match(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        manifest = read_manifest(Path(entry.path))
        if manifest is None or not run.owns(manifest) or manifest.step != int(match["step"]):
            continue
        found.append(FoundCheckpoint(Path(entry.path), manifest))
    return sorted(found, key=lambda f: f.manifest.step)


def latest_complete(
    checkpoint_dir: Path, run: RunInstance, step: int | None = None
) -> FoundCheckpoint | None:
    """The newest complete checkpoint of `run` (at exactly `step` when given): incomplete
    ones (a file missing or changed, a manifest missing or unreadable) are skipped, with a
    warning for those with a manifest, never chosen."""
    for found in reversed(find_checkpoints(checkpoint_dir, run)):
        if step is not None and found.manifest.step != step:
            continue
        manifest = verify_checkpoint(found.path)
        if manifest is not None:
            return FoundCheckpoint(found.path, manifest)
        logger.warning("%s is not a complete checkpoint (skipped)", found.path)
    return None


_STAGING = re.compile(r"^\..+-step\d+\.pid(\d+)\.[^.]+\.tmp$")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def remove_stale_staging(checkpoint_dir: Path) -> list[Path]:
    """Remove the staging directories in `checkpoint_dir` that a killed client left behind (those
    whose writing process is gone); returns them. A live writer's, this process's and anything
    not named like a staging directory are left alone; a missing directory is fine."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(checkpoint_dir))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        match = _STAGING.match(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or _running(pid):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.exists(entry.path):
            logger.info("removed %s, left by a client stopped while checkpointing", entry.path)
            removed.append(Path(entry.path))
    return removed


def check_hub_repo_writable(repo_id: str, token: str) -> None:
    """Fail early (as upstream) when the upload repo is not writable with this token."""
    from huggingface_hub import HfApi

    try:
        HfApi(token=token).auth_check(repo_id, repo_type="model", write=True)
    except TypeError:  # older huggingface_hub without `write`
        HfApi(token=token).auth_check(repo_id, repo_type="model")
    except Exception as e:
        raise RuntimeError(
            f"Checkpoint upload repo {repo_id} is not writable with the passed API key: {e}"
        ) from e


def delete_checkpoint(path: Path) -> None:
    try:
        shutil.rmtree(path)
        logger.info("Successfully removed %s", path)
    except OSError as e:
        logger.warning("Error removing %s : %s", path, e)
