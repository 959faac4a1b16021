"""A GCS emulator (`gcp-storage-emulator`, in memory) in its own process on a loopback port, for
the tests of GCS checkpoints: `google-cloud-storage` reaches it through STORAGE_EMULATOR_HOST."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def gcs_emulator(monkeypatch: pytest.MonkeyPatch, bucket: str) -> Iterator[str]:
    """Serve an emulator with `bucket` created; yields its URL (set as STORAGE_EMULATOR_HOST)."""
    pytest.importorskip("gcp_storage_emulator", reason="the dev group's gcp-storage-emulator")
    port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gcp_storage_emulator",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--in-memory",
            "-q",
            "--default-bucket",
            bucket,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    err = process.stderr.read().decode() if process.stderr else ""
                    raise RuntimeError(f"the GCS emulator did not start: {err[-2000:]}") from None
                time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
        monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
