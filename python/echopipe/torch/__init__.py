"""``echopipe.torch``: data echoing for PyTorch input pipelines (:class:`EchoLoader`).

Inside the package every import is absolute, so ``import torch`` elsewhere in echopipe still
finds PyTorch, not this module.
"""

from __future__ import annotations

from .loader import (
    EchoLoader,
    EchoLoaderStats,
    FactorReplacedWarning,
    LayoutError,
    LoaderError,
    RankStatesError,
    RankStatesWarning,
    ShapeChangeError,
    StaleLengthWarning,
    UnshardedLoaderError,
)

__all__ = [
    "EchoLoader", "EchoLoaderStats", "FactorReplacedWarning", "LayoutError", "LoaderError",
    "RankStatesError", "RankStatesWarning", "ShapeChangeError", "StaleLengthWarning",
    "UnshardedLoaderError",
]  # fmt: skip
