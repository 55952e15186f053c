"""The README's Python examples run as written."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples() -> None:
    assert len(_python_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_example_runs(
    index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ECHOPIPE_CACHE_DIR", str(tmp_path / "cache"))
    script = tmp_path / f"readme_example_{index}.py"
    script.write_text(_python_blocks()[index])
    runpy.run_path(str(script), run_name="__main__")
    assert capsys.readouterr().out.strip(), "each example prints what it did"
