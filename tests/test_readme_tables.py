"""The README's results section is what bench/readme_tables.py renders from bench/results/*.json."""

from __future__ import annotations

import json
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


def test_bench_readme_figure_tables_are_rendered_from_the_json() -> None:
    """bench/README's figure tables are the suites' own ``figures_table`` of the recorded JSON,
    and a changed figure there is put back (so --check would fail on it)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import readme_tables
    finally:
        sys.path.remove(str(ROOT / "bench"))
    text = readme_tables.BENCH_README.read_text()
    assert readme_tables.splice_figures(text) == text
    for rel in readme_tables.FIGURES:
        block = readme_tables.figures_block(rel)
        assert block in text
        data = json.loads((readme_tables.RESULTS / rel).read_text())
        first = data["figures"]["rows"][0]
        rate = first.get("echopipe_img_s") or first.get("samples_per_s")
        if rate is not None:  # wallclock_train's rows are times, formatted with their spread
            assert f"{rate:,.0f}" in block
    stale = text.replace("| 6 | ", "| 6 | 1", 1)
    assert stale != text
    assert readme_tables.splice_figures(stale) == text
