"""echopipe: faster image training when input or a single accelerator is the bottleneck.

Two mechanisms, usable separately or together:

* **Data echoing** (Choi et al., 2019): :class:`EchoCache` is a native shuffle-and-echo buffer that
  reuses each fresh sample ``e`` times; :mod:`echopipe.dali` puts it inside DALI pipelines as a
  drop-in pair of operators.
* **Stale-weight pipelined backprop** (Zhang & Abdelrahman, 2019): :class:`StalePipeline` splits an
  ``nn.Sequential`` into stages that all work at once, each updating its weights right after its
  own backward.

Submodules load lazily, so ``import echopipe`` stays cheap and the pure-Python parts (pipeline,
models, data) work even where the native module or DALI is missing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
from typing import TYPE_CHECKING, Any

# Written once, in pyproject.toml; a source tree that was never installed has no metadata.
try:
    __version__ = importlib.metadata.version("echopipe")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover
    __version__ = "0+unknown"

_LAZY_ATTRIBUTES = {
    "EchoCache": ("echopipe.echo", "EchoCache"),
    "EchoStats": ("echopipe.echo", "EchoStats"),
    "StalePipeline": ("echopipe.pipeline", "StalePipeline"),
    "make_synthetic_imagenet": ("echopipe.data", "make_synthetic_imagenet"),
}
_LAZY_SUBMODULES = {"echo", "dali", "pipeline", "data", "models", "training", "cli", "torch"}

if TYPE_CHECKING:  # pragma: no cover
    from .data import make_synthetic_imagenet
    from .echo import EchoCache, EchoStats
    from .pipeline import StalePipeline


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRIBUTES:
        module_name, attribute = _LAZY_ATTRIBUTES[name]
        value = getattr(importlib.import_module(module_name), attribute)
        globals()[name] = value
        return value
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"echopipe.{name}")
    raise AttributeError(f"module 'echopipe' has no attribute {name!r}")


def build_info() -> dict[str, Any]:
    """Report how this echopipe was built and what it finds on this machine now.

    Returns a dict with ``version``, ``cuda_compiled`` (kernels compiled in), ``cuda_devices``
    (GPUs visible now; 0 without a driver), ``memory_kind`` (what a new cache would allocate:
    ``"pinned"`` or ``"pageable"``), ``dali_plugin_built``, ``dali_built_version`` (the DALI the
    plugin was compiled against), ``dali_version`` (the DALI importable now, or ``None``),
    ``torch_version`` and ``python``.
    """
    from .native import build_config, core

    config = build_config()
    try:
        from nvidia import dali

        dali_version: str | None = dali.__version__
    except ImportError:
        dali_version = None
    try:
        import torch

        torch_version: str | None = torch.__version__
    except ImportError:  # pragma: no cover - torch is a hard dependency
        torch_version = None
    cuda_devices = int(core.cuda_device_count())
    return {
        "version": __version__,
        "cuda_compiled": bool(core.built_with_cuda()),
        "cuda_architectures": config.get("cuda_architectures") or None,
        "cuda_devices": cuda_devices,
        "memory_kind": "pinned" if cuda_devices > 0 and core.built_with_cuda() else "pageable",
        "dali_plugin_built": bool(config.get("dali_plugin_built", False)),
        "dali_built_version": config.get("dali_built_version") or None,
        "dali_version": dali_version,
        "torch_version": torch_version,
        "python": platform.python_version(),
    }


__all__ = [
    "EchoCache",
    "EchoStats",
    "StalePipeline",
    "__version__",
    "build_info",
    "make_synthetic_imagenet",
]
