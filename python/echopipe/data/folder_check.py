"""Checking the files of a folder scan on a pool of threads, and under torchrun across ranks.

The per-file check (a few KiB read, or a Pillow decode) spends its time in file reads and in
Pillow's C decoders, which release the GIL, so a bounded pool of threads runs it side by side.
At most ``window`` files are in flight (ImageNet's 1.28 M files never become 1.28 M futures),
and their results are taken in scan order: what the scan keeps, leaves out and stops at is what
a one-thread scan gives, the first bad file in scan order and not the first whose check ended.

Under torchrun each rank checks every ``world``-th file (interleaved: the shares hold as many
files of each class folder) and the ranks exchange what they found over the process group the
run already holds, so every rank ends with the same lists. They do so after every round of
4096 files each: no rank waits in a collective for much longer than a round takes, and with
``stop_at_first`` all stop after the round holding the first bad file. Within a round a rank
that stops at its first bad file has checked all of its files before it, so the smallest of
the ranks' first bad files is the first in scan order.

A check that raises (a bug, memory running out in a decode) or that does not finish within
:data:`FILE_TIMEOUT_S` (a read stuck on a hanging network mount, which no Python code can
interrupt) stops the scan with a :class:`CheckFailedError` naming the file. Under torchrun the
rank where it happened stops checking and tells the others at the next exchange, so every rank
raises the same error naming that rank and file instead of waiting in the collective until
``--dist-timeout-s``. The checks run on daemon threads: one stuck in the kernel is left behind
and does not keep the process from ending.

Every exchange of a scan (:func:`exchange`: the class folders, the file lists, each round) also
carries a rank's failure: a rank that could not list its files (:func:`listing_failed`) takes
part in the others' next exchange with its reason instead of its findings, and every rank
raises the same error naming it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FILE_TIMEOUT_S",
    "CheckFailedError",
    "ScanShare",
    "check_files",
    "default_workers",
    "exchange",
    "listing_failed",
    "same_files",
]

FILE_TIMEOUT_S = 60.0
"""Longest the check of one file may run (seconds): a header check reads a few KiB and a decode
check decodes one image, well under a second each; a file still unfinished after a minute is on
a mount that hangs, and the scan stops naming it."""

_MAX_WORKERS = 8
# Futures in flight per thread: enough that a slow file does not idle the others.
_WINDOW_PER_WORKER = 4
# Files each rank checks between two exchanges of what the ranks found.
_ROUND_PER_RANK = 4096
# How long the scan waits on one file before it looks at the time for a progress line again.
_POLL_S = 1.0


class CheckFailedError(RuntimeError):
    """The check of ``path`` raised or did not finish within its bound (on rank ``rank`` under
    torchrun, else ``None``); ``reason`` says what happened. ``path`` is None when a rank could
    not list the files (:func:`listing_failed`). Every rank raises the same one."""

    def __init__(self, path: str | None, reason: str, rank: int | None = None) -> None:
        self.path, self.reason, self.rank = path, reason, rank
        where = "" if rank is None else f"rank {rank}: "
        what = reason if path is None else f"the check of {path!r} failed: {reason}"
        tail = "" if rank is None else "; every rank stops"
        super().__init__(f"{where}{what}{tail}")


class _Failed(Exception):
    """Inside the scan: the check of ``paths[index]`` failed (``reason``)."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index, self.reason = index, reason


@dataclass(frozen=True)
class ScanShare:
    """This process's share of a scan checked by several processes.

    Rank ``rank`` of ``world`` checks files ``rank, rank + world, ...``. ``gather`` is a
    collective that every rank calls with its object and that returns every rank's object in
    rank order (:meth:`echopipe.training.distributed.DistContext.all_gather_object`).
    """

    rank: int
    world: int
    gather: Callable[[Any], list[Any]]


