"""The runtime of an echoing DALI pipeline: :class:`EchoPair` builds, runs and checkpoints it.

An upstream DALI pipeline stores fresh samples into a native echo cache; a downstream one draws
copies from it (see :mod:`.pipeline` for the whole picture). :class:`EchoPair` holds its parts,
each given its inputs: :func:`~.pair.build_pair`, the upstream runner (:mod:`.upstream`), the
downstream queue (:mod:`.queue`), checkpoints (functions of :mod:`.checkpointing`) and the
passes (functions of :mod:`.epochs`). :class:`~.pipeline.EchoPipeline` adds the methods DALI's
iterators call.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from . import plugin
from .base import EchoPipelineBase
from .builder_checks import positive_or_default
from .checkpointing import apply_state, capture_state, check_shard, check_state
from .config import EchoPipelineConfig, make_cache
from .epochs import ReaderEpochs
from .pair import PairSettings, build_pair
from .passes import EpochPasses
from .queue import DownstreamQueue
from .upstream import UpstreamPlan, UpstreamRunner

_name_counter = itertools.count()


class UpstreamResources:
    """What closing a pipeline frees: its cache and its runner. The finalizer holds this, not
    the pipeline, so it sees a cache or a runner the pipeline replaced."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.runner: UpstreamRunner | None = None

    def close(self) -> None:
        # Closing the cache first wakes a sink or source blocked inside DALI; then the thread
        # can end.
        with contextlib.suppress(Exception):
            self.cache.close()
        if self.runner is not None:
            self.runner.stop()


