"""What the reader thread of :class:`echopipe.torch.EchoLoader`, its finalizer and the loader
share (:class:`Shared`, never the loader itself), and how an epoch's reader and cache end:
:func:`shutdown`, and :func:`join_failed` for a reader that failed by itself. In a fork of the
process that made the loader none of it is touched: the reader, the cache and the wrapped
loader's workers there are the parent's.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ..echo import EchoCache
from ..echo.lifetime import Origin

if TYPE_CHECKING:
    from .reader import Producer

__all__ = ["FORKED_ADVICE", "Shared", "join_failed", "shutdown"]

# What an EchoLoader used in a fork of the process that made it says to do instead.
FORKED_ADVICE = (
    "its reader, its cache and the loader it wraps are copies private to this process, so every "
    "forked process would read the wrapped loader and hand out its samples again; create the "
    "EchoLoader in the process that iterates it, or iterate it in the main process, around the "
    "DataLoader (not inside a Dataset that the DataLoader's workers run)"
)


class Shared:
    """What the producer thread, the finalizer and the loader share (never the loader itself)."""

    def __init__(self) -> None:
        self.cache: EchoCache | None = None
        self.producer: Producer | None = None
        self.lock = threading.Lock()
        self.origin = Origin()  # in a fork, the reader, cache and workers are the parent's
        # A reader that failed by itself and still ends the wrapped loader's iterator (see
        # shutdown); the next epoch's start and close() wait for it.
        self.failed: Producer | None = None


def shutdown(shared: Shared, timeout: float, leave_failed: bool = False) -> None:
    """Stops the reader and closes the cache; returns once the reader ended (or ``timeout``
    passed, with a warning). With ``leave_failed`` a reader that failed by itself (the epoch
    raises its error) is not waited for: all it still does is end the wrapped loader's iterator,
    where torch waits up to 5 s for a worker stuck in its dataset before it kills it, so its
    error (a ``DataLoader(timeout=)`` expiring, say) reaches the caller at once, as the plain
    DataLoader's does; :func:`join_failed` waits for it."""
    if shared.origin.forked():
        return  # a fork's copy: the reader, its workers and the cache belong to the parent
    producer, cache = shared.producer, shared.cache
    if producer is not None:
        producer.stop.set()
    if cache is not None:
        cache.close()  # wakes a producer blocked on a full cache
    if producer is not None and leave_failed and producer.error is not None:
        shared.failed = producer
    elif producer is not None:
        producer.shutdown(timeout)
    shared.producer = None
    shared.cache = None


def join_failed(shared: Shared, timeout: float) -> None:
    """Waits (at most ``timeout``, then warns) for the reader :func:`shutdown` left to end its
    wrapped iterator: before the next epoch reads the wrapped loader again, and at close()."""
    failed, shared.failed = shared.failed, None
    if failed is not None and not shared.origin.forked():
        failed.shutdown(timeout)
