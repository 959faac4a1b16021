"""A run's files on the run-down service (upstream run-manager `download_results.rs`,
`upload_data.rs`): download its results, upload data to it, every request signed by the
wallet. Each command is its options and a `run_*` function that prints what it did and returns
the exit status."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psyche.core.cli import UserError
from psyche.solana.commands.args import (
    RunCommand,
    arg,
    env_arg,
)
from psyche.solana.commands.shell import run_signed


def expires_in_seconds_arg() -> Any:
    return env_arg(
        "EXPIRES_IN_SECONDS", type=int, default=3600, help="how long the signed URLs stay valid"
    )


def run_down_service_url_arg() -> Any:
    return env_arg(
        "RUN_DOWN_SERVICE_URL",
        default=None,
        help="the run-down service's API, default upstream's (a port addition: upstream's is "
        "fixed)",
    )


def _service_url(url: str | None) -> str:
    from psyche.solana import run_down

    return url or run_down.RUN_DOWN_SERVICE_BASE_URL


@dataclass(frozen=True, kw_only=True)
class DownloadResultsOptions(RunCommand):
    output_dir: Path = env_arg("OUTPUT_DIR", "-o", "--output-dir", type=Path, default=Path("."))
    expires_in_seconds: int = expires_in_seconds_arg()
    run_down_service_url: str | None = run_down_service_url_arg()
    overwrite: bool = arg(
        action="store_true",
        default=False,
        help="do not ask before writing into a non-empty --output-dir",
    )


def run_download_results(options: DownloadResultsOptions) -> int:
    """Download the run's result files into `output_dir`, asking on stdin first when it holds
    files (unless `overwrite`)."""
    import sys

    import trio

    from psyche.solana import run_down

    output_dir = options.output_dir
    try:
        occupied = output_dir.is_dir() and any(output_dir.iterdir())
    except OSError as e:
        raise UserError(f"Failed to read output directory {output_dir}: {e.strerror or e}") from e
    if occupied and not options.overwrite:
        print(f'Warning: Output directory "{output_dir}" already exists and contains files.')
        print("Files may be overwritten during download.")
        print("Continue? [y/N]: ", end="", flush=True)
        answer = sys.stdin.readline() if sys.stdin is not None else ""
        if answer.strip().lower() != "y":
            print("Download cancelled.")
            return 0

    async def body(backend: Any) -> None:
        await trio.Path(output_dir).mkdir(parents=True, exist_ok=True)
        nonce = run_down.random_nonce()
        signature = run_down.generate_signature(
            backend.sign_message, options.run_id, options.expires_in_seconds, nonce
        )
        async with run_down.new_http_client() as http:
            found = await run_down.get_download_urls(
                http,
                _service_url(options.run_down_service_url),
                options.run_id,
                signature,
                options.expires_in_seconds,
                nonce,
            )
            count = len(found.urls)
            print(f"Found {count} files to download")
            for index, entry in enumerate(found.urls, start=1):
                print(f"Downloading file {index}/{count}: {entry.path}")
                path = run_down.output_path(output_dir, entry.path)
                await run_down.download_to(http, entry.url, path)
                print(f'  Saved to: "{path}"')
        print(f'Successfully downloaded {count} files to "{output_dir}"')

    return run_signed(options, body)


@dataclass(frozen=True, kw_only=True)
class UploadDataOptions(RunCommand):
    path: Path = arg(
        "-p", "--path", type=Path, required=True, help="a single file or a directory to upload"
    )
    expires_in_seconds: int = expires_in_seconds_arg()
    run_down_service_url: str | None = run_down_service_url_arg()


def run_upload_data(options: UploadDataOptions) -> int:
    """Upload `path` (a file, or a directory's files) to the run, one signed URL per file."""
    from psyche.solana import run_down

    async def body(backend: Any) -> None:
        base_dir, files = run_down.files_to_upload(options.path)
        if not files:
            print("No files found to upload")
            return
        print(f"Found {len(files)} file(s) to upload")
        async with run_down.new_http_client() as http:
            for index, path in enumerate(files, start=1):
                relative = path.relative_to(base_dir).as_posix()
                print(f"\n[{index}/{len(files)}] Uploading: {relative}")
                nonce = run_down.random_nonce()
                signature = run_down.generate_signature(
                    backend.sign_message, options.run_id, options.expires_in_seconds, nonce
                )
                target = await run_down.get_upload_url(
                    http,
                    _service_url(options.run_down_service_url),
                    options.run_id,
                    signature,
                    relative,
                    options.expires_in_seconds,
                    nonce,
                )
                size = path.stat().st_size
                print(f"  Uploading {size} bytes...")
                await run_down.upload_from(http, target.url, path, size)
                print("  ✓ Upload successful")
        print(f"\n✓ Successfully uploaded {len(files)} file(s)")

    return run_signed(options, body)


__all__ = [
    "DownloadResultsOptions",
    "UploadDataOptions",
    "run_download_results",
    "run_upload_data",
]
