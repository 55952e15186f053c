"""Ending the wrapped loader's worker processes: waking a reader that waits on dead workers,
ending the iterator a pass used, and the iterators a loader keeps between passes.

A ``DataLoader`` iterator is recognised by what torch's shutdown needs (``_shutdown_workers``,
``_data_queue``), never by its class, so loaders that wrap or subclass ``DataLoader`` are ended
the same way.
"""

from __future__ import annotations

import gc
import threading
import time
import warnings
from typing import Any

from torch.utils.data import DataLoader

from . import wrapped

__all__ = [
    "end_loader_workers", "hidden_iterators", "inner_iterators", "is_loader_iterator",
    "join_waking", "lightning_reset", "release_iterator", "wake", "workers_died",
]  # fmt: skip

_WAKE_POLL_S = 0.02  # how often a join looks for the dead workers of a generator's iterator
_DEEP_AFTER_S = 0.1  # then it also scans for a generator's hidden DataLoader iterator
_SEARCH_DEPTH = 4  # generators within generators, objects within their frames' locals


def wake(it: Any) -> bool:
    """Ends the wait of a reader inside ``next()`` of a ``DataLoader``'s multi-process iterator.

    That iterator waits for its workers in slices of 5 s and checks them between slices, so a
    reader whose workers died (Ctrl-C in a terminal signals them too) would hold the interrupted
    program for up to 5 s. A message ends the slice at once: ``(None, None)``, which torch's own
    shutdown sends to wake its pin-memory thread. It is no task's result, so the iterator raises
    and the reader, told to stop, ends and ends the workers; a persistent iterator drops the
    message at its next ``iter()``, as it drops the other results of a pass left early, but
    only when it arrives before the workers' replies to that ``iter()``: a message sent just
    after the reader returned from ``next()`` (it was waiting when shutdown looked) can arrive
    after them, and the next pass raises ``KeyError: None`` at its first batch (3 of 300
    early-ended passes with another thread holding the GIL). So an iterator that keeps its
    workers between passes is woken only once one of them died (:func:`join_waking`): while
    they run, its ``next()`` returns when the batch in progress is done, as its ``iter()``
    would wait for that batch anyway. Returns whether the message was sent.
    """
    if getattr(it, "_persistent_workers", False) and not workers_died(it):
        return False
    data_queue = getattr(it, "_data_queue", None)
    put = getattr(data_queue, "put", None)
    if not callable(put) or not callable(getattr(it, "_shutdown_workers", None)):
        return False  # not a multi-process DataLoader iterator: shutdown() waits as before
    try:
        put((None, None))
        cancel = getattr(data_queue, "cancel_join_thread", None)
        if callable(cancel):
            cancel()  # its feeder thread must not hold up the interpreter's exit
    except (ValueError, OSError):
        return False  # closed: the iterator has already been shut down
    return True


def is_loader_iterator(obj: Any) -> bool:
    """Whether ``obj`` is a multi-process ``DataLoader`` iterator (by what :func:`wake` uses)."""
    try:
        return callable(getattr(obj, "_shutdown_workers", None)) and hasattr(obj, "_data_queue")
    except Exception:  # an object of a wrapper's own that refuses the question
        return False


def inner_iterators(it: Any, loader: Any) -> list[Any]:
    """The multi-process ``DataLoader`` iterators a reader waiting in ``next(it)`` may wait on
    when ``it`` is not one itself: a generator's (timm's ``MultiEpochsDataLoader`` and
    ``PrefetchLoader`` wrap one in a generator), found in its frame's locals, the attributes of
    the objects there (``self.iterator``) and the generators it delegates to; and those the
    wrapped loaders keep (:func:`end_loader_workers`'). An iterator a generator holds only on
    its frame's value stack (``for batch in self.loader:`` over a DataLoader without persistent
    workers) is not found: Python does not show a running frame's stack."""
    found: dict[int, Any] = {}
    seen: set[int] = set()
    todo = [(it, 0), *((obj, _SEARCH_DEPTH - 1) for obj in wrapped.dataloaders(loader))]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen or depth > _SEARCH_DEPTH:
            continue
        seen.add(id(obj))
        if is_loader_iterator(obj):
            found[id(obj)] = obj
            continue
        inner: list[Any] = []
        frame = getattr(obj, "gi_frame", None)
        if frame is not None:  # a generator: what it works on
            inner += list(frame.f_locals.values())
            inner.append(getattr(obj, "gi_yieldfrom", None))
        elif depth > 0 and hasattr(obj, "__dict__") and not isinstance(obj, type):
            inner += list(vars(obj).values())
        todo += [(v, depth + 1) for v in inner if v is not None]
    return list(found.values())


def hidden_iterators(loader: Any) -> list[Any]:
    """The multi-process iterators of the ``DataLoader`` objects the wrapped loader wraps, found
    by what refers to their index sampler (the iterator keeps the DataLoader's): an iterator a
    generator holds only on its frame's value stack (``for batch in self.loader:``), which
    :func:`inner_iterators` does not see. It scans the interpreter's objects, so it is called
    only for a reader still waiting after a first wait."""
    found: list[Any] = []
    for obj in wrapped.dataloaders(loader):
        key = getattr(obj, "_index_sampler", None) if isinstance(obj, DataLoader) else None
        if key is None:
            continue
        refs = gc.get_referrers(key)
        refs += [r for d in refs if isinstance(d, dict) for r in gc.get_referrers(d)]
        found += [r for r in refs if is_loader_iterator(r) and r._index_sampler is key]
    return found


