"""File names made from strings this machine does not choose (a run id from the coordinator's
state, a bucket or prefix it names, a hub repo's file list): such a string never decides where a
file goes, only what it is called inside a directory the user chose."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
MAX_COMPONENT_LEN = 100


def path_component(text: str, fallback: str = "_") -> str:
    """One file name made from `text`: every character but letters, digits, `.`, `_` and `-`
    becomes `_`, and so does a leading `.` (no hidden names, no `.` or `..`); cut to 100
    characters; `fallback` when nothing is left. Never holds a separator. Different texts can
    give the same name: what a file holds (a manifest) must say whose it is."""
    name = _UNSAFE.sub("_", text)[:MAX_COMPONENT_LEN]
    if name.startswith("."):
        name = "_" + name[1:]
    return name or fallback


def relative_path(text: str) -> PurePosixPath:
    """`text` as a relative path of such components (split on `/`; empty parts and `.` are
    dropped): joined to a directory, it stays inside it."""
    return PurePosixPath(*(path_component(p) for p in text.split("/") if p not in ("", ".")))


__all__ = ["MAX_COMPONENT_LEN", "path_component", "relative_path"]
