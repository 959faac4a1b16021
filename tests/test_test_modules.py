"""No test module imports another: what tests share lives in support modules (`support.py`,
`verification_support.py`, `screening_rounds.py`, ...), so that running, moving or deleting one
test file never changes which tests another collects or what its fixtures are."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported_test_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            # `from .test_x import y`, and `from . import test_x`
            names = [*([node.module] if node.module else []), *(a.name for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found += [n for n in names if n.rsplit(".", 1)[-1].startswith("test_")]
    return found


def test_no_test_module_imports_another() -> None:
    offenders = {
        str(path.relative_to(TESTS)): imported
        for path in sorted(TESTS.rglob("*.py"))
        if (imported := _imported_test_modules(path))
    }
    assert offenders == {}


def test_the_check_sees_an_import_of_a_test_module(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "from .test_other import helper\nfrom . import test_third\nimport tests.test_x\n"
    )
    assert _imported_test_modules(probe) == ["test_other", "test_third", "tests.test_x"]
