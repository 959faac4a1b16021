"""A GCS emulator for the tests of GCS checkpoints (`psyche.client.testing.gcs_emulator_process`),
with `google-cloud-storage` pointed at it through STORAGE_EMULATOR_HOST for the test's duration."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from psyche.client.testing import gcs_emulator_process


@contextmanager
def gcs_emulator(monkeypatch: pytest.MonkeyPatch, bucket: str) -> Iterator[str]:
    """Serve an emulator with `bucket` created; yields its URL (set as STORAGE_EMULATOR_HOST)."""
    pytest.importorskip("gcp_storage_emulator", reason="the dev group's gcp-storage-emulator")
    with gcs_emulator_process(bucket) as url:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
        monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
        yield url
