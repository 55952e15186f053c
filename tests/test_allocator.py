"""The glibc allocator tuning used by ``echopipe train``."""

from __future__ import annotations

import subprocess
import sys


def test_tuning_takes_effect_in_a_fresh_process() -> None:
    # A fresh interpreter: mallopt(M_ARENA_MAX) only binds before threads create arenas.
    code = "from echopipe.training.allocator import tune_host_allocator as t; print(t())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # This project's machines run glibc, where every mallopt call must succeed.
    assert out.stdout.strip() == "True"
