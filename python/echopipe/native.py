"""Loads the private compiled module ``echopipe._C`` exactly once.

Every module that needs native code imports ``_C`` from here, so the decision whether the native
core is usable is taken once, at import, and a missing build gives one clear error instead of an
``ImportError`` deep inside some submodule. Pure-Python parts (pipeline, models, data) never import
this module, so they keep working from a source checkout without a build.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

_PACKAGE_DIR = Path(__file__).resolve().parent

try:
    from . import _C as core  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    raise ImportError(
        "echopipe's native module echopipe._C could not be loaded "
        f"({exc}). Build and install the package first: "
        "`pip install --no-build-isolation .` from the repository root."
    ) from exc


@cache
def build_config() -> dict[str, Any]:
    """What CMake recorded at build time (``build_config.json`` next to ``_C``)."""
    path = _PACKAGE_DIR / "build_config.json"
    if not path.exists():
        # Editable installs keep the file in the build tree; the module knows where it came from.
        path = Path(core.__file__).resolve().parent / "build_config.json"
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    for key in ("cuda_compiled", "dali_plugin_built"):
        raw[key] = str(raw.get(key, "")).upper() in {"ON", "TRUE", "1", "YES"}
    return raw


def native_dir() -> Path:
    """Folder holding ``_C`` and its sibling shared objects (core library, DALI plugin)."""
    return Path(core.__file__).resolve().parent


__all__ = ["build_config", "core", "native_dir"]
