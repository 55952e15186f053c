"""Every ``from echopipe... import name`` in the benchmarks and tests names something that
exists, the imports inside functions too.

The GPU benchmarks run their echopipe imports only on a GPU machine, after their CUDA check, so
a name that a layout change removed is found there and nowhere else: the first H200 run lost
its gather figures to ``from echopipe.native import _C`` (the module's name is ``core``). Here
each module is imported and asked for the name, which needs no GPU.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _echopipe_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of each ``from echopipe... import name`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
            continue
        if node.module == "echopipe" or node.module.startswith("echopipe."):
            found.extend((node.lineno, node.module, a.name) for a in node.names)
    return found


def _missing(paths: list[Path]) -> list[str]:
    missing = []
    for path in paths:
        for line, module, name in _echopipe_imports(path):
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}"
            try:
                target = importlib.import_module(module)
            except ImportError as exc:
                missing.append(f"{where}: {module} does not import ({exc})")
                continue
            if name == "*" or hasattr(target, name):
                continue
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{where}: {module} has no {name}")
    return missing


def test_the_benchmarks_and_tests_import_names_that_exist() -> None:
    pytest.importorskip("echopipe.native", reason="needs the built native module")
    paths = sorted((ROOT / "bench").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    missing = _missing(paths)
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)


def test_the_check_sees_a_name_that_is_gone(tmp_path: Path) -> None:
    pytest.importorskip("echopipe.native", reason="needs the built native module")
    program = tmp_path / "bench_like.py"
    program.write_text(
        "def measure():\n"
        "    from echopipe.native import _C\n"
        "    from echopipe.native import core\n"
        "    from echopipe import echo\n"
    )
    assert _missing([program]) == [f"{program}:2: echopipe.native has no _C"]
