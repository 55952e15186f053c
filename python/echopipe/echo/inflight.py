"""Keeps what a queued GPU read needs alive until the GPU has done the read.

:meth:`echopipe.EchoCache.gather_to_device` queues a kernel that reads sample slots of the
pinned, mapped arena. If the caller drops its samples right after the call, their leases would
end and the cache could reuse the slots while the kernel still reads them. So the call hands the
leases here together with a CUDA event recorded after the kernel: one background thread waits for
each event in turn (FIFO) and only then drops the leases. The thread waits with the GIL released
(``torch.cuda.Event.synchronize``), so it does not hold up Python code, and it never needs the
caller to come back: a producer waiting for a free slot is not stuck behind a consumer that
stopped gathering.

The waits are plain callables, so the keeping is the same for any kind of event.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

# How long interpreter exit waits for reads still in flight before dropping their leases anyway.
_EXIT_WAIT_S = 5.0


class InFlight:
    """A FIFO of (wait, payload): ``payload`` is dropped once ``wait()`` has returned."""

    def __init__(self, name: str = "echopipe-gather-release") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[tuple[Callable[[], Any], Any]] = deque()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._closed = False

    def hold(self, wait: Callable[[], Any], payload: Any) -> None:
        """Keeps ``payload`` referenced until ``wait()`` has returned (or raised)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the in-flight keeper is closed (interpreter exit)")
            self._queue.append((wait, payload))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def pending(self) -> int:
        """How many payloads are still held (queued or being waited for)."""
        with self._cond:
            return len(self._queue) + int(self._busy)

    def drain(self, timeout: float | None = None) -> bool:
        """Waits until nothing is held; False if ``timeout`` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float = _EXIT_WAIT_S) -> None:
        """Stops taking payloads and waits (bounded) for the ones held to be released."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.drain(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and empty
                wait, payload = self._queue.popleft()
                self._busy = True
            try:
                wait()
            except Exception:  # a failed wait (e.g. a dead context) ends the hold too
                pass
            finally:
                del payload, wait
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _forget_after_fork(self) -> None:
        """In a forked child: the parent's thread does not exist here (nor do its CUDA reads).

        The parent's payloads are set aside, not dropped: dropping a lease takes the cache's
        locks, which another parent thread may have held at the fork (the child would then block
        in this handler for ever), and an event's destructor would call CUDA in a forked child.
        """
        _ORPHANED.append(self._queue)
        self._cond = threading.Condition()
        self._queue = deque()
        self._busy = False
        self._thread = None


# A forked child's share of its parent's payloads: referenced for the child's whole life.
_ORPHANED: list[deque[tuple[Callable[[], Any], Any]]] = []
_KEEPER = InFlight()
atexit.register(_KEEPER.close)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_KEEPER._forget_after_fork)


def hold_until(wait: Callable[[], Any], payload: Any) -> None:
    """Keeps ``payload`` alive until ``wait()`` returns, on the process-wide keeper."""
    _KEEPER.hold(wait, payload)


def pending() -> int:
    """Payloads the process-wide keeper still holds."""
    return _KEEPER.pending()
