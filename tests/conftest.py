"""Shared fixtures: small real datasets built once per test session."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

_ON = {"ON", "1", "TRUE", "YES"}


def _required_backends() -> list[str]:
    """ECHOPIPE_REQUIRE_* of the build: from the environment (CI sets them for the build and the
    tests alike) or from build_config.json next to the package, read without importing it."""
    names = [k for k in ("ECHOPIPE_REQUIRE_CUDA", "ECHOPIPE_REQUIRE_DALI")
             if os.environ.get(k, "").upper() in _ON]  # fmt: skip
    spec = importlib.util.find_spec("echopipe")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "build_config.json"
        if path.exists():
            raw = json.loads(path.read_text())
            names += [f"ECHOPIPE_{k.upper()}" for k in ("require_cuda", "require_dali")
                      if str(raw.get(k, "")).upper() in _ON]  # fmt: skip
    return sorted(set(names))


def pytest_sessionstart(session: pytest.Session) -> None:
    """A build that was required (ECHOPIPE_REQUIRE_*) must import: a broken native module fails
    the suite here instead of turning every native test into a skip."""
    required = _required_backends()
    if not required:
        return
    try:
        import echopipe._C  # noqa: F401
    except ImportError as exc:
        pytest.exit(f"{', '.join(required)} set but echopipe._C does not import: {exc}", 1)
    if "ECHOPIPE_REQUIRE_DALI" in required:
        from echopipe.dali import plugin

        try:
            plugin.plugin_path()
        except ImportError as exc:
            pytest.exit(f"ECHOPIPE_REQUIRE_DALI set but the DALI plugin is missing: {exc}", 1)


@pytest.fixture(scope="session")
def tiny_imagenet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real JPEG dataset in the ImageNet folder layout: 4 classes, 8 train + 2 val images each."""
    from echopipe.data import make_synthetic_imagenet

    root = tmp_path_factory.mktemp("tiny_imagenet")
    return make_synthetic_imagenet(
        root / "data", classes=4, per_class=8, size=(32, 48), seed=0, val_per_class=2
    )


@pytest.fixture
def one_thread():
    """One intra-op thread in the caller, as each pipeline stage worker has on 2 cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
