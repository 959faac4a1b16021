"""Which packages pull torch: the transport, the metrics, the network, the data provider and the
centralized server never do.

`pip install packages/psyche-data-provider` (or any package below) must not install torch or
transformers. Two checks per package:

* what it declares, followed through the workspace's pyproject files and then through the
  installed distributions' metadata (markers evaluated, extras followed), never reaches them;
* importing every one of its modules (but those that drive an opt-in extra's library) in a fresh
  interpreter leaves them out of `sys.modules`.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from collections import deque
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"torch", "transformers"}
LIGHT_PACKAGES = {
    "psyche-transport": "psyche.transport",
    "psyche-metrics": "psyche.metrics",
    "psyche-network": "psyche.network",
    "psyche-data-provider": "psyche.data_provider",
    "psyche-centralized": "psyche.centralized",
}
# Modules that exist to drive an opt-in extra's library, left out of the import check: with
# torch installed, tensorboardX (psyche-metrics[tensorboard]) imports it. The extra is not a
# declared dependency, so the dependency walk above still covers psyche-metrics.
EXTRA_MODULES = {"psyche.metrics.tensorboard_sink"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def workspace_requirements() -> dict[str, list[str]]:
    """Each workspace package's declared dependencies, read from its pyproject.toml (the
    installed metadata of an editable package is as old as its last install)."""
    out = {}
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        out[canonical(project["name"])] = list(project.get("dependencies", []))
    return out


def reachable(package: str) -> dict[str, str]:
    """Every distribution `pip install <package>` would install, each with the chain that pulls
    it in (for the failure message)."""
    workspace = workspace_requirements()
    via = {canonical(package): package}
    queue: deque[tuple[str, frozenset[str]]] = deque([(canonical(package), frozenset())])
    seen: set[tuple[str, frozenset[str]]] = set()
    while queue:
        name, extras = queue.popleft()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name in workspace:
            declared = workspace[name]
        else:
            try:
                declared = importlib.metadata.requires(name) or []
            except importlib.metadata.PackageNotFoundError:
                pytest.fail(f"{via[name]} is not installed: its dependencies cannot be checked")
        for raw in declared:
            req = Requirement(raw)
            wanted = ("", *extras)
            if req.marker is not None and not any(
                req.marker.evaluate({"extra": e}) for e in wanted
            ):
                continue
            dep = canonical(req.name)
            via.setdefault(dep, f"{via[name]} -> {req.name}")
            queue.append((dep, frozenset(req.extras)))
    return via


@pytest.mark.parametrize("package", sorted(LIGHT_PACKAGES))
def test_declared_dependencies_never_reach_torch(package: str) -> None:
    pulled = reachable(package)
    assert not HEAVY & set(pulled), [pulled[h] for h in sorted(HEAVY & set(pulled))]


def test_the_dependency_walk_finds_torch_where_it_is() -> None:
    """The walk above can fail: the client does train, through psyche-modeling."""
    pulled = reachable("psyche-client")
    assert pulled["torch"] == "psyche-client -> psyche-modeling -> torch"
    assert "transformers" in pulled


def test_importing_every_module_loads_no_torch() -> None:
    code = f"""
import importlib, pkgutil, sys
for name in {sorted(LIGHT_PACKAGES.values())!r}:
    package = importlib.import_module(name)
    for module in pkgutil.walk_packages(package.__path__, name + "."):
        if module.name not in {sorted(EXTRA_MODULES)!r}:
            importlib.import_module(module.name)
print(sorted(m for m in sys.modules if m.split(".")[0] in {sorted(HEAVY)!r}))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
