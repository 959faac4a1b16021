"""Upstream's reference files for the tests that compare against them (`PSYCHE_UPSTREAM_DATA`).

The rule: a test that reads them skips only when the variable is unset. Once it is set (as
`.ci/run` sets it), a missing directory or file, or a pattern that matches nothing, fails the
test with a line that names what is missing: a half-present data set must never turn into a
quiet skip or a loop over nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

VARIABLE = "PSYCHE_UPSTREAM_DATA"


@dataclass(frozen=True)
class UpstreamData:
    root: Path

    @classmethod
    def from_environment(cls) -> UpstreamData:
        location = os.environ.get(VARIABLE)
        if not location:
            pytest.skip(f"{VARIABLE} is not set (upstream reference data not available)")
        root = Path(location)
        if not root.is_dir():
            pytest.fail(f"{VARIABLE}={location} is set but is not a directory", pytrace=False)
        return cls(root)

    def path(self, *parts: str) -> Path:
        """`root/parts...`, which must exist (`..` reaches files kept beside the data)."""
        path = self.root.joinpath(*parts)
        if not path.exists():
            pytest.fail(f"{VARIABLE} is set ({self.root}) but {path} is missing", pytrace=False)
        return path

    def glob(self, directory: str, pattern: str) -> list[Path]:
        """The sorted matches of `pattern` under `root/directory`: at least one."""
        found = sorted(self.path(directory).glob(pattern))
        if not found:
            pytest.fail(
                f"{VARIABLE} is set ({self.root}) but nothing matches {directory}/{pattern}",
                pytrace=False,
            )
        return found
