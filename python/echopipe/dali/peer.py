"""Data echoing done in Python between two DALI pipelines: the peer echopipe is measured against.

This is how a user would add echoing to DALI without echopipe: run the reading and decoding part
as its own DALI pipeline from a Python thread, copy each decoded sample into NumPy, keep the
samples in a Python shuffle buffer that hands each one out ``e`` times (``floor(e)`` or
``ceil(e)``, like echopipe's tickets), and feed a second DALI pipeline (augment + normalise)
through ``fn.external_source`` with a callable that draws a batch at a time.

The buffer is a list with random swap-pop: a take picks a random resident sample, and when its
last ticket is used the sample is swapped with the last element and popped, so draws are O(1).
Every blocking wait is bounded and ends on :meth:`PythonEchoBuffer.close`.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..echo.config import check_factor
from .builders import (
    UpstreamTap,
    check_common,
    check_positive_int,
    explain_decode_failure,
    graph_train_augment,
    imagenet_decode_pipeline,
)
from .config import DEFAULT_SHUFFLE_BATCHES
from .specs import AugmentSpec, EchoSpec, ReaderSpec, resolve_specs

__all__ = ["PythonEchoBuffer", "PythonEchoPipeline", "python_echo_train_pipeline"]

Sample = tuple[np.ndarray, ...]


class PythonEchoBuffer:
    """Bounded shuffle buffer that emits every stored sample ``floor(e)`` or ``ceil(e)`` times.

    Args:
        capacity: most samples resident at once; :meth:`put` blocks while full.
        echo_factor: mean emissions per sample, in ``[1, MAX_ECHO_FACTOR]``.
        min_fill: :meth:`take` waits until this many samples are resident (or input ended).
        seed: seeds both the ticket draws and the random picks.
    """

    def __init__(
        self, capacity: int, echo_factor: float, *, min_fill: int = 0, seed: int = 0
    ) -> None:
        self.capacity = check_positive_int("capacity", capacity)
        e = float(check_factor(echo_factor, "echo_factor"))
        if not 0 <= int(min_fill) <= self.capacity:
            raise ValueError(f"min_fill must be in [0, capacity={capacity}], got {min_fill!r}")
        self.echo_factor = e
        self.min_fill = int(min_fill)
        self._rng = random.Random(seed)
        self._items: list[list[Any]] = []  # [sample, tickets left]
        self._cond = threading.Condition()
        self._ended = False
        self._closed = False
        self.fresh = 0
        self.emitted = 0

    def _tickets(self) -> int:
        base = math.floor(self.echo_factor)
        return base + (1 if self._rng.random() < self.echo_factor - base else 0)

    def put(self, sample: Sample, timeout: float | None = None) -> bool:
        """Store one sample; ``False`` if the buffer was closed. ``TimeoutError`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._items) >= self.capacity and not self._closed:
                self._wait(deadline, "put")
            if self._closed:
                return False
            if self._ended:
                raise RuntimeError("put() after end_of_input()")
            self._items.append([sample, self._tickets()])
            self.fresh += 1
            self._cond.notify_all()
            return True

    def take(self, n: int, timeout: float | None = None) -> list[Sample]:
        """Up to ``n`` samples; fewer only at the end of input, ``[]`` once everything was emitted.

        Raises:
            RuntimeError: the buffer was closed.
            TimeoutError: nothing arrived within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[Sample] = []
        with self._cond:
            while len(out) < n:
                if self._closed:
                    raise RuntimeError("the Python echo buffer was closed")
                ready = len(self._items) >= max(1, self.min_fill) or (self._ended and self._items)
                if not ready:
                    if self._ended:
                        break
                    self._wait(deadline, "take")
                    continue
                i = self._rng.randrange(len(self._items))
                item = self._items[i]
                out.append(item[0])
                item[1] -= 1
                if item[1] == 0:
                    self._items[i] = self._items[-1]
                    self._items.pop()
                    self._cond.notify_all()
            self.emitted += len(out)
        return out

    def _wait(self, deadline: float | None, what: str) -> None:
        # Bounded waits so close() is noticed even if a notify is missed.
        left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
        if left <= 0:
            raise TimeoutError(f"Python echo buffer: {what}() timed out")
        self._cond.wait(left)

    def end_of_input(self) -> None:
        """No more puts; takes drain the remaining tickets, then return ``[]``."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def close(self) -> None:
        """Wake and fail every waiter; later puts return ``False`` and takes raise."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


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


class PythonEchoPipeline:
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
        fresh_samples: int | None,
        tap: UpstreamTap | None,
        timeout: float,
    ) -> None:
        self.upstream = upstream
        self.buffer = buffer
        self.batch_size = batch_size
        self.fresh_samples = fresh_samples
        self.upstream_tap = tap
        self._feeder = _Feeder(buffer, batch_size, timeout)
        self.downstream = make_downstream(self._feeder)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.t_up = 0.0
        self.upstream_batches = 0
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
                self.t_up += time.perf_counter() - start
                self.upstream_batches += 1
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

    def run(self) -> Any:
        """One downstream batch: ``(images, labels)`` DALI TensorLists."""
        self.build()
        return self.downstream.run()

    def stats(self) -> dict[str, float]:
        """Fresh and emitted counts, upstream batches, and seconds spent in upstream/waiting."""
        return {
            "fresh": self.buffer.fresh,
            "emitted": self.buffer.emitted,
            "upstream_batches": self.upstream_batches,
            "t_up": self.t_up,
            "t_wait": self._feeder.wait_s,
        }

    def close(self, timeout: float = 10.0) -> None:
        """Stop the upstream thread and free both pipelines."""
        self._stop.set()
        self.buffer.close()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"upstream thread did not stop within {timeout} s")
        self.downstream = None
        self.upstream = None

    def __enter__(self) -> PythonEchoPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
        r.decode_device, r.device_id, r.on_corrupt, r.check, r.read_delay_ms,
    )  # fmt: skip
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
    default_fill = DEFAULT_SHUFFLE_BATCHES * int(batch_size)
    fill = default_fill if spec.shuffle_buffer is None else int(spec.shuffle_buffer)
    capacity = check_positive_int("cache_samples", spec.cache_samples or max(1024, 2 * fill))
    fill = min(fill, capacity)
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
        fresh_samples=fresh_samples, tap=upstream.upstream_tap, timeout=timeout,
    )  # fmt: skip
    pipe.folder_index = upstream.folder_index
    pipe.skipped_files = list(upstream.skipped_files)
    return pipe