class EchoPair(EpochPasses, EchoPipelineBase):
    """An upstream and a downstream DALI pipeline joined by a native echo cache (see
    :class:`~.pipeline.EchoPipeline`, which is this plus DALI's pipeline interface)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        fn_args: Sequence[Any] = (),
        fn_kwargs: dict[str, Any] | None = None,
        *,
        config: EchoPipelineConfig,
        num_threads: int = 2,
        device_id: int | None = None,
        upstream_num_threads: int | None = None,
        prefetch_queue_depth: int | dict[str, int] = 2,
        enable_checkpointing: bool = False,
        pipeline_kwargs: dict[str, Any] | None = None,
        on_upstream_error: Callable[[BaseException], BaseException | None] | None = None,
    ) -> None:
        plugin.load()
        self.config = config.resolved()
        if self.config.deterministic:
            prefetch_queue_depth = 1
        self._device_id = device_id
        # The iterations DALI's first schedule_run() prefetches (the downstream queue's depth).
        self._prefetch = prefetch_depth(prefetch_queue_depth)
        self._enable_checkpointing = enable_checkpointing
        if on_upstream_error is not None and not callable(on_upstream_error):
            raise TypeError(f"on_upstream_error must be callable, got {on_upstream_error!r}")
        self._on_upstream_error = on_upstream_error
        self.cache_name = f"echopipe-dali-{os.getpid()}-{next(_name_counter)}"
        self._settings = PairSettings(
            fn=fn,
            fn_args=tuple(fn_args),
            fn_kwargs=dict(fn_kwargs or {}),
            cache_name=self.cache_name,
            num_threads=num_threads,
            upstream_num_threads=positive_or_default(
                "upstream_num_threads", upstream_num_threads, num_threads
            ),
            device_id=device_id,
            prefetch=prefetch_queue_depth,
            enable_checkpointing=enable_checkpointing,
            pipeline_kwargs=dict(pipeline_kwargs or {}),
        )
        self.cache = make_cache(self.config, self.cache_name, device_id)
        self.cache.quota = -1
        # Made once the DALI pipelines are built (it runs the upstream one into the cache).
        self._runner: UpstreamRunner | None = None
        self._resources = UpstreamResources(self.cache)
        weakref.finalize(self, self._resources.close)
        self.upstream: Any = None
        self.downstream: Any = None
        self.num_fields = 0
        self.num_outputs = 0
        self._shard_size = 0
        self.iterations_per_epoch = 0
        self.reader_epochs: ReaderEpochs | None = None
        # The reader's name when epochs="auto" fell back to free-running (no pad_last_batch).
        self.unaligned_reader: str | None = None
        self._cache_epoch_size = 0
        # Where the pass stands (see EpochPasses, which documents each).
        self._pass_goes_on = self._end_reported = self._passes_counted = self._pass_pending = False
        # The downstream's scheduling state, made with the DALI pipelines.
        self._queue: DownstreamQueue | None = None
        self._restore: dict[str, Any] | None = None
        self._started = False
        self._closed = False
        self.upstream_wait_s = 0.0

    # -- building --

    def _build(self) -> None:
        if self.upstream is not None:
            return
        if self._closed:
            # Its cache is gone from the registry: DALI's build of the sink would fail in many
            # lines of C++ context.
            raise RuntimeError("this EchoPipeline was closed")
        pair = build_pair(
            self._settings,
            self.config,
            self._cache_epoch_size,
            self._restore or {},
            self._replace_cache,
        )
        self.config = cfg = pair.config
        self._cache_epoch_size = pair.cache_epoch_size
        geometry = pair.geometry
        self.reader_epochs, self.unaligned_reader = geometry.reader, geometry.unaligned_reader
        self._shard_size, self.iterations_per_epoch = geometry.shard_size, geometry.iterations
        self.upstream, self.downstream = pair.upstream, pair.downstream
        self.num_fields, self.num_outputs = pair.num_fields, pair.num_outputs
        plan = UpstreamPlan(
            batch_size=cfg.batch_size,
            upstream_batch_size=cfg.upstream_batch_size,
            shuffle_buffer=cfg.echo.shuffle_buffer,
            epochs=cfg.epochs,
            deterministic=cfg.deterministic,
            iterations_per_epoch=self.iterations_per_epoch,
            reader_epochs=self.reader_epochs,
            depth=pair.depth,
        )
        if self._runner is not None:  # built before without DALI's checkpoints; never started
            self._runner.stop()
        self._runner = self._resources.runner = UpstreamRunner(
            self.cache, self.upstream, plan, self.cache_name
        )
        self._queue = DownstreamQueue(
            self.downstream,
            self._prefetch,
            cfg.deterministic,
            fill=_weakly(self._fill_for_next_run),
            check_upstream=_weakly(self._raise_runner_error),
            pass_batches=_weakly(self._padded_pass_batches),
        )

    def _replace_cache(self, config: EchoPipelineConfig, epoch_size: int) -> None:
        """A new, empty cache under the same name (before anything used the old one)."""
        quota = self.cache.quota
        self.cache.close()  # also frees its name in the registry
        self.config = config
        self.cache = make_cache(self.config, self.cache_name, self._device_id, epoch_size)
        self.cache.quota = quota
        self._resources.cache = self.cache

    @property
    def shard_size(self) -> int:
        """Fresh samples per epoch of this shard (the upstream reader's), 0 without a reader.

        Known once the DALI pipelines are built; reading it builds them (nothing runs, so a
        checkpoint can still be loaded afterwards), and still after :meth:`close` (Lightning's
        teardown reads ``len()`` after the hooks that close the pipeline)."""
        if self._closed and self.upstream is None:
            raise RuntimeError("this EchoPipeline was closed")
        self._build()
        return self._shard_size

    def start(self) -> None:
        """Builds both DALI pipelines and starts the upstream runner (idempotent).

        In a fork of the process that made the pipeline (a ``DataLoader`` worker) it raises
        :class:`~echopipe.echo.CacheForkedError`, as every use of the running pipeline does: the
        fork's copy of its cache is private, and its DALI and runner threads do not exist there.
        """
        if self._closed:
            raise RuntimeError("this EchoPipeline was closed")
        self.cache.check_process()
        if self._started:
            return
        self._build()
        if self._restore is not None:
            runner, queue = self._built_parts()
            self.upstream_wait_s = apply_state(self._restore, self.cache, runner, queue)
            self._pass_pending = bool(self._restore.get("pass_pending", False))
            self._restore = None
        self._started = True
        self._built_parts()[0].start()

    # -- running --

    def next_batch(self) -> tuple[list[Any], np.ndarray]:
        """Next downstream batch: (pipeline outputs, info ``int64[batch, 3]``).

        Outputs are DALI TensorLists, or numpy arrays for batches restored from a checkpoint.
        Raises StopIteration once a finite stream (``epochs=N``) is exhausted; call
        :meth:`reset` to start the next pass.
        """
        queue = self._running_queue()
        self._begin_pass()
        return queue.next_batch()

    def _running_queue(self) -> DownstreamQueue:
        self.start()
        return self._built_parts()[1]

    def _fill_for_next_run(self) -> None:
        """Deterministic mode: fills the cache in this thread before a downstream iteration."""
        t0 = time.perf_counter()
        try:
            self._built_parts()[0].fill()
        except Exception as exc:
            raise self._upstream_failed(exc) from exc
        self.upstream_wait_s += time.perf_counter() - t0

    # -- checkpoints --

    def state_dict(self) -> dict[str, Any]:
        """Echo state aligned with the batches handed out so far.

        Holds the cache contents (samples with tickets left, RNG and counters), the upstream
        position, batches DALI already prepared but nobody has consumed (kept as numpy arrays and
        replayed first after a restore), and DALI's own checkpoints of both pipelines when
        ``enable_checkpointing=True``. With ``deterministic=True`` a restored pipeline continues
        with exactly the same stream; otherwise it continues with no sample lost or repeated.
        """
        queue = self._running_queue()
        self._raise_runner_error()
        return capture_state(
            config=self.config,
            num_fields=self.num_fields,
            cache=self.cache,
            runner=self._built_parts()[0],
            queue=queue,
            upstream_wait_s=self.upstream_wait_s,
            dali_pipelines=(self.upstream, self.downstream) if self._enable_checkpointing else None,
            reader=self.reader_epochs,
            pass_pending=self._pass_pending,
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output; must be called before the first batch."""
        if self._started:
            raise RuntimeError(
                "load_state_dict() must be called before the first batch (the DALI pipelines are "
                "built with the checkpoint)"
            )
        if self.config.epochs == "auto" or "reader" in state:
            _ = self.shard_size  # resolves epochs, as when saved, and the reader's shard
        factor = check_state(state, self.config, self._enable_checkpointing)
        check_shard(state, self.reader_epochs)
        if self._enable_checkpointing and self.upstream is not None:
            # Built early (shard_size) without DALI's checkpoints; nothing ran, so rebuild.
            self.upstream = self.downstream = None
        self.set_echo_factor(factor)
        self._restore = state

    # -- info and lifetime --

    def set_echo_factor(self, echo_factor: float) -> None:
        """Changes the echo factor while the pipeline runs (no rebuild, cached samples stay).

        Fresh samples committed to the cache after the call get floor(e) or ceil(e) tickets;
        samples already cached keep theirs, so nothing is lost or repeated extra. ``config`` is
        replaced by a copy with the new factor (the iterator's epoch length of an
        endless stream is computed from it). EchoConfigError (a ValueError) names a value that
        is not a finite number in [1, MAX_ECHO_FACTOR].
        """
        if self._closed:
            raise RuntimeError("this EchoPipeline was closed")
        self.cache.echo_factor = echo_factor  # validates
        echo = replace(self.config.echo, factor=self.cache.echo_factor)
        self.config = replace(self.config, echo=echo)

    @property
    def downstream_wait_s(self) -> float:
        """Seconds the consumer waited for downstream DALI batches."""
        return 0.0 if self._queue is None else self._queue.wait_s

    @property
    def copies_discarded(self) -> int:
        """Real copies of a pass that a reset ended before they were handed out (see
        :class:`PipelineStats`)."""
        return 0 if self._queue is None else self._queue.copies_discarded

    @property
    def upstream_alive(self) -> bool:
        """True while the free-running upstream thread is alive."""
        return self._runner is not None and self._runner.alive

    def close(self) -> None:
        """Closes the cache (waking every blocked operator) and joins the upstream thread."""
        self._closed = True
        self._resources.close()

    # -- the upstream's reports --

    def _built_parts(self) -> tuple[UpstreamRunner, DownstreamQueue]:
        if self._runner is None or self._queue is None:
            raise RuntimeError("the DALI pipelines are not built yet (call build())")
        return self._runner, self._queue

    @property
    def upstream_batch_size(self) -> int:
        """The reader's batch size (samples per upstream iteration)."""
        return int(self.config.upstream_batch_size)

    @property
    def echo_factor(self) -> float:
        """The current echo factor (:meth:`set_echo_factor`)."""
        return float(self.config.echo.factor)

    def describe_upstream_error(self, error: BaseException) -> BaseException:
        """The exception the consumer gets when the upstream DALI pipeline raised ``error``
        (the caller chains it to ``error``): what the ``on_upstream_error`` callback returned,
        else a ``RuntimeError`` saying the upstream failed, and why in one line where the cache
        refused a sample larger than its arena (DALI's own trace of it runs to many lines).
        Subclasses override it to name the cause (the ImageNet builders name the file DALI's
        decoder rejected)."""
        if self._on_upstream_error is not None:
            described = self._on_upstream_error(error)
            if described is not None:
                return described
        refused = self.cache.refused_sample
        return RuntimeError(f"the upstream DALI pipeline failed: {refused or error}")

    def _upstream_failed(self, error: BaseException) -> BaseException:
        described = self.describe_upstream_error(error)
        if described is not error and described.__cause__ is None:
            described.__cause__ = error
        return described

    def _raise_runner_error(self) -> None:
        error = None if self._runner is None else self._runner.error
        if error is not None:
            raise self._upstream_failed(error)


def prefetch_depth(prefetch_queue_depth: Any) -> int:
    """The iterations DALI keeps scheduled for ``prefetch_queue_depth``, an int or DALI's
    separated queues, ``{"cpu_size": c, "gpu_size": g}`` (it prefetches ``max(c, g)`` then);
    ValueError names any other value."""
    if isinstance(prefetch_queue_depth, dict):
        sizes = [prefetch_queue_depth.get(k) for k in ("cpu_size", "gpu_size")]
        if set(prefetch_queue_depth) == {"cpu_size", "gpu_size"} and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes
        ):
            return max(sizes)  # type: ignore[type-var]
    elif (
        isinstance(prefetch_queue_depth, int)
        and not isinstance(prefetch_queue_depth, bool)
        and prefetch_queue_depth >= 1
    ):
        return prefetch_queue_depth
    raise ValueError(
        "prefetch_queue_depth must be an int >= 1 or DALI's "
        f'{{"cpu_size": int >= 1, "gpu_size": int >= 1}}, got {prefetch_queue_depth!r}'
    )


def _weakly(method: Callable[[], Any]) -> Callable[[], Any]:
    """``method`` called through a weak reference to its object. The queue a pipeline holds
    must not hold the pipeline: a dropped one (Lightning drops the iterator it reloads every
    epoch) then waited for the cyclic collector with its upstream thread running and its cache
    allocated, one more per epoch, instead of closing at once (its ``weakref.finalize``)."""
    ref = weakref.WeakMethod(method)

    def call() -> Any:
        bound = ref()
        if bound is None:  # (only a queue kept past its pipeline gets here)
            raise RuntimeError("this EchoPipeline was garbage-collected")
        return bound()

    return call
