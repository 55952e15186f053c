"""The upstream runner: runs the reader half of an :class:`EchoPipeline` into its echo cache."""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Any

from .host_copy import host_dense

if TYPE_CHECKING:
    from .pipeline import EchoPipeline

_POLL_S = 0.005


class UpstreamRunner:
    """Runs the upstream DALI pipeline: one iteration = one upstream batch into the cache.

    Free-running mode uses a daemon thread that only starts an iteration when the cache has room
    for a whole upstream batch, so the sink never blocks mid-batch and a pause (for a checkpoint)
    is reached within one iteration. Deterministic mode runs iterations on demand from the
    consumer's thread while no downstream iteration is in flight, which fixes the interleaving of
    puts and draws and so makes the stream a pure function of the seed and the input order.
    """

    def __init__(self, owner: EchoPipeline) -> None:
        self._owner = owner
        self.fresh_in = 0
        self.iterations = 0
        self.epoch_index = 0
        self.iter_in_epoch = 0
        self.ended = False
        self.error: BaseException | None = None
        self.max_sample_bytes = 0  # deterministic mode: largest sample stored, in cache bytes
        # Seconds inside upstream.run(), written by the runner thread, read by the consumer.
        self.seconds = 0.0
        self._timing_lock = threading.Lock()
        self._stop = threading.Event()
        self._pause_requested = threading.Event()
        self._paused = threading.Event()
        self._thread: threading.Thread | None = None

    # -- bookkeeping shared by both modes --

    def step(self) -> bool:
        """Runs one upstream iteration; False (and end_of_input) once a finite run is complete."""
        owner = self._owner
        cfg = owner.config
        if self.ended:
            return False
        if cfg.epochs is not None and self.iter_in_epoch == 0:
            # Only the reader epoch's own files: its padding (pad_last_batch) is never stored.
            owner.cache.quota = owner.reader_epochs.fresh(self.epoch_index)
        bytes_before = owner.cache.stats().bytes_used if cfg.deterministic else 0
        t0 = time.perf_counter()
        outputs = owner.upstream.run()
        elapsed = time.perf_counter() - t0
        stored = int(host_dense(outputs[0]).sum())
        if cfg.deterministic and stored:
            # Nothing else touches the cache meanwhile: the growth is this batch's bytes.
            grown = owner.cache.stats().bytes_used - bytes_before
            self.max_sample_bytes = max(self.max_sample_bytes, math.ceil(grown / stored))
        with self._timing_lock:
            self.fresh_in += stored
            self.iterations += 1
            self.seconds += elapsed
        self.iter_in_epoch += 1
        if self.iter_in_epoch >= owner.iterations_per_epoch:
            self.iter_in_epoch = 0
            self.epoch_index += 1
            if cfg.epochs is not None and self.epoch_index % cfg.epochs == 0:
                self.ended = True
                owner.cache.end_of_input()
        return True

    def room_for_batch(self) -> bool:
        stats = self._owner.cache.stats()
        return stats.capacity_samples - stats.resident >= self._owner.config.upstream_batch_size

    def bytes_for_batch(self) -> bool:
        """Room by bytes for one more upstream batch of samples as large as the largest yet."""
        stats = self._owner.cache.stats()
        need = self.max_sample_bytes * self._owner.config.upstream_batch_size
        return stats.capacity_bytes - stats.bytes_used >= need

    def fill(self) -> None:
        """Deterministic mode: runs upstream iterations until the cache has no room for another.

        The sink would block on a cache full by bytes while the consumer (this thread) cannot
        draw, so a batch only starts when the bytes of the largest samples so far fit; and when
        that leaves fewer samples than the first draw waits for, ValueError says so instead of
        waiting forever.
        """
        while not self.ended and self.room_for_batch() and self.bytes_for_batch():
            self.step()
        if self.ended or self.bytes_for_batch():
            return  # stopped by slots, which always leave room for the first draw
        cfg = self._owner.config
        stats = self._owner.cache.stats()
        wanted = max(cfg.echo.shuffle_buffer, cfg.batch_size)
        if stats.resident_with_tickets < wanted:
            raise ValueError(
                f"cache_bytes={stats.capacity_bytes} holds only {stats.resident} samples of up "
                f"to {self.max_sample_bytes} bytes, but a deterministic pipeline's first draw "
                f"needs {wanted} (max(shuffle_buffer, batch_size)); raise cache_bytes to at "
                f"least {(wanted + cfg.upstream_batch_size) * self.max_sample_bytes} or lower "
                "shuffle_buffer"
            )

    # -- free-running thread --

    def start(self) -> None:
        if self._owner.config.deterministic or self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._loop, name=f"echopipe-upstream-{self._owner.cache_name}", daemon=True
        )
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if self._pause_requested.is_set():
                    self._paused.set()
                    self._stop.wait(_POLL_S)
                    continue
                self._paused.clear()
                if self.ended:
                    self._stop.wait(_POLL_S)
                    continue
                try:  # a native wait (no stats() polling), bounded so stop/pause are seen
                    self._owner.cache.wait_for_room(self._owner.config.upstream_batch_size, 0.05)
                except TimeoutError:
                    continue
                self.step()
        except BaseException as exc:  # reported to the consumer, which re-raises it
            if not self._stop.is_set():
                self.error = exc
                self._owner.cache.close()
        finally:
            self._paused.set()

    def pause(self, timeout_s: float = 60.0) -> None:
        """Stops the thread between two iterations (returns at once in deterministic mode)."""
        if self._thread is None:
            return
        self._paused.clear()
        self._pause_requested.set()
        if not self._paused.wait(timeout_s):
            raise TimeoutError(
                f"the upstream pipeline did not reach an iteration boundary within {timeout_s} s "
                "(is the cache full by bytes? raise cache_bytes)"
            )

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
        """``(iterations, seconds, fresh samples stored)``, read consistently."""
        with self._timing_lock:
            return self.iterations, self.seconds, self.fresh_in

    def state(self) -> dict[str, int | bool | float]:
        return {
            "fresh_in": self.fresh_in,
            "iterations": self.iterations,
            "seconds": self.seconds,
            "epoch_index": self.epoch_index,
            "iter_in_epoch": self.iter_in_epoch,
            "ended": self.ended,
        }

    def load(self, state: dict[str, Any]) -> None:
        self.fresh_in = int(state["fresh_in"])
        self.iterations = int(state["iterations"])
        self.seconds = float(state.get("seconds", 0.0))
        self.epoch_index = int(state["epoch_index"])
        self.iter_in_epoch = int(state["iter_in_epoch"])
        self.ended = bool(state["ended"])


