"""Finds, checks and loads the echopipe DALI plugin (``libechopipe_dali.so``) once per process.

The plugin is compiled against one DALI release; DALI's C++ operator API is not stable across
releases, so loading it into another one can crash inside DALI. The version the plugin was built
for is embedded in the file as a marker string and read from the bytes *before* the library is
loaded, so a mismatch becomes a clear ``DaliVersionMismatchError`` instead of a crash. After
loading, the exported ``echopipe_dali_built_version()`` confirms the marker.
"""

from __future__ import annotations

import ctypes
import re
import threading
from pathlib import Path

PLUGIN_FILENAME = "libechopipe_dali.so"
_MARKER = re.compile(rb"ECHOPIPE_DALI_BUILT_VERSION=([0-9A-Za-z.+_-]+)\n")


class DaliVersionMismatchError(ImportError):
    """The echopipe DALI plugin was built for a different DALI than the one importable now."""


class DaliPluginMissingError(ImportError):
    """The echopipe DALI plugin was not built (no DALI at build time) or cannot be found."""


def check_dali_version(built: str, installed: str) -> None:
    """Raises :class:`DaliVersionMismatchError` naming both versions when they differ.

    The check is exact on ``major.minor.patch``: DALI does not promise a stable C++ operator ABI
    even between patch releases.
    """
    if built.strip() != installed.strip():
        raise DaliVersionMismatchError(
            f"the echopipe DALI plugin was built against DALI {built} but DALI {installed} is "
            "installed; rebuild echopipe with the installed DALI "
            "(`pip install --no-build-isolation .`) or install nvidia-dali "
            f"{built}"
        )


def read_built_version(path: Path) -> str:
    """DALI version recorded in the plugin file at ``path`` (read from its bytes, not loaded)."""
    data = Path(path).read_bytes()
    match = _MARKER.search(data)
    if match is None:
        raise DaliPluginMissingError(
            f"{path} carries no ECHOPIPE_DALI_BUILT_VERSION marker; it is not an echopipe DALI "
            "plugin, or it is corrupt. Rebuild echopipe."
        )
    return match.group(1).decode()


def plugin_path() -> Path:
    """Path of the plugin next to ``echopipe._C`` (raises if it was not built)."""
    from ..native import build_config, native_dir

    path = native_dir() / PLUGIN_FILENAME
    if not path.exists():
        built = build_config().get("dali_plugin_built")
        raise DaliPluginMissingError(
            f"echopipe's DALI plugin {path} does not exist (build recorded dali_plugin_built="
            f"{built}); install NVIDIA DALI and rebuild echopipe"
        )
    return path


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def load() -> ctypes.CDLL:
    """Checks the version and loads the plugin into DALI (idempotent); returns its ctypes handle."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        import nvidia.dali as dali
        from nvidia.dali import plugin_manager

        path = plugin_path()
        check_dali_version(read_built_version(path), dali.__version__)
        plugin_manager.load_library(str(path))
        # DALI has loaded it (RTLD_GLOBAL); this dlopen returns the same handle.
        lib = ctypes.CDLL(str(path))
        lib.echopipe_dali_built_version.restype = ctypes.c_char_p
        lib.echopipe_dali_gpu_backend.restype = ctypes.c_int
        check_dali_version(lib.echopipe_dali_built_version().decode(), dali.__version__)
        _lib = lib
        return lib


def gpu_backend_compiled() -> bool:
    """True when the plugin registered the GPU backends of the echo operators."""
    return bool(load().echopipe_dali_gpu_backend())


def check_source_state(data: bytes, num_fields: int = 0) -> tuple[bool, str]:
    """Whether ``data``, an operator's entry in a DALI checkpoint, is an echo source's saved
    state (its padding template), and why it cannot be restored ("" when it can), as the
    plugin's own decoder judges it; ``num_fields`` (0: any) is the source's number of fields.
    DALI would refuse a malformed one only as a RuntimeError at the build, so it is checked
    here first."""
    lib = load()
    try:
        check = lib.echopipe_dali_check_source_state
    except AttributeError:  # a plugin built from an older checkout
        raise DaliPluginMissingError(
            f"{plugin_path()} has no echopipe_dali_check_source_state; rebuild echopipe"
        ) from None
    check.restype = ctypes.c_int
    check.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p,
                      ctypes.c_size_t]  # fmt: skip
    reason = ctypes.create_string_buffer(512)
    result = check(data, len(data), num_fields, reason, len(reason))
    return result != 0, reason.value.decode("utf-8", "replace") if result < 0 else ""