def workers_died(it: Any) -> bool:
    """Whether a worker of the multi-process ``DataLoader`` iterator ``it`` ended while the
    iterator still counts on it (a terminal's Ctrl-C ends them): the iterator cannot deliver
    any more, and torch notices only at its next 5 s check."""
    try:
        return any(up and not w.is_alive() for w, up in
                   zip(it._workers, it._workers_status, strict=False))  # fmt: skip
    except (AttributeError, TypeError, ValueError, OSError):
        return False


def release_iterator(it: Any, finished: bool) -> None:
    """Ends the wrapped loader's iterator now: DataLoader workers exit, generators close.

    An exhausted DataLoader iterator has shut its workers down itself, and persistent workers
    belong to the DataLoader (its next ``iter()`` reuses them), so both are left alone.
    """
    if it is None:
        return
    # torch DataLoader's multi-process iterator
    shutdown = getattr(it, "_shutdown_workers", None)
    keep = finished or getattr(it, "_persistent_workers", False)
    try:
        if callable(shutdown) and not keep:
            shutdown()
        close = getattr(it, "close", None)
        if callable(close):
            close()
    except Exception as exc:  # a failing close must not hide the reason the epoch ended
        warnings.warn(f"EchoLoader: closing the wrapped loader failed: {exc}", RuntimeWarning,
                      stacklevel=2)  # fmt: skip


def end_loader_workers(loader: Any) -> None:
    """Ends the worker processes of the multi-process ``DataLoader`` iterators the wrapped loader
    keeps between passes (``close()`` calls it, after the reader ended).

    Those are the attributes of the wrapped loader, and of each loader it wraps through
    ``.loader`` (:func:`.wrapped.dataloaders`), that have torch's ``_shutdown_workers``: a
    ``DataLoader``'s persistent ``_iterator`` (dropped, so that its next ``iter()`` starts new
    workers, as after a fresh start), and an iterator a loader made once for its whole life
    (timm's ``MultiEpochsDataLoader`` makes one in ``__init__`` and takes every pass from it),
    which cannot deliver after that, as after the end of any of its workers.
    """
    for obj in wrapped.dataloaders(loader):
        for name, value in list(vars(obj).items()) if hasattr(obj, "__dict__") else ():
            try:
                shutdown_workers = getattr(value, "_shutdown_workers", None)
            except Exception:  # an attribute of a wrapper's own that refuses the question
                continue
            if not callable(shutdown_workers):
                continue
            try:
                shutdown_workers()  # idempotent: the iterator's finalizer may call it again
            except Exception as exc:
                warnings.warn(f"EchoLoader: ending the workers of the wrapped loader's {name} "
                              f"failed: {exc}", RuntimeWarning, stacklevel=3)  # fmt: skip
            if name == "_iterator":
                obj._iterator = None  # a DataLoader's persistent one: the next iter() remakes it


def lightning_reset(loader: Any, value: Any) -> None:
    """Lightning's teardown of a loop (the end of ``fit``, ``validate``...) ends a
    ``DataLoader``'s persistent workers: it reads the loader's ``_iterator``, shuts it down when
    it is a multi-process one, and sets ``_iterator = None``. An ``EchoLoader`` reads ``None``
    there (a pass may be reading the wrapped iterator); the write ends the persistent workers of
    the wrapped ``DataLoader`` objects once no pass runs (a pass left running keeps them until
    :meth:`~echopipe.torch.EchoLoader.close`), as Lightning does for a plain one. Before, they
    lived on after ``fit`` for as long as a ``DataModule`` kept its ``EchoLoader``."""
    if value is not None or loader._current is not None:
        return
    for obj in wrapped.dataloaders(loader._loader):
        it = vars(obj).get("_iterator") if isinstance(obj, DataLoader) else None
        if it is not None and callable(getattr(it, "_shutdown_workers", None)):
            it._shutdown_workers()
            obj._iterator = None  # the next iter() starts new workers, as after a fresh start


def join_waking(thread: threading.Thread, waiting_in: Any, source: Any, timeout: float) -> None:
    """Joins the reader ``thread``, which waits in ``waiting_in`` (or in nothing: ``None``),
    waking that wait (:func:`wake`). A ``DataLoader`` iterator that the wrapped loader's
    generator reads from (``wake`` reaches only the one ``iter()`` gave), and a ``waiting_in``
    that keeps its workers between passes, are woken once their workers died: it
    may be one the loader keeps for its life (timm's ``MultiEpochsDataLoader``), which a
    message would break while its workers run, but which cannot deliver once one died."""
    woken = waiting_in is not None and wake(waiting_in)
    inner = inner_iterators(waiting_in, source) if waiting_in is not None else []
    inner = [it for it in inner if it is not waiting_in]
    if waiting_in is not None and not woken and is_loader_iterator(waiting_in):
        inner.append(waiting_in)  # persistent: woken if a worker dies while the reader waits
    now = time.monotonic()
    deadline = now + timeout
    # still waiting after a first slice: look for an iterator on a generator's stack too
    deep = now + _DEEP_AFTER_S if waiting_in is not None and not is_loader_iterator(
        waiting_in) else None  # fmt: skip
    while thread.is_alive() and (inner or deep is not None):
        if deep is not None and time.monotonic() >= deep:
            inner += [it for it in hidden_iterators(source)
                      if it is not waiting_in and all(it is not i for i in inner)]  # fmt: skip
            deep = None
        for it in [it for it in inner if workers_died(it)]:
            wake(it)
            inner.remove(it)
        left = deadline - time.monotonic()
        if left <= 0:
            return
        thread.join(min(_WAKE_POLL_S, left))
    thread.join(max(0.0, deadline - time.monotonic()))
