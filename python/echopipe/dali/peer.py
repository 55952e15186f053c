"""Data echoing done in Python between two DALI pipelines: the peer echopipe is measured against.

This is how a user would add echoing to DALI without echopipe: run the reading and decoding part
as its own DALI pipeline from a Python thread, copy each decoded sample into NumPy, keep the
samples in a Python shuffle buffer that hands each one out ``e`` times (``floor(e)`` or
``ceil(e)``, like echopipe's tickets), and feed a second DALI pipeline (augment + normalise)
through ``fn.external_source`` with a callable that draws a batch at a time.

The buffer (:class:`~.peer_buffer.PythonEchoBuffer`) is a list with random swap-pop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .base import EchoPipelineBase, PipelineStats
from .builders import (
    UpstreamTap,
    check_common,
    check_positive_int,
    explain_decode_failure,
    graph_train_augment,
    imagenet_decode_pipeline,
)
from .config import DEFAULT_SHUFFLE_BATCHES
from .peer_buffer import PythonEchoBuffer
from .specs import AugmentSpec, EchoSpec, ReaderSpec, resolve_specs

__all__ = ["PythonEchoPipeline", "python_echo_train_pipeline"]


class _Feeder:
    """The ``external_source`` callable. Holds the buffer but not the pipeline (no cycle)."""

    def __init__(self, buffer: PythonEchoBuffer, batch_size: int, timeout: float) -> None:
        self.buffer = buffer
        self.batch_size = batch_size
        self.timeout = timeout
        self.error: BaseException | None = None
        self.wait_s = 0.0

    def __call__(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        start = time.perf_counter()
        try:
            samples = self.buffer.take(self.batch_size, timeout=self.timeout)
        except RuntimeError:
            if self.error is not None:
                raise RuntimeError(f"upstream pipeline failed: {self.error}") from self.error
            raise
        finally:
            self.wait_s += time.perf_counter() - start
        if not samples:
            if self.error is not None:
                raise RuntimeError(f"upstream pipeline failed: {self.error}") from self.error
            raise StopIteration
        return [s[0] for s in samples], [s[1] for s in samples]


class PythonEchoPipeline(EchoPipelineBase):
    """Upstream DALI pipeline -> Python thread -> :class:`PythonEchoBuffer` -> downstream pipeline.

    Use :meth:`run` like ``Pipeline.run`` (it starts the upstream thread on first use); it raises
    ``StopIteration`` after ``fresh_samples`` fresh samples have each been emitted. Always
    :meth:`close` (or use ``with``).
    """

    def __init__(
        self,
        upstream: Any,
        make_downstream: Callable[[_Feeder], Any],
        buffer: PythonEchoBuffer,
        *,
        batch_size: int,
        upstream_batch_size: int,
        fresh_samples: int | None,
        tap: UpstreamTap | None,
        timeout: float,
    ) -> None:
        self.upstream = upstream
        self.buffer = buffer
        self._batch_size = batch_size
        self._upstream_batch_size = upstream_batch_size
        self.fresh_samples = fresh_samples
        self.upstream_tap = tap
        self._feeder = _Feeder(buffer, batch_size, timeout)
        self.downstream = make_downstream(self._feeder)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._timing_lock = threading.Lock()
        self._t_up_total_s = 0.0
        self._upstream_batches = 0
        self.downstream_wait_s = 0.0
        self.folder_index: Any = None
        self.skipped_files: list[tuple[str, str]] = []

    def build(self) -> None:
        """Build both pipelines and start the upstream thread (idempotent)."""
        if self._thread is not None:
            return
        self.upstream.build()
        self.downstream.build()
        self._thread = threading.Thread(target=self._produce, name="python-echo-up", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        limit = self.fresh_samples
        stored = 0
        try:
            while not self._stop.is_set() and (limit is None or stored < limit):
                start = time.perf_counter()
                outputs = self.upstream.run()
                with self._timing_lock:
                    self._t_up_total_s += time.perf_counter() - start
                    self._upstream_batches += 1
                images, labels = outputs[0], outputs[1]
                for i in range(len(images)):
                    if limit is not None and stored >= limit:
                        break
                    # np.array copies out of DALI's buffers, which the next run() reuses.
                    sample = (np.array(images[i]), np.array(labels[i]))
                    if not self.buffer.put(sample):
                        return
                    stored += 1
            self.buffer.end_of_input()
        except BaseException as exc:
            err: BaseException = exc
            if self.upstream_tap is not None:
                err = explain_decode_failure(self.upstream_tap, exc)
            self._feeder.error = err
            self.buffer.close()

    @property
    def batch_size(self) -> int:
        """The downstream batch size."""
        return self._batch_size

    @property
    def upstream_batch_size(self) -> int:
        """The reader's batch size."""
        return self._upstream_batch_size

    @property
    def echo_factor(self) -> float:
        """Mean copies of each fresh sample."""
        return self.buffer.echo_factor

    def run(self) -> Any:
        """One downstream batch: ``(images, labels)`` DALI TensorLists."""
        self.build()
        start = time.perf_counter()
        try:
            return self.downstream.run()
        finally:
            self.downstream_wait_s += time.perf_counter() - start

    def upstream_time(self) -> tuple[int, float]:
        """``(upstream batches run, seconds they took)`` so far."""
        with self._timing_lock:
            return self._upstream_batches, self._t_up_total_s

    def stats(self) -> PipelineStats:
        """Counters and timing so far (see :class:`PipelineStats`); the peer has no epochs,
        no deterministic mode and no resets, so those fields stay 0."""
        batches, seconds = self.upstream_time()
        resident, tickets_left, histogram = self.buffer.counts()
        return PipelineStats(
            fresh_in=self.buffer.fresh,
            emitted=self.buffer.emitted,
            resident=resident,
            tickets_left=tickets_left,
            upstream_batches=batches,
            t_up_total_s=seconds,
            t_up_per_batch_s=self.upstream_step_seconds(),
            downstream_wait_s=self.downstream_wait_s,
            emit_histogram=histogram,
            source_wait_s=self._feeder.wait_s,
        )

    def close(self, timeout: float = 10.0) -> None:
        """Stop the upstream thread and free both pipelines."""
        self._stop.set()
        if self.upstream_tap is not None:  # (its read delay would hold the thread's end)
            self.upstream_tap.stop()
        self.buffer.close()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"upstream thread did not stop within {timeout} s")
        self.downstream = None
        self.upstream = None


