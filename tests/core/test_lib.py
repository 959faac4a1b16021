"""Package-level checks: upstream's type assumption and the promise that importing is light."""

from __future__ import annotations

import struct
import subprocess
import sys

import psyche.core


def test_check_type_assumptions() -> None:
    # upstream: usize is 64-bit
    assert struct.calcsize("P") == struct.calcsize("Q") == 8


def test_import_loads_neither_torch_nor_numpy() -> None:
    code = "import sys, psyche.core; print(sorted({'torch', 'numpy', 'trio'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_api_is_exported() -> None:
    for name in psyche.core.__all__:
        assert getattr(psyche.core, name) is not None
