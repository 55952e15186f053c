"""Closing echo caches: at garbage collection, and every open one at interpreter exit.

Interpreter exit must close each open :class:`~echopipe.echo.EchoCache` *before* Python joins
non-daemon threads, or a thread blocked in ``take()`` with no timeout keeps the process alive.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any

from ..native import core

__all__ = ["OPEN_CACHES", "close_native"]


def close_native(native: Any, name: str) -> None:
    """Closes the native cache (waking blocked threads) and frees its registry name."""
    native.close()
    core.remove_cache(name)


# Every open cache, so that interpreter exit can close them all.
OPEN_CACHES: weakref.WeakSet[Any] = weakref.WeakSet()


def _close_all_caches() -> None:
    """Closes every open cache, waking each thread blocked in put/take (they raise
    CacheClosedError). Runs at interpreter exit *before* Python joins non-daemon threads
    (threading's pre-join exit hook): a thread blocked in ``take()`` with no timeout would
    otherwise keep the process alive for ever, and ``weakref.finalize``/``atexit`` run too late,
    after that join."""
    for cache in list(OPEN_CACHES):
        cache.close()


def _register_exit_hook() -> None:
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - CPython has had it since 3.9
        import atexit

        atexit.register(_close_all_caches)
        return
    # RuntimeError: imported while the interpreter is already shutting down.
    with contextlib.suppress(RuntimeError):
        register(_close_all_caches)


_register_exit_hook()