def _peer_sizes(r: ReaderSpec, spec: EchoSpec, batch_size: int) -> tuple[int, int, int, int]:
    """``(upstream batch size, upstream threads, min fill, capacity)`` of the peer; ValueError
    names an option the peer cannot honour."""
    unsupported = {
        "decode_device": (r.decode_device, "cpu"),
        "echo_insert": (spec.echo_insert, "after_decode"),
        "echo_mode": (spec.echo_mode, "example"),
        "epochs": (spec.epochs, None),
        "deterministic": (spec.deterministic, False),
    }
    for name, (value, only) in unsupported.items():
        if value != only:
            raise ValueError(f"the Python echo peer supports only {name}={only!r}, got {value!r}")
    up_batch = check_positive_int("upstream_batch_size", spec.upstream_batch_size or batch_size)
    upstream_threads = check_positive_int("upstream_threads", spec.upstream_threads or 1)
    default_fill = DEFAULT_SHUFFLE_BATCHES * batch_size
    fill = default_fill if spec.shuffle_buffer is None else int(spec.shuffle_buffer)
    capacity = check_positive_int("cache_samples", spec.cache_samples or max(1024, 2 * fill))
    fill = min(fill, capacity)
    return up_batch, upstream_threads, fill, capacity


def python_echo_train_pipeline(
    data_dir: str | Path,
    *,
    batch_size: int,
    reader: ReaderSpec | None = None,
    augment: AugmentSpec | None = None,
    echo: EchoSpec | None = None,
    fresh_samples: int | None = None,
    timeout: float = 60.0,
    **keywords: Any,
) -> PythonEchoPipeline:
    """The echo-after-decode training pipeline, with the echo done in Python (the peer).

    Same graph and outputs as :func:`~echopipe.dali.builders.imagenet_train_pipeline` with
    ``echo_insert="after_decode"``: reader -> [read delay] -> decode | Python buffer |
    ``fn.external_source`` -> random resized crop -> flip + normalise (``CHW``). It takes the
    same :class:`ReaderSpec`, :class:`AugmentSpec` and :class:`EchoSpec` (or their fields as
    keywords), so a comparison passes one set of values to both.

    From the :class:`EchoSpec`: ``echo_factor``; ``cache_samples`` is the buffer's capacity
    (default ``max(1024, 2 * shuffle_buffer)``); ``shuffle_buffer`` the samples resident before
    the first draw (default as for echopipe, 4 batches' worth, at most the capacity);
    ``upstream_batch_size`` and ``upstream_threads`` (default 1). The peer has no byte bound
    and no checkpoints (``cache_bytes``, ``memory``, ``enable_checkpointing`` do not apply), and
    ValueError names the options it cannot honour (``echo_insert="after_augment"``,
    ``echo_mode="batch"``, ``epochs``, ``deterministic``, GPU decoding).

    Args:
        data_dir: dataset root holding ``train/``, or the class-folder root.
        batch_size: downstream (training) batch size.
        reader, augment, echo, **keywords: as for ``imagenet_train_pipeline``.
        fresh_samples: stop after this many fresh samples (``None``: run until closed).
        timeout: seconds a downstream draw may wait before ``TimeoutError``.
    """
    reader, augment, spec = resolve_specs(reader, augment, echo or EchoSpec(), keywords)
    if spec is None:
        raise ValueError("the Python echo peer needs an echo_factor (it has no plain mode)")
    r, a = reader, augment
    shard, shards, size, dev = check_common(
        batch_size, a.image_size, r.num_threads, a.dtype, r.shard_id, r.num_shards,
        r.decode_device, r.device_id, r.on_corrupt, r.check, r.read_delay_ms, r.seed,
    )  # fmt: skip
    up_batch, upstream_threads, fill, capacity = _peer_sizes(r, spec, int(batch_size))
    upstream = imagenet_decode_pipeline(
        data_dir, batch_size=up_batch, num_threads=upstream_threads, seed=r.seed,
        shard_id=shard, num_shards=shards, read_delay_ms=r.read_delay_ms,
        on_corrupt=r.on_corrupt, check=r.check, shuffle_files=r.shuffle_files,
        prefetch_queue_depth=1,
    )  # fmt: skip
    seed, dtype, random_area = int(r.seed), a.dtype, a.random_area
    echo_factor = spec.echo_factor

    from nvidia.dali import fn, pipeline_def

    def make_downstream(feeder: _Feeder) -> Any:
        @pipeline_def(batch_size=int(batch_size), num_threads=int(r.num_threads), device_id=dev,
                      seed=seed + shard + 7919)  # fmt: skip
        def downstream() -> tuple[Any, Any]:
            images, labels = fn.external_source(
                source=feeder, num_outputs=2, batch=True, layout=["HWC", None]
            )
            return graph_train_augment(images, size, dtype, random_area), labels

        return downstream()

    buffer = PythonEchoBuffer(capacity, echo_factor, min_fill=fill, seed=seed + shard)
    pipe = PythonEchoPipeline(
        upstream, make_downstream, buffer, batch_size=int(batch_size),
        upstream_batch_size=up_batch, fresh_samples=fresh_samples, tap=upstream.upstream_tap,
        timeout=timeout,
    )  # fmt: skip
    pipe.folder_index = upstream.folder_index
    pipe.skipped_files = list(upstream.skipped_files)
    return pipe
