"""Closing echo caches: at garbage collection, and every open one at interpreter exit; and the
process an object belongs to (:class:`Origin`).

Interpreter exit must close each open :class:`~echopipe.echo.EchoCache` *before* Python joins
non-daemon threads, or a thread blocked in ``take()`` with no timeout keeps the process alive.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Any

from ..native import core
from .values import CacheForkedError

__all__ = ["OPEN_CACHES", "Origin", "close_native"]


def close_native(native: Any, name: str) -> None:
    """Closes the native cache (waking blocked threads) and frees its registry name (only its
    own: in a forked process a new cache may have taken the name of an inherited one)."""
    native.close()
    core.remove_cache(name, native.handle)


class Origin:
    """The process an object was made in. A fork of it (a ``DataLoader`` worker of the ``fork``
    start method, an ``os.fork()`` child) holds a private copy of the object, without the
    threads that worked for it, so the object refuses to be used there
    (:class:`CacheForkedError`), as the native cache does; the count of forks is the core's
    (``fork_generation``, from a ``pthread_atfork`` handler)."""

    __slots__ = ("generation", "pid")

    def __init__(self) -> None:
        self.generation = int(core.fork_generation())
        self.pid = os.getpid()

    def forked(self) -> bool:
        """Whether this process is a fork of the one the object was made in."""
        return int(core.fork_generation()) != self.generation

    def check(self, what: str, instead: str) -> None:
        """Raises :class:`CacheForkedError` naming ``what`` and both processes in a fork;
        ``instead`` says what to do instead."""
        if self.forked():
            pid = os.getpid()
            raise CacheForkedError(
                f"{what} was created in process {self.pid}, and process {pid} is a fork of it "
                f"(a DataLoader worker, an os.fork() child): {instead}",
                self.pid,
                pid,
            )


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