class UpstreamReports:
    """Mixin for :class:`EchoPipeline`: the upstream's timing, counters and errors."""

    # Set by EchoPipeline; declared here for readers and type checkers.
    config: Any
    cache: Any
    upstream_wait_s: float
    downstream_wait_s: float
    _runner: UpstreamRunner
    copies_discarded: int
    _on_upstream_error: Any

    def describe_upstream_error(self, error: BaseException) -> BaseException:
        """The exception the consumer gets when the upstream DALI pipeline raised ``error``.

        Returns what the ``on_upstream_error`` callback returned, if anything, else a
        ``RuntimeError`` saying the upstream failed. Subclasses override it to name the cause
        (the ImageNet builders name the file DALI's decoder rejected). The caller chains the
        result to ``error``.
        """
        if self._on_upstream_error is not None:
            described = self._on_upstream_error(error)
            if described is not None:
                return described
        return RuntimeError(f"the upstream DALI pipeline failed: {error}")

    def _upstream_failed(self, error: BaseException) -> BaseException:
        described = self.describe_upstream_error(error)
        if described is not error and described.__cause__ is None:
            described.__cause__ = error
        return described

    def _raise_runner_error(self) -> None:
        error = self._runner.error
        if error is not None:
            raise self._upstream_failed(error)

    def upstream_time(self) -> tuple[int, float]:
        """``(upstream batches run, seconds they took)`` so far, in either mode.

        Each upstream batch is one ``upstream.run()`` of ``upstream_batch_size`` reader samples,
        timed by the thread that runs it (restored with a checkpoint).
        """
        batches, seconds, _ = self._runner.timing()
        return batches, seconds

    def upstream_step_seconds(self) -> float:
        """``t_up``: upstream seconds per downstream batch of fresh samples (nan before any).

        The mean time of one upstream iteration (``upstream.run()``: read, decode, whatever
        precedes :func:`echo`; timed in both modes), scaled from ``upstream_batch_size`` to
        ``batch_size`` samples. With ``t_down`` the consumer's time per step, ``R = t_up /
        t_down`` is the echo factor that keeps both sides busy.
        """
        batches, seconds, _ = self._runner.timing()
        return self._per_step(batches, seconds)

    def _per_step(self, batches: int, seconds: float) -> float:
        if batches == 0:
            return math.nan
        cfg = self.config
        return seconds / batches * cfg.batch_size / cfg.upstream_batch_size

    def stats(self) -> dict[str, Any]:
        """Cache statistics plus upstream counters and timing.

        Keys: ``fresh_in``, ``emitted``, ``resident``, ``tickets_left``, ``emit_histogram``
        (cache); ``upstream_batches`` (upstream iterations run), ``upstream_time_s`` (seconds
        in them), ``upstream_epochs``, ``upstream_fresh_stored``; ``t_up``
        (:meth:`upstream_step_seconds`); ``upstream_wait_s`` and ``downstream_wait_s`` (see the
        attributes); ``copies_discarded``: real copies a reset found still queued after DALI's
        iterator had counted its epoch (0 unless the epoch length DALI was told is wrong).
        """
        s = self.cache.stats()
        batches, seconds, stored = self._runner.timing()
        return {
            "fresh_in": int(s.fresh_in),
            "emitted": int(s.emitted),
            "resident": int(s.resident),
            "tickets_left": int(s.tickets_left),
            "upstream_batches": batches,
            "upstream_time_s": seconds,
            "upstream_epochs": self._runner.epoch_index,
            "upstream_fresh_stored": stored,
            "t_up": self._per_step(batches, seconds),
            "upstream_wait_s": self.upstream_wait_s,
            "downstream_wait_s": self.downstream_wait_s,
            "copies_discarded": self.copies_discarded,
            "emit_histogram": list(s.emit_histogram),
        }
