"""The upstream runner: runs the reader half of an :class:`EchoPipeline` into its echo cache."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..echo.values import CacheTooSmallError
from .epochs import ReaderEpochs
from .host_copy import host_dense
from .upstream_flight import UpstreamFlight, empty_epoch

_POLL_S = 0.005


# How long pause() waits for an iteration boundary before it asks the caller to draw: longer
# than the loop's own waits (wait_for_room's 0.05 s), so a runner between iterations pauses first.
_PAUSE_SLICE_S = 0.2
# A deterministic fill's sink that waits for space this long while nothing is drawn never gets
# it (the drawing thread is the one waiting): checked every _WATCH_S.
_STUCK_S = 1.0
_WATCH_S = 0.1


@dataclass(frozen=True)
class UpstreamPlan:
    """What the runner follows, fixed once the DALI pipelines are built.

    Attributes:
        batch_size, upstream_batch_size: downstream and reader batch sizes.
        shuffle_buffer: samples the cache holds before the first draw.
        epochs: reader epochs per pass (``None``: free-running, never ends).
        deterministic: run on demand in the consumer's thread instead of a thread of its own.
        iterations_per_epoch: upstream iterations per reader epoch.
        reader_epochs: the reader's geometry (``None`` without a reader).
        depth: the upstream's ``prefetch_queue_depth``: 2 schedules the next iteration while
            this one is collected (:mod:`echopipe.dali.upstream_flight`), 1 runs them one at a
            time (deterministic mode, and where two could not be in flight safely).
    """

    batch_size: int
    upstream_batch_size: int
    shuffle_buffer: int
    epochs: int | None
    deterministic: bool
    iterations_per_epoch: int
    reader_epochs: ReaderEpochs | None
    depth: int = 1


class UpstreamRunner:
    """Runs the upstream DALI pipeline: one iteration = one upstream batch into the cache.

    Free-running mode uses a daemon thread that only starts an iteration when the cache has room
    for its upstream batch and every one in flight, so no sink blocks mid-batch for slots, and a
    pause (for a checkpoint) is reached once those are back (at most ``depth``). Deterministic
    mode runs iterations on demand from the consumer's thread while no downstream iteration is
    in flight, which fixes the interleaving of puts and draws and so makes the stream a pure
    function of the seed and the input order.
    """

    def __init__(self, cache: Any, upstream: Any, plan: UpstreamPlan, name: str) -> None:
        self._cache = cache
        self._upstream = upstream
        self._plan = plan
        self._name = name
        self.fresh_in = 0
        self.iterations = 0
        self.epoch_index = 0
        self.iter_in_epoch = 0
        self._ended = False
        self.error: BaseException | None = None
        # Deterministic mode: the largest batch's mean bytes per sample in the cache.
        self.max_sample_bytes = 0
        # The upstream's time per iteration, written by the runner thread, read by the consumer:
        # `seconds` over `timed` iterations. At depth 1 every iteration's run(); at depth 2
        # only those run behind another (UpstreamFlight.collect), whose cost is the pipelined
        # rate: one started alone, for lack of room, costs its whole latency.
        self.seconds = 0.0
        self.timed = 0
        # Seconds the free-running thread waited for room in a full cache (not saved).
        self.room_wait_s = 0.0
        self._timing_lock = threading.Lock()
        self._stop = threading.Event()
        self._pause_requested = threading.Event()
        self._paused = threading.Event()
        self._thread: threading.Thread | None = None

    # -- bookkeeping shared by both modes --

    @property
    def ended(self) -> bool:
        """True once the pass's last reader epoch was run (and the cache told so)."""
        return self._ended

    def next_pass(self) -> None:
        """Lets the runner go on with the next pass of an epoch-aligned stream."""
        self._ended = False

    def step(self) -> bool:
        """Runs one upstream iteration; False (and end_of_input) once a finite run is complete."""
        if self._ended:
            return False
        self._epoch_start()
        bytes_before = self._cache.stats().bytes_used if self._plan.deterministic else 0
        t0 = time.perf_counter()
        outputs = self._run_upstream()
        self._record(outputs, time.perf_counter() - t0, bytes_before)
        return True

    def _epoch_start(self) -> None:
        """Before the first iteration of a reader epoch (none of the last one in flight)."""
        plan = self._plan
        if plan.epochs is not None and self.iter_in_epoch == 0 and plan.reader_epochs:
            # Only the reader epoch's own files: its padding (pad_last_batch) is never stored.
            self._cache.quota = plan.reader_epochs.fresh(self.epoch_index)

    def _record(
        self, outputs: Any, elapsed: float, bytes_before: int = 0, timed: bool = True
    ) -> None:
        """Counts one finished iteration; at a pass's last, tells the cache its input ended."""
        plan, cache = self._plan, self._cache
        stored = int(host_dense(outputs[0]).sum())
        if plan.deterministic and stored:
            # Nothing else touches the cache meanwhile: the growth is this batch's bytes.
            grown = cache.stats().bytes_used - bytes_before
            self.max_sample_bytes = max(self.max_sample_bytes, math.ceil(grown / stored))
        with self._timing_lock:
            self.fresh_in += stored
            self.iterations += 1
            if timed:
                self.timed += 1
                self.seconds += elapsed
        self.iter_in_epoch += 1
        if self.iter_in_epoch >= plan.iterations_per_epoch:
            self.iter_in_epoch = 0
            self.epoch_index += 1
            if plan.epochs is not None and self.epoch_index % plan.epochs == 0:
                self._ended = True
                cache.end_of_input()

    def _run_upstream(self) -> Any:
        """One upstream iteration. An ``external_source`` whose source ends its epoch (DALI's
        StopIteration) is reset and read again: the stream reads epoch after epoch, as a
        reader does on its own. Before, the StopIteration ended the runner as a failure with
        an empty message."""
        try:
            return self._upstream.run()
        except StopIteration:
            self._upstream.reset()
        try:
            return self._upstream.run()
        except StopIteration:
            raise empty_epoch() from None

    def bytes_for_batch(self) -> bool:
        """Room by bytes for one more upstream batch of samples as large as the largest yet."""
        stats = self._cache.stats()
        need = self.max_sample_bytes * self._plan.upstream_batch_size
        return stats.capacity_bytes - stats.bytes_used >= need

    def fill(self) -> None:
        """Deterministic mode: runs upstream iterations until the cache has no room for another.

        The sink would block on a cache full by bytes while the consumer (this thread) cannot
        draw, so a batch only starts when the bytes of the largest samples so far fit; and when
        that leaves fewer samples than the first draw waits for, ValueError says so instead of
        waiting forever.
        """
        try:
            self._fill()
        except Exception as exc:  # kept, so that every later call reports it too
            self.error = exc
            raise

    def _fill(self) -> None:
        while not self._ended and self._room_for(1, wait=False) and self.bytes_for_batch():
            self._watched_step()
        if self._ended or self.bytes_for_batch():
            return  # stopped by slots, which always leave room for the first draw
        stats = self._cache.stats()
        if stats.resident_with_tickets < max(self._plan.shuffle_buffer, self._plan.batch_size):
            raise self._too_small(stats)

    def _watched_step(self) -> None:
        """One deterministic iteration, watched: before the first batch (or one of larger
        samples than any so far) the bytes it needs are unknown, and a sink blocked on a full
        cache would wait forever for this thread to draw. A producer waiting with no copy
        drawn for ``_STUCK_S`` closes the cache, which ends the iteration; CacheTooSmallError
        then says by how much the cache is too small."""
        done = threading.Event()
        stuck = threading.Event()
        cache = self._cache

        def watch() -> None:
            last, since = -1, time.monotonic()
            while not done.wait(_WATCH_S):
                stats = cache.stats()
                if not stats.producers_waiting or stats.emitted != last:
                    last, since = stats.emitted, time.monotonic()
                elif time.monotonic() - since > _STUCK_S:
                    stuck.set()
                    cache.close()
                    return

        watcher = threading.Thread(target=watch, name="echopipe-fill-watch", daemon=True)
        watcher.start()
        try:
            self.step()
        except Exception:
            if stuck.is_set():
                raise self._too_small(cache.stats()) from None
            raise
        finally:
            done.set()
            watcher.join()

    def _too_small(self, stats: Any) -> CacheTooSmallError:
        plan = self._plan
        wanted = max(plan.shuffle_buffer, plan.batch_size)
        largest = max(self.max_sample_bytes, math.ceil(stats.bytes_used / max(stats.resident, 1)))
        need = (wanted + plan.upstream_batch_size) * largest
        return CacheTooSmallError(
            f"cache_bytes={stats.capacity_bytes} holds only {stats.resident} samples of about "
            f"{largest} bytes (the largest batch's mean), but a deterministic pipeline's first "
            f"draw needs {wanted} (max(shuffle_buffer, batch_size)); raise cache_bytes to at "
            f"least {need} or lower shuffle_buffer",
            stats.resident,
            wanted,
            need,
        )

    # -- free-running thread --

    def start(self) -> None:
        if self._plan.deterministic or self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._loop, name=f"echopipe-upstream-{self._name}", daemon=True
        )
        self._thread.start()

    def _loop(self) -> None:
        flight = UpstreamFlight(self._upstream, self._plan.depth) if self._plan.depth > 1 else None
        try:
            while not self._stop.is_set():
                if self._pause_requested.is_set():
                    while flight is not None and flight.in_flight:  # a checkpoint sees them back
                        self._collect(flight)
                    self._paused.set()
                    self._stop.wait(_POLL_S)
                    continue
                self._paused.clear()
                if flight is not None:
                    self._turn(flight)
                elif self._ended:
                    self._stop.wait(_POLL_S)
                elif self._room_for(1, wait=True):
                    self.step()
        except BaseException as exc:  # reported to the consumer, which re-raises it
            if not self._stop.is_set():
                self.error = exc
                self._cache.close()
        finally:
            self._paused.set()

    def _turn(self, flight: UpstreamFlight) -> None:
        """Depth 2: start the next iteration if the epoch and the cache allow, else collect."""
        n, ahead = flight.next_count, flight.in_flight
        # Never more than the depth: DALI takes more schedule_run() calls without blocking,
        # but a parallel external_source reuses its buffers after `depth` of them.
        fits = ahead + n <= self._plan.depth and self._may_schedule(ahead + n)
        if fits and self._room_for(ahead + n, wait=ahead == 0):
            if ahead == 0:
                self._epoch_start()
            flight.schedule()
        elif ahead:
            self._collect(flight)
        elif self._ended:
            self._stop.wait(_POLL_S)
        elif not self._may_schedule(n):  # pair.upstream_depth rules this out
            raise RuntimeError(
                f"the upstream stands {self.iter_in_epoch} batches into a reader epoch of "
                f"{self._plan.iterations_per_epoch}, too near its end for DALI's first "
                f"{n} iterations"
            )

    def _may_schedule(self, through: int) -> bool:
        """Whether ``through`` iterations from the last one collected stay in this pass and,
        with epochs, in this reader epoch (the next epoch's quota waits for its first)."""
        if self._ended:
            return False
        plan = self._plan
        return plan.epochs is None or self.iter_in_epoch + through <= plan.iterations_per_epoch

    def _room_for(self, batches: int, wait: bool) -> bool:
        """Room in the cache for ``batches`` upstream batches; ``wait``: a native wait, bounded
        so that stop and pause are seen (its time is the upstream's wait for room)."""
        need = batches * self._plan.upstream_batch_size
        if not wait:
            stats = self._cache.stats()
            return stats.capacity_samples - stats.resident >= need
        t0 = time.perf_counter()
        try:
            self._cache.wait_for_room(need, 0.05)
        except TimeoutError:
            return False
        finally:
            with self._timing_lock:
                self.room_wait_s += time.perf_counter() - t0
        return True

    def _collect(self, flight: UpstreamFlight) -> None:
        got = flight.collect()
        if got is not None:  # None: an external_source ended its epoch and was reset
            outputs, cost, behind = got
            self._record(outputs, cost, timed=behind)

    def pause(
        self, timeout_s: float = 60.0, while_waiting: Callable[[], None] | None = None
    ) -> None:
        """Stops the thread between two iterations (returns at once in deterministic mode).

        An iteration may be blocked inside the sink on a cache full by bytes, which only draws
        free again: ``while_waiting`` is called every ``_PAUSE_SLICE_S`` the boundary is not
        reached, so that the caller can draw (a checkpoint stashes a downstream batch). On a
        timeout the thread is let run again before the TimeoutError.
        """
        if self._thread is None:
            return
        self._paused.clear()
        self._pause_requested.set()
        deadline = time.monotonic() + timeout_s
        while not self._paused.wait(min(_PAUSE_SLICE_S, max(deadline - time.monotonic(), 0))):
            if time.monotonic() >= deadline or self.error is not None:
                self._pause_requested.clear()
                if self.error is not None:
                    raise self.error
                raise TimeoutError(
                    f"the upstream pipeline did not reach an iteration boundary within "
                    f"{timeout_s} s"
                )
            if while_waiting is not None:
                while_waiting()
        if self.error is not None:  # it ended (failing) while it collected what was in flight
            self._pause_requested.clear()
            raise self.error

    def resume(self) -> None:
        self._pause_requested.clear()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def timing(self) -> tuple[int, float, int]:
        """``(iterations timed, their seconds, fresh samples stored)``, read consistently."""
        with self._timing_lock:
            return self.timed, self.seconds, self.fresh_in

    def supply(self) -> tuple[int, float]:
        """``(fresh samples stored, seconds waited for room)``, read consistently."""
        with self._timing_lock:
            return self.fresh_in, self.room_wait_s

    def state(self) -> dict[str, int | bool | float]:
        return {
            "fresh_in": self.fresh_in,
            "iterations": self.iterations,
            "seconds": self.seconds,
            "timed": self.timed,
            "epoch_index": self.epoch_index,
            "iter_in_epoch": self.iter_in_epoch,
            "ended": self._ended,
        }

    def load(self, state: dict[str, Any]) -> None:
        self.fresh_in = int(state["fresh_in"])
        self.iterations = int(state["iterations"])
        self.seconds = float(state.get("seconds", 0.0))
        self.timed = int(state.get("timed", self.iterations))
        self.epoch_index = int(state["epoch_index"])
        self.iter_in_epoch = int(state["iter_in_epoch"])
        self._ended = bool(state["ended"])
