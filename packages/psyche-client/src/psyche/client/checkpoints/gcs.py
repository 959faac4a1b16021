"""GCS checkpoints (upstream `data-provider/src/gcs.rs`), with `google-cloud-storage` (the
`gcs` extra of psyche-client).

Upload: the checkpoint's `.safetensors` files, then its `.json`/`.py` files (config, tokenizer),
then upstream's `manifest.json` (metadata and each safetensors file's generation and size) last,
so a reader that follows the manifest never sees a half-uploaded step. Download: with a manifest,
its files into `$HF_HOME/psyche/gcs/{bucket}/{prefix}/step-{step}-{generation}` (a complete copy
there is reused; bucket, prefix and file names come from the coordinator's state and the bucket,
so each is made a safe relative path first: `psyche.core.safe_path`), then the `.json`/`.py` files by listing; without one (an old checkpoint), every
model file by listing into `.../no_manifest`. Each file is written to a temporary name and
renamed, and its size checked against the manifest, so an interrupted download is fetched again.

The client is authenticated when `GOOGLE_APPLICATION_CREDENTIALS` is set and anonymous otherwise,
as upstream; `STORAGE_EMULATOR_HOST` points it at an emulator.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from psyche.core.safe_path import path_component, relative_path

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MODEL_EXTENSIONS = (".safetensors", ".json", ".py")
CONFIG_EXTENSIONS = (".json", ".py")


class GcsError(RuntimeError):
    pass


def storage_client() -> Any:
    """A `google.cloud.storage.Client` (GcsError when the library is missing)."""
    try:
        from google.cloud import storage
    except ImportError as e:
        raise GcsError(
            "GCS checkpoints need google-cloud-storage: pip install 'psyche-client[gcs]'"
        ) from e
    if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return storage.Client()
    return storage.Client.create_anonymous_client()


def _object(prefix: str | None, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


@dataclass(frozen=True)
class GcsUploaded:
    files: list[str]
    manifest_generation: int


def upload_checkpoint_to_gcs(
    bucket: str, prefix: str | None, files: list[Path], run_id: str, epoch: int, step: int
) -> GcsUploaded:
    """Upload a checkpoint's files and then its manifest (see the module docstring)."""
    client = storage_client()
    target = client.bucket(bucket)
    entries = []
    uploaded = []
    ordered = sorted(files, key=lambda p: (not p.name.endswith(".safetensors"), p.name))
    for path in ordered:
        if not path.name.endswith(MODEL_EXTENSIONS) or path.name == MANIFEST:
            continue
        blob = target.blob(_object(prefix, path.name))
        blob.upload_from_filename(str(path))
        uploaded.append(blob.name)
        logger.info("Uploaded gs://%s/%s (%d bytes)", bucket, blob.name, blob.size or 0)
        if path.name.endswith(".safetensors"):
            entries.append(
                {"filename": path.name, "generation": int(blob.generation), "size_bytes": blob.size}
            )
    manifest = {
        "metadata": {
            "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            "epoch": epoch,
            "step": step,
            "run_id": run_id,
        },
        "files": entries,
    }
    blob = target.blob(_object(prefix, MANIFEST))
    blob.upload_from_string(json.dumps(manifest, indent=2), content_type="application/json")
    logger.info("Upload to GCS complete at gs://%s/%s", bucket, prefix or "")
    return GcsUploaded(uploaded, int(blob.generation))


def cache_base(bucket: str) -> Path:
    home = os.environ.get("HF_HOME")
    base = Path(home) if home else Path(os.environ.get("HOME", ".")) / ".cache"
    return base / "psyche" / "gcs" / path_component(bucket, "bucket")


def _cache_dir(bucket: str, prefix: str | None, leaf: str) -> Path:
    base = cache_base(bucket)
    return (base / relative_path(prefix) if prefix else base) / leaf


def _download(blob: Any, path: Path, size: int | None = None) -> None:
    tmp = path.with_name(f".{path.name}.part")
    blob.download_to_filename(str(tmp))
    got = tmp.stat().st_size
    if size is not None and got != size:
        tmp.unlink()
        raise GcsError(
            f"gs://{blob.bucket.name}/{blob.name}: {got} bytes, the manifest says {size}"
        )
    os.replace(tmp, path)


def _list(client: Any, bucket: str, prefix: str | None, extensions: tuple[str, ...]) -> list[Any]:
    listed = client.list_blobs(bucket, prefix=f"{prefix.rstrip('/')}/" if prefix else None)
    return [
        b for b in listed if b.name.endswith(extensions) and "/" not in _relative(b.name, prefix)
    ]


def _relative(name: str, prefix: str | None) -> str:
    return name[len(prefix.rstrip("/")) + 1 :] if prefix else name


def download_checkpoint_from_gcs(bucket: str, prefix: str | None) -> Path:
    """The directory holding the bucket's newest checkpoint (see the module docstring)."""
    client = storage_client()
    source = client.bucket(bucket)
    manifest_blob = source.get_blob(_object(prefix, MANIFEST))
    if manifest_blob is None:
        logger.info(
            "No manifest found in gs://%s/%s, downloading every model file", bucket, prefix or ""
        )
        directory = _cache_dir(bucket, prefix, "no_manifest")
        directory.mkdir(parents=True, exist_ok=True)
        blobs = _list(client, bucket, prefix, MODEL_EXTENSIONS)
        if not any(b.name.endswith(".safetensors") for b in blobs):
            raise GcsError(f"gs://{bucket}/{prefix or ''} holds no manifest and no safetensors")
        for blob in blobs:
            _download(blob, directory / path_component(_relative(blob.name, prefix)))
        return directory
    try:
        manifest = json.loads(manifest_blob.download_as_bytes())
        step = int(manifest["metadata"]["step"])
        files = [
            (str(f["filename"]), int(f["generation"]), int(f["size_bytes"]))
            for f in manifest["files"]
        ]
    except (ValueError, KeyError, TypeError) as e:
        raise GcsError(
            f"gs://{bucket}/{manifest_blob.name} is not a checkpoint manifest: {e}"
        ) from e
    logger.info(
        "Found manifest: step %d, epoch %s, generation %d",
        step,
        manifest["metadata"].get("epoch"),
        manifest_blob.generation,
    )
    directory = _cache_dir(bucket, prefix, f"step-{step}-{manifest_blob.generation}")
    directory.mkdir(parents=True, exist_ok=True)
    for name, generation, size in files:
        if "/" in name or name in ("", ".", ".."):
            raise GcsError(f"bad file name {name!r} in gs://{bucket}/{manifest_blob.name}")
        local = directory / name
        if local.is_file() and local.stat().st_size == size:
            logger.info("Using cached: %s", name)
            continue
        logger.info(
            "Downloading: gs://%s/%s (generation %d)", bucket, _object(prefix, name), generation
        )
        _download(source.blob(_object(prefix, name), generation=generation), local, size)
    for blob in _list(client, bucket, prefix, CONFIG_EXTENSIONS):
        name = path_component(_relative(blob.name, prefix))
        if name == MANIFEST or (directory / name).is_file():
            continue
        _download(blob, directory / name)
    return directory