def default_workers(processes: int = 1) -> int:
    """Threads for the check: this process's share of the CPUs it may run on, at most 8 (more
    gain little on files read from one disk), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(_MAX_WORKERS, cpus // max(1, processes)))


def check_files(
    paths: Sequence[str],
    check_one: Callable[[str], str | None],
    *,
    stop_at_first: bool,
    workers: int = 1,
    share: ScanShare | None = None,
    progress: Callable[[int, int], None] | None = None,
    progress_every_s: float = 30.0,
    names: Sequence[str] | None = None,
    file_timeout_s: float | None = FILE_TIMEOUT_S,
    compared: bool = False,
) -> list[tuple[int, str]]:
    """``(index, reason)`` of the bad files of ``paths``, in scan order: all of them, or with
    ``stop_at_first`` only the first (an empty list when all pass).

    ``check_one(path)`` returns why a file is bad, or None. ``workers`` daemon threads run it
    (with 1 and no ``file_timeout_s``: this thread). With ``share`` this process checks its
    share and the ranks combine their findings after every round of a few thousand files each
    (so a rank that stops at a bad file never waits for the others' whole shares, and no rank
    waits long in a collective); ``names`` (the paths relative to the scanned folder) are
    compared across ranks first, so ranks that list different files are refused with a
    ValueError naming a file that differs instead of combining indices that mean different
    files (``compared``: the caller has compared them, :func:`same_files`). ``progress(checked,
    total)`` is called with 0 at the start and then at most every ``progress_every_s`` seconds
    (this process's share).

    Raises:
        CheckFailedError: ``check_one`` raised, or ran longer than ``file_timeout_s`` seconds
            on one file (None: no bound), here or on another rank; names the rank and file.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    world = share.world if share is not None else 1
    rank = share.rank if share is not None else 0
    if share is not None and world > 1 and not compared:
        same_files(share, names if names is not None else paths)
    count = _Count(len(range(rank, len(paths), world)), progress, progress_every_s)
    step = _ROUND_PER_RANK * world if world > 1 else max(1, len(paths))
    threaded = workers > 1 or file_timeout_s is not None
    pool = _DaemonPool(workers, file_timeout_s) if threaded else None
    found: list[tuple[int, str]] = []
    try:
        for start in range(0, len(paths), step):
            mine = range(start + rank, min(len(paths), start + step), world)
            failed: tuple[str, str] | None = None
            cause: BaseException | None = None
            try:
                bad = _check_in_order(paths, mine, check_one, stop_at_first, pool, workers, count)
            except _Failed as exc:
                if share is None or world == 1:
                    raise CheckFailedError(paths[exc.index], exc.reason) from exc.__cause__
                bad, failed, cause = [], (paths[exc.index], exc.reason), exc.__cause__
            if share is not None and world > 1:
                try:
                    views = _gather(share, bad, failed)
                except CheckFailedError as err:  # every rank stops, naming the same rank and file
                    raise err from (cause if err.rank == rank else None)
                bad = sorted(b for view in views for b in view)
            found.extend(bad)
            if stop_at_first and found:
                return found[:1]
    finally:
        if pool is not None:
            # Ctrl-C, SIGTERM, a failed check or the first bad file: the queued checks are
            # dropped and the running ones (one file each) end before the scan returns, but
            # for one stuck past the bound.
            pool.shutdown()
    return found


class _DaemonPool:
    """Threads that run the checks. Daemons: a thread stuck in a read the kernel does not end
    (a hanging mount) cannot be stopped from Python, and must not keep the process alive."""

    def __init__(self, workers: int, bound_s: float | None) -> None:
        self.bound_s = bound_s
        self.started: dict[concurrent.futures.Future[Any], float] = {}
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"echopipe-check_{n}", daemon=True)
            for n in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[str], Any], arg: str) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((future, fn, arg))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, arg = job
            if not future.set_running_or_notify_cancel():
                continue  # dropped while queued
            self.started[future] = time.monotonic()
            try:
                future.set_result(fn(arg))
            except BaseException as exc:  # handed to the scan, which names the file
                future.set_exception(exc)
            finally:
                self.started.pop(future, None)

    def running_for(self, future: concurrent.futures.Future[Any]) -> float:
        """Seconds ``future``'s check has run (0 while queued or done)."""
        began = self.started.get(future)
        return 0.0 if began is None else time.monotonic() - began

    def stuck(self, future: concurrent.futures.Future[Any]) -> bool:
        return self.bound_s is not None and self.running_for(future) > self.bound_s

    def shutdown(self) -> None:
        """Ends the threads once their file is checked; a check that has run past the bound is
        not waited for, and none longer than the bound."""
        for _ in self._threads:
            self._jobs.put(None)
        oldest = max((time.monotonic() - t for t in list(self.started.values())), default=0.0)
        wait = None if self.bound_s is None else max(0.0, self.bound_s - oldest)
        deadline = None if wait is None else time.monotonic() + wait
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


class _Count:
    """Files checked by this process, and the progress calls about them."""

    def __init__(
        self, total: int, progress: Callable[[int, int], None] | None, every_s: float
    ) -> None:
        self.total, self.done = total, 0
        self.progress, self.every_s = progress, every_s
        self.last = time.monotonic()
        if progress is not None:
            progress(0, total)

    def tick(self, checked: int = 0) -> None:
        self.done += checked
        if self.progress is not None and time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            self.progress(self.done, self.total)


def exchange(share: ScanShare, payload: Any) -> list[Any]:
    """Every rank's ``payload``, in rank order. A rank that could not list its files calls
    :func:`listing_failed` where the others call this: then every rank raises that rank's
    :class:`CheckFailedError` (the lowest rank's when several failed), so none waits until the
    collective's timeout. Every exchange of a scan goes through here (or :func:`_gather`)."""
    return _gather(share, payload, None)


def listing_failed(share: ScanShare, reason: str) -> CheckFailedError:
    """On a rank whose listing of the files failed (``reason``, e.g. a folder it may not read):
    tells the other ranks, which wait in their next :func:`exchange` (the comparison of the
    class folders or of the file lists), and returns the error that every rank raises."""
    try:
        _gather(share, None, (None, reason))
    except CheckFailedError as exc:
        return exc
    raise AssertionError("unreachable: this rank's own failure is in the views")


