"""The README's results section is what bench/readme_tables.py renders from bench/results/*.json."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_results_match_the_recorded_json() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "readme_tables.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_a_changed_figure_is_caught(tmp_path: Path) -> None:
    """--check must fail when the README's table and the JSON disagree."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import readme_tables
    finally:
        sys.path.remove(str(ROOT / "bench"))
    section = readme_tables.render()
    assert "echo_cache.json" in section
    text = (ROOT / "README.md").read_text()
    assert readme_tables.splice(text, section) == text
    stale = text.replace(section, section.replace("| met ", "| not met ", 1))
    assert stale != text
    assert readme_tables.splice(stale, section) != stale
