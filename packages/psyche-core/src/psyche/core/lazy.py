"""A package's main names at its top, each module loaded on first use (PEP 562).

A package whose modules are costly to import (torch, libp2p) can still offer its main names
(`from psyche.modeling import Trainer`) without paying for them on `import psyche.modeling`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose name `n` is `exports[n]`'s (a module
    name, relative to the package when it starts with a dot). A loaded name is kept in the
    package, so the next lookup is a plain attribute access.

        __getattr__, __dir__ = lazy_exports(__name__, {"Trainer": ".trainer"})
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