def _gather(share: ScanShare, payload: Any, failure: tuple[str | None, str] | None) -> list[Any]:
    """:func:`exchange` with this rank's ``(path, reason)`` failure, if any."""
    views = share.gather((payload, failure))
    who = next((r for r, view in enumerate(views) if view[1] is not None), None)
    if who is not None:
        path, reason = views[who][1]
        raise CheckFailedError(path, reason, rank=who)
    return [view[0] for view in views]


# Names per checksum in the comparison of the ranks' file lists: ImageNet's 1.28 M names are
# 1251 checksums, and a mismatch sends only the block of names holding the first difference.
_NAMES_PER_SUM = 1024


def same_files(share: ScanShare, names: Sequence[str], sizes: Sequence[int] | None = None) -> None:
    """Refuse ranks whose scans listed other files (their indices would name other files), or
    with ``sizes`` (bytes, one per name) files of the same name but another size (one node's
    copy cut short, which only the rank whose share holds the file would check), with a
    ValueError naming the first file that differs, the same on every rank. Cheap when they
    agree: a checksum per block of names, and the block that differs only on a mismatch."""
    entries = list(zip(names, sizes if sizes is not None else [None] * len(names), strict=True))
    sums = []
    for start in range(0, len(entries), _NAMES_PER_SUM):
        digest = 0
        for name, size in entries[start : start + _NAMES_PER_SUM]:
            digest = zlib.crc32(f"{name}\0{size}\0".encode("utf-8", "surrogateescape"), digest)
        sums.append(digest)
    views = exchange(share, (len(entries), sums))
    odd = next((r for r, view in enumerate(views) if view != views[0]), None)
    if odd is None:
        return
    theirs, ours = views[odd][1], views[0][1]
    # The first block that differs, or the first that one list lacks (the other's start).
    block = max(0, min(_first_unequal(theirs, ours), max(len(theirs), len(ours)) - 1))
    at = block * _NAMES_PER_SUM
    # Every rank sees the same views, so every rank takes part in this second exchange.
    blocks = exchange(share, entries[at : at + _NAMES_PER_SUM])
    raise ValueError(
        f"the ranks list other image files: {_first_difference(blocks[odd], blocks[0], odd)} "
        f"(rank {odd}: {views[odd][0]} files, rank 0: {views[0][0]}); every process must read "
        "the same data folder (a copy that differs on one node?)"
    )


def _first_unequal(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter's length when one is the
    other's start)."""
    pairs = enumerate(zip(a, b, strict=False))
    return next((k for k, (x, y) in pairs if x != y), min(len(a), len(b)))


def _first_difference(theirs: list[Any], ours: list[Any], odd: int) -> str:
    """The first ``(name, size)`` of two sorted blocks that one of them lacks, in words."""
    i = _first_unequal(theirs, ours)
    mine, first = dict(theirs), dict(ours)
    if i < len(theirs) and theirs[i][0] not in first:
        return f"rank {odd} lists {theirs[i][0]!r}, which rank 0 does not"
    if i < len(ours) and ours[i][0] not in mine:
        return f"rank 0 lists {ours[i][0]!r}, which rank {odd} does not"
    name = theirs[i][0] if i < len(theirs) else ours[i][0]
    return f"{name!r} has {mine.get(name)} bytes on rank {odd}, {first.get(name)} on rank 0"


def _check_in_order(
    paths: Sequence[str],
    order: range,
    check_one: Callable[[str], str | None],
    stop_at_first: bool,
    pool: _DaemonPool | None,
    workers: int,
    count: _Count,
) -> list[tuple[int, str]]:
    """The bad files among ``order``, checked on ``pool`` (or in this thread) and taken in
    order, at most ``workers * 4`` in flight. A check that raises or runs past the pool's
    bound raises :class:`_Failed`."""
    bad: list[tuple[int, str]] = []
    if pool is None:
        for i in order:
            try:
                reason = check_one(paths[i])
            except Exception as exc:
                raise _Failed(i, f"{type(exc).__name__}: {exc}") from exc
            count.tick(1)
            if reason is not None:
                bad.append((i, reason))
                if stop_at_first:
                    break
        return bad
    poll = _POLL_S if pool.bound_s is None else min(_POLL_S, pool.bound_s / 4)
    pending: collections.deque[tuple[int, concurrent.futures.Future[str | None]]]
    pending = collections.deque()
    todo = iter(order)
    try:
        while True:
            for i in itertools.islice(todo, workers * _WINDOW_PER_WORKER - len(pending)):
                pending.append((i, pool.submit(check_one, paths[i])))
            if not pending:
                return bad
            i, future = pending.popleft()
            while not concurrent.futures.wait([future], timeout=poll).done:
                count.tick()  # a slow file: the progress line still comes
                if pool.stuck(future):
                    raise _Failed(
                        i,
                        f"it did not finish within {pool.bound_s:g} s (a hanging network "
                        "mount or device?); its thread is left behind",
                    )
            try:
                reason = future.result()
            except Exception as exc:
                raise _Failed(i, f"{type(exc).__name__}: {exc}") from exc
            count.tick(1)
            if reason is not None:
                bad.append((i, reason))
                if stop_at_first:
                    return bad
    finally:
        for _, future in pending:  # this round's checks that are no longer wanted
            future.cancel()
