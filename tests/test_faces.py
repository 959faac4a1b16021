"""The packages' public faces: what `psyche.network`, `psyche.transport` and `psyche.metrics`
export is what their modules define, and `psyche.network`'s lazy face costs nothing to import.

Other packages import these names from the package, never from its modules: import-linter's
protected contracts in the root pyproject.toml check that (see docs/design.md).
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FACES = ["psyche.network", "psyche.transport", "psyche.metrics"]


def _in_fresh_interpreter(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.parametrize("face", FACES)
def test_every_exported_name_resolves(face: str) -> None:
    package = importlib.import_module(face)
    assert package.__all__, face
    missing = [name for name in package.__all__ if not hasattr(package, name)]
    assert not missing, (face, missing)


def test_network_face_names_are_their_modules_objects() -> None:
    import psyche.network

    for name, module in psyche.network._EXPORTS.items():
        home = importlib.import_module(module, "psyche.network")
        assert getattr(psyche.network, name) is getattr(home, name), name


def test_network_face_lists_the_same_names_for_the_type_checker() -> None:
    """`psyche.network` names each export twice: `_MODULES` (read at run time) and the
    `TYPE_CHECKING` imports (read by mypy). A name in one and not the other would be either
    untyped or missing at run time."""
    path = ROOT / "packages/psyche-network/src/psyche/network/__init__.py"
    tree = ast.parse(path.read_text())
    static: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                assert imp.module is not None
                for alias in imp.names:
                    static[alias.asname or alias.name] = imp.module
    import psyche.network

    lazy = {name: "psyche.network" + module for name, module in psyche.network._EXPORTS.items()}
    assert static == lazy


def test_network_face_loads_libp2p_only_for_the_names_that_need_it() -> None:
    heavy = "sorted(m for m in ('libp2p', 'torch', 'transformers') if m in sys.modules)"
    code = f"""
import sys
import psyche.network
print({heavy})
from psyche.network import BlobTicket, EndpointAddr, DownloadType, ParameterCodec
print({heavy})
from psyche.network import NetworkConnection, ModelDownload, open_relay
print({heavy})
"""
    assert _in_fresh_interpreter(code).splitlines() == ["[]", "[]", "['libp2p']"]


def test_network_face_hides_nothing_it_does_not_have() -> None:
    import psyche.network

    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        _ = psyche.network.NoSuchName
    assert set(psyche.network.__all__) <= set(dir(psyche.network))
