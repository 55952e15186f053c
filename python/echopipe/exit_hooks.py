"""Work that interpreter exit must do before Python joins (or abandons) threads.

``atexit`` and ``weakref.finalize`` run after threading's shutdown: too late to wake a thread
blocked with no timeout (it keeps the process alive) or to stop a daemon thread running torch
code (Python then ends it inside the C++ code, and the process aborts). Hooks registered here
run in threading's own exit hook, before either.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

__all__ = ["before_thread_join"]


def before_thread_join(hook: Callable[[], None]) -> None:
    """Runs ``hook`` at interpreter exit, before Python joins its threads."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - CPython has had it since 3.9
        import atexit

        atexit.register(hook)
        return
    # RuntimeError: imported while the interpreter is already shutting down.
    with contextlib.suppress(RuntimeError):
        register(hook)
