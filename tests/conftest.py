"""Shared fixtures: small real datasets built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_imagenet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real JPEG dataset in the ImageNet folder layout: 4 classes, 8 train + 2 val images each."""
    from echopipe.data import make_synthetic_imagenet

    root = tmp_path_factory.mktemp("tiny_imagenet")
    return make_synthetic_imagenet(
        root / "data", classes=4, per_class=8, size=(32, 48), seed=0, val_per_class=2
    )
