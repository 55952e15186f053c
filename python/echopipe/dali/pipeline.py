"""Echoing DALI pipelines: write the pipeline once, mark the echo point, get two pipelines.

``@echo_pipeline_def`` turns a DALI-style pipeline function into an :class:`EchoPipeline`. The
function is traced twice:

* **upstream** (reader, decode, and whatever precedes :func:`echo`): ``echo(*fields)`` becomes an
  ``echopipe_echo_sink`` that stores each sample in a native echo cache. The upstream pipeline
  runs at ``upstream_batch_size`` on its own thread (or, with ``deterministic=True``, in lock-step
  with the consumer), so the reader keeps its fixed batch size.
* **downstream** (everything after :func:`echo`): ``echo(*fields)`` returns the outputs of an
  ``echopipe_echo_source`` that draws ``batch_size`` samples per iteration from the cache; each
  fresh sample is emitted floor(e) or ceil(e) times. The downstream pipeline therefore runs e
  times as many iterations as the upstream one. An extra output, ``info`` (per sample int64
  ``[valid, sample_id, emission]``), tells the consumer which samples are fresh and where a finite
  stream ends (padded samples have ``valid == 0``).

Everything that waits (the sink on a full cache, the source on an empty one, the runner thread)
polls for close at least every 100 ms, and every pipeline is closed by ``close()``, by the context
manager, or at interpreter exit (``weakref.finalize``), so nothing hangs.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from ..echo.memory import resolve_memory
from . import plugin
from .config import EchoConfig, make_cache
from .dali_api import DaliPipelineApi
from .epochs import ReaderEpochs
from .host_copy import host_dense, to_numpy
from .upstream import UpstreamRunner

_STATE_VERSION = 1
_name_counter = itertools.count()


# ---- tracing -------------------------------------------------------------------------------


@dataclass
class _Trace:
    stage: str  # "upstream" | "downstream" | "probe" (a plain DALI trace that counts echo() calls)
    cache_name: str
    calls: int = 0
    num_fields: int = 0
    devices: list[str] = field(default_factory=list)
    sink: Any = None
    info: Any = None
    source_device: str | None = None


_trace = threading.local()


def current_stage() -> str | None:
    """Which part of an echoing pipeline is being traced in this thread.

    ``"upstream"`` or ``"downstream"`` while :class:`EchoPipeline` traces a pipeline function
    (it traces it once for each part), ``None`` otherwise. A pipeline function can use it to put
    operators into one part only, e.g. a ``fn.python_function`` (DALI never prunes those) that
    should run on the reader side::

        if edali.current_stage() != "downstream":
            jpegs = fn.python_function(jpegs, function=tap)
    """
    state: _Trace | None = getattr(_trace, "state", None)
    return None if state is None or state.stage == "probe" else state.stage


def trace_counting_echo(build: Callable[[], Any]) -> tuple[Any, int]:
    """Runs ``build()`` (which traces a pipeline function into a plain DALI pipeline) with
    :func:`echo` passing its fields through; returns what ``build`` returned and how many times
    the function called :func:`echo`. A pipeline function that echoes only under a condition
    (``if is_training:``) builds a plain pipeline when the condition is false."""
    state = _Trace(stage="probe", cache_name="")
    _trace.state = state
    try:
        result = build()
    finally:
        _trace.state = None
    return result, state.calls


def echo(*fields: Any, device: str | None = None) -> tuple[Any, ...]:
    """Marks the echo point inside an ``@echo_pipeline_def`` function.

    Args:
        *fields: 1 to 4 DALI data nodes that make up one sample (e.g. images, labels, metadata).
            Each may be CPU or GPU; they travel together and come back in the same order, with
            dtype, shape and layout preserved.
        device: where the fields come out downstream: ``"cpu"`` or ``"gpu"``. Default: ``"gpu"``
            if any input is on the GPU (after a ``"mixed"`` decoder), else ``"cpu"``.

    Returns:
        A tuple with one node per input field (call it as ``images, labels = echo(images,
        labels)``). In the upstream trace these are the inputs themselves; in the downstream trace
        they are the echo source's outputs.
    """
    state: _Trace | None = getattr(_trace, "state", None)
    if state is None:
        raise RuntimeError(
            "echopipe.dali.echo() can only be called inside a function decorated with "
            "@echopipe.dali.echo_pipeline_def (while echopipe traces it)"
        )
    if not 1 <= len(fields) <= 4:
        raise ValueError(f"echo() takes 1 to 4 fields per sample, got {len(fields)}")
    if device not in (None, "cpu", "gpu"):
        raise ValueError(f"echo(device=...) must be 'cpu', 'gpu' or None, got {device!r}")
    if state.stage == "probe":
        state.calls += 1
        return tuple(fields)
    plugin.load()  # the operators below exist only once the plugin is loaded
    state.calls += 1
    if state.calls > 1:
        raise RuntimeError("echo() was called more than once; a pipeline has one echo point")
    from nvidia.dali import fn

    devices = [getattr(node, "device", "cpu") for node in fields]
    state.num_fields = len(fields)
    state.devices = devices
    upstream_gpu = any(d == "gpu" for d in devices)
    if state.stage == "upstream":
        state.sink = fn.echopipe_echo_sink(
            *fields, cache_name=state.cache_name, device="gpu" if upstream_gpu else "cpu"
        )
        return tuple(fields)
    source_device = device or ("gpu" if upstream_gpu else "cpu")
    state.source_device = source_device
    outputs = fn.echopipe_echo_source(
        cache_name=state.cache_name, num_fields=len(fields), device=source_device
    )
    state.info = outputs[-1]
    return tuple(outputs[:-1])


# ---- the pipeline pair ---------------------------------------------------------------------


def _close_resources(cache: Any, runner: UpstreamRunner, cache_name: str) -> None:
    # Closing the cache first wakes a sink or source blocked inside DALI; then the thread can end.
    with contextlib.suppress(Exception):
        cache.close()
    runner.stop()
    plugin.forget(cache_name)


class EchoPipeline(DaliPipelineApi):
    """An upstream and a downstream DALI pipeline joined by a native echo cache.

    Create it with :func:`echo_pipeline_def`. Iterate it with :class:`~echopipe.dali.EchoIterator`
    (PyTorch, with echo statistics), with DALI's own ``DALIGenericIterator`` /
    ``DALIClassificationIterator`` (see :class:`~echopipe.dali.dali_api.DaliPipelineApi`), or
    call :meth:`next_batch` for raw DALI outputs. DALI pipelines are built lazily
    (by :attr:`shard_size` or :meth:`start`, at the latest on the first batch) and nothing runs
    before the first batch, so :meth:`load_state_dict` can restore a checkpoint until then.

    Args:
        on_upstream_error: optional ``callback(error) -> exception or None`` called when the
            upstream DALI pipeline fails; an exception it returns is raised to the consumer
            (chained to ``error``) instead of the default ``RuntimeError``. See
            :meth:`describe_upstream_error`.

    Attributes:
        config: the resolved :class:`EchoConfig`.
        cache_name: name of the native cache in echopipe's process-wide registry.
        cache: the :class:`echopipe.EchoCache` itself.
        downstream_wait_s: seconds the consumer waited for downstream DALI batches.
        upstream_wait_s: seconds the consumer spent filling the cache itself (deterministic
            mode only; free-running, the upstream runs on its own thread).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        fn_args: Sequence[Any] = (),
        fn_kwargs: dict[str, Any] | None = None,
        *,
        config: EchoConfig,
        num_threads: int = 2,
        device_id: int | None = None,
        upstream_num_threads: int | None = None,
        prefetch_queue_depth: int = 2,
        enable_checkpointing: bool = False,
        pipeline_kwargs: dict[str, Any] | None = None,
        on_upstream_error: Callable[[BaseException], BaseException | None] | None = None,
    ) -> None:
        plugin.load()
        self.config = config.resolved()
        if self.config.deterministic:
            prefetch_queue_depth = 1
        if not isinstance(prefetch_queue_depth, int) or prefetch_queue_depth < 1:
            raise ValueError(
                f"prefetch_queue_depth must be an int >= 1, got {prefetch_queue_depth!r}"
            )
        self._fn = fn
        self._fn_args = tuple(fn_args)
        self._fn_kwargs = dict(fn_kwargs or {})
        self._num_threads = num_threads
        self._upstream_num_threads = upstream_num_threads or num_threads
        self._device_id = device_id
        self._prefetch = prefetch_queue_depth
        self._enable_checkpointing = enable_checkpointing
        self._pipeline_kwargs = dict(pipeline_kwargs or {})
        if on_upstream_error is not None and not callable(on_upstream_error):
            raise TypeError(f"on_upstream_error must be callable, got {on_upstream_error!r}")
        self._on_upstream_error = on_upstream_error
        self.cache_name = f"echopipe-dali-{os.getpid()}-{next(_name_counter)}"
        self.cache = make_cache(self.config, self.cache_name, device_id)
        plugin.set_quota(self.cache_name, -1)
        self._runner = UpstreamRunner(self)
        self._finalizer = weakref.finalize(
            self, _close_resources, self.cache, self._runner, self.cache_name
        )
        self.upstream: Any = None
        self.downstream: Any = None
        self.num_fields = 0
        self.num_outputs = 0
        self._shard_size = 0
        self.iterations_per_epoch = 0
        self.reader_epochs: ReaderEpochs | None = None
        self._cache_epoch_size = 0
        # Set when DALI's iterators read the epoch size: they end an epoch by counting copies.
        self.counted_epochs = False
        self._scheduled = 0
        self._dali_prefetched = False
        self._input_done = False
        self._exhausted = False
        self._stash: list[tuple[list[np.ndarray], np.ndarray]] = []
        self._handed = 0  # real copies handed out in this pass
        self.copies_discarded = 0  # real copies still queued when a reset ended the pass
        self._restore: dict[str, Any] | None = None
        self._started = False
        self._closed = False
        self.upstream_wait_s = 0.0
        self.downstream_wait_s = 0.0
        self._init_dali_api()

    # -- building --

    def _trace(self, stage: str, pipe: Any) -> tuple[_Trace, list[Any]]:
        state = _Trace(stage=stage, cache_name=self.cache_name)
        _trace.state = state
        try:
            with pipe:
                result = self._fn(*self._fn_args, **self._fn_kwargs)
        finally:
            _trace.state = None
        if state.calls == 0:
            raise RuntimeError(
                f"{getattr(self._fn, '__name__', self._fn)} never called echopipe.dali.echo(); "
                "mark the echo point with `images, labels = echo(images, labels)`"
            )
        outputs = list(result) if isinstance(result, (tuple, list)) else [result]
        return state, outputs

    def _build(self) -> None:
        if self.upstream is not None:
            return
        cfg = self.config
        restore = self._restore or {}
        extra = dict(self._pipeline_kwargs)
        seed = int(extra.pop("seed", cfg.seed))
        up_kwargs: dict[str, Any] = dict(device_id=self._device_id, seed=seed, **extra)
        # Its own seed, so downstream augmentations do not replay the upstream's random numbers.
        down_kwargs: dict[str, Any] = dict(device_id=self._device_id, seed=seed + 1, **extra)
        if self._enable_checkpointing:
            up_kwargs.update(enable_checkpointing=True, checkpoint=restore.get("dali_upstream"))
            down_kwargs.update(enable_checkpointing=True, checkpoint=restore.get("dali_downstream"))
        upstream, up_state = self._build_upstream(up_kwargs)
        self._shard_size, self.iterations_per_epoch = self._epoch_geometry(upstream)
        blocks = self._epoch_units()
        if blocks != self._cache_epoch_size:
            # Exact copy totals per epoch need the cache to count the epoch's units, which only
            # the built reader tells; its sink holds the old cache, so the upstream is built again.
            self._cache_epoch_size = blocks
            self._replace_cache(self.config)
            upstream, up_state = self._build_upstream(up_kwargs)
        from nvidia.dali import Pipeline

        downstream = Pipeline(
            batch_size=cfg.batch_size,
            num_threads=self._num_threads,
            prefetch_queue_depth=self._prefetch,
            **down_kwargs,
        )
        down_state, outputs = self._trace("downstream", downstream)
        downstream.set_outputs(*outputs, down_state.info)
        downstream.build()
        # Only echopipe drives this pipeline; DALI's check against mixing its run APIs would
        # reject a checkpoint taken between a DALI iterator's steps.
        downstream.enable_api_check(False)
        self.upstream, self.downstream = upstream, downstream
        self.num_fields = up_state.num_fields
        self.num_outputs = len(outputs)

    def _build_upstream(self, up_kwargs: dict[str, Any]) -> tuple[Any, _Trace]:
        from nvidia.dali import Pipeline

        # Depth 1 upstream: when run() returns, no later iteration has touched the cache yet.
        upstream = Pipeline(
            batch_size=self.config.upstream_batch_size,
            num_threads=self._upstream_num_threads,
            prefetch_queue_depth=1,
            **up_kwargs,
        )
        up_state, _ = self._trace("upstream", upstream)
        self._place_cache(up_state.devices)
        upstream.set_outputs(up_state.sink)
        upstream.build()
        return upstream, up_state

    def _epoch_units(self) -> int:
        """The cache's ``epoch_size``: units of the first reader epoch of an epoch-aligned
        stream (samples, or upstream batches in batch mode), 0 for a free-running one."""
        if self.config.epochs is None or self.reader_epochs is None:
            return 0
        fresh = self.reader_epochs.fresh(0)
        if self.config.mode == "batch":
            return max(1, math.ceil(fresh / self.config.upstream_batch_size))
        return fresh

    def _place_cache(self, devices: list[str]) -> None:
        """``memory="auto"`` with the echo input on the GPU: the cache moves to the device arena
        when it fits (:func:`echopipe.echo.memory.choose_memory`). The trace is the first place
        that knows where the input lives; nothing has used the cache yet (DALI builds before
        anything runs, and a checkpoint is applied after the build)."""
        if self.config.memory != "auto" or "gpu" not in devices:
            return
        memory = resolve_memory(
            "auto",
            input_device="gpu",
            arena_bytes=self.config.cache_bytes,
            device_id=self._device_id,
        )
        if memory != "device":
            return
        self._replace_cache(replace(self.config, memory=memory))

    def _replace_cache(self, config: EchoConfig) -> None:
        """A new, empty cache under the same name (before anything used the old one)."""
        quota = plugin.get_quota(self.cache_name)
        self._finalizer.detach()
        self.cache.close()  # also frees its name in the registry
        self.config = config
        self.cache = make_cache(
            self.config, self.cache_name, self._device_id, epoch_size=self._cache_epoch_size
        )
        plugin.set_quota(self.cache_name, quota)
        self._finalizer = weakref.finalize(
            self, _close_resources, self.cache, self._runner, self.cache_name
        )

    @property
    def shard_size(self) -> int:
        """Fresh samples per epoch of this shard (the upstream reader's), 0 without a reader.

        Known once the DALI pipelines are built; reading it builds them (nothing runs, so a
        checkpoint can still be loaded afterwards).
        """
        if self._closed:
            raise RuntimeError("this EchoPipeline was closed")
        self._build()
        return self._shard_size

    def _epoch_geometry(self, upstream: Any) -> tuple[int, int]:
        """Fresh samples per epoch of this shard, and upstream iterations per reader epoch;
        resolves ``epochs="auto"`` (1 with a reader, endless without)."""
        meta = upstream.reader_meta()
        epochs = self.config.epochs
        if not meta:
            if epochs not in (None, "auto"):
                raise ValueError(
                    f"epochs={epochs} needs a DALI reader (fn.readers.*) before echo() to know "
                    "the epoch size; without one, leave epochs=None for an endless stream"
                )
            self.config = replace(self.config, epochs=None)
            return 0, 1 << 62
        if len(meta) > 1:
            raise ValueError(
                f"the upstream part has {len(meta)} readers ({sorted(meta)}); echopipe needs "
                "exactly one to count epochs"
            )
        ((name, m),) = meta.items()
        reader = ReaderEpochs.from_meta(name, m)
        if epochs is not None and not reader.padded:
            given = (
                "epoch-aligned echo (the default, epochs='auto')"
                if epochs == "auto"
                else (f"epochs={epochs}")
            )
            raise ValueError(
                f"{given} needs the reader {name!r} to be created with pad_last_batch=True, so "
                "every epoch starts on a batch boundary and no sample of the next epoch is "
                "pulled into the last batch; or pass epochs=None for a free-running stream"
            )
        if epochs == "auto":
            self.config = replace(self.config, epochs=1)
        self.reader_epochs = reader
        return reader.fresh(0), reader.iterations(self.config.upstream_batch_size)

    @property
    def finite(self) -> bool:
        """True when the stream ends after ``epochs`` reader epochs (epoch-aligned, the default
        with a reader); False for the free-running stream (``epochs=None``). Builds the DALI
        pipelines (nothing runs)."""
        self.shard_size  # noqa: B018 - resolves epochs="auto" from the reader
        return self.config.epochs is not None

    def epoch_copies(self) -> int:
        """Copies of samples in one pass of an epoch-aligned stream: ``epochs`` times e times
        this shard's size (see :meth:`ReaderEpochs.copies`); 0 for a free-running stream."""
        if not self.finite:
            return 0
        cfg = self.config
        unit = cfg.upstream_batch_size if cfg.mode == "batch" else 1
        return int(cfg.epochs) * self.reader_epochs.copies(cfg.echo_factor, unit)

    def start(self) -> None:
        """Builds both DALI pipelines and starts the upstream runner (idempotent)."""
        if self._closed:
            raise RuntimeError("this EchoPipeline was closed")
        if self._started:
            return
        self._build()
        if self._restore is not None:
            self._apply_restore(self._restore)
            self._restore = None
        self._started = True
        self._runner.start()

    # -- running --

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

    def next_batch(self) -> tuple[list[Any], np.ndarray]:
        """Next downstream batch: (pipeline outputs, info ``int64[batch, 3]``).

        Outputs are DALI TensorLists, or numpy arrays for batches restored from a checkpoint.
        Raises StopIteration once a finite stream (``epochs=N``) is exhausted; call
        :meth:`reset` to start the next pass.
        """
        self.start()
        if self._stash:
            outputs, info = self._stash.pop(0)
            self._handed += int(info[:, 0].sum())
            return outputs, info
        if self._exhausted:
            raise StopIteration
        self._raise_runner_error()
        if self.config.deterministic:
            self._fill_for_next_run()
            t0 = time.perf_counter()
            self.downstream.schedule_run()
            self._scheduled += 1
        else:
            t0 = time.perf_counter()
            self._schedule_free_running()
        if self._scheduled == 0:
            self._exhausted = True
            raise StopIteration
        try:
            outputs = list(self.downstream.outputs())
        except Exception:
            self._raise_runner_error()
            raise
        self._scheduled -= 1
        self.downstream_wait_s += time.perf_counter() - t0
        info = self._end_of_stream(outputs[-1])
        if info is None:
            raise StopIteration
        if not self.config.deterministic:
            self.downstream.schedule_run()
            self._scheduled += 1
        self._handed += int(info[:, 0].sum())
        return outputs[:-1], info

    def _schedule_free_running(self) -> None:
        if self._scheduled == 0 and not self._input_done:
            # DALI prefetches the whole queue on its first schedule_run() only.
            first = not self._dali_prefetched
            self._dali_prefetched = True
            for _ in range(1 if first else self._prefetch):
                self.downstream.schedule_run()
            self._scheduled = self._prefetch

    def _fill_for_next_run(self) -> None:
        """Deterministic mode: fills the cache in this thread before a downstream iteration."""
        t0 = time.perf_counter()
        try:
            self._runner.fill()
        except Exception as exc:
            self._runner.error = exc
            raise self._upstream_failed(exc) from exc
        self.upstream_wait_s += time.perf_counter() - t0

    def _end_of_stream(self, info_list: Any) -> np.ndarray | None:
        """The batch's ``info`` as numpy, or None (and the stream marked ended) when it holds
        no real sample. Only such a batch ends the stream: in batch mode the input's short last
        unit can make a batch short while whole units are still to come."""
        info = host_dense(info_list)
        if info[:, 0].any():
            return info
        self._input_done = True
        self._exhausted = True
        return None

    def reset(self) -> None:
        """Starts the next pass of an epoch-aligned stream once this one is over: its end was
        drawn (:meth:`next_batch` raised StopIteration) or all its copies were handed out (DALI's
        iterators count the epoch and stop before the padding). A no-op otherwise, as DALI's
        iterators ignore a reset inside an epoch."""
        counted = self.counted_epochs and self._handed >= self.epoch_copies()
        ended = self._input_done or counted
        if not ended or not self._started:
            return
        self._await_pass_end()
        self.release_outputs()
        # Iterations scheduled after the end hold padding only; consume them before going on.
        while self._scheduled > 0:
            info = host_dense(self.downstream.outputs()[-1])
            self.copies_discarded += int(info[:, 0].sum())
            self._scheduled -= 1
        self._stash.clear()
        self._input_done = False
        self._exhausted = False
        self._handed = 0
        self._runner.ended = False
        self.cache.reset_input()

    def _await_pass_end(self, timeout_s: float = 600.0) -> None:
        """Lets the upstream finish the pass (its padding-only last batches included) before
        the next one starts; every copy of the pass is out, so nothing waits for the consumer."""
        deadline = time.monotonic() + timeout_s
        while not self._runner.ended:
            self._raise_runner_error()
            if self._closed:
                raise RuntimeError("this EchoPipeline was closed")
            if self.config.deterministic:
                self._fill_for_next_run()
            elif time.monotonic() > deadline:
                raise TimeoutError(
                    f"the upstream pipeline did not finish its epoch within {timeout_s} s"
                )
            else:
                time.sleep(0.005)

    # -- checkpointing --

    def state_dict(self) -> dict[str, Any]:
        """Echo state aligned with the batches handed out so far.

        Holds the cache contents (samples with tickets left, RNG and counters), the upstream
        position, batches DALI already prepared but nobody has consumed (kept as numpy arrays and
        replayed first after a restore), and DALI's own checkpoints of both pipelines when
        ``enable_checkpointing=True``. With ``deterministic=True`` a restored pipeline continues
        with exactly the same stream; otherwise it continues with no sample lost or repeated.
        """
        self.start()
        self._raise_runner_error()
        self.release_outputs()
        # Take DALI's prepared batches out first, while the upstream still feeds the cache.
        while self._scheduled > 0:
            outputs = list(self.downstream.outputs())
            self._scheduled -= 1
            info = host_dense(outputs[-1])
            arrays = [to_numpy(o) for o in outputs[:-1]]
            if int(info[:, 0].sum()) > 0:
                self._stash.append((arrays, info))
        self._runner.pause()
        try:
            state: dict[str, Any] = {
                "version": _STATE_VERSION,
                "config": asdict(self.config),
                "num_fields": self.num_fields,
                "cache": self.cache.state_dict(),
                "layouts": plugin.get_layouts(self.cache_name),
                "quota": plugin.get_quota(self.cache_name),
                "runner": self._runner.state(),
                "stash": [
                    ([a.copy() for a in arrays], info.copy()) for arrays, info in self._stash
                ],
                "input_done": self._input_done,
                "handed": self._handed,
                "upstream_wait_s": self.upstream_wait_s,
                "downstream_wait_s": self.downstream_wait_s,
            }
            if self._enable_checkpointing:
                state["dali_upstream"] = self.upstream.checkpoint()
                state["dali_downstream"] = self.downstream.checkpoint()
        finally:
            self._runner.resume()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output; must be called before the first batch."""
        if self._started:
            raise RuntimeError(
                "load_state_dict() must be called before the first batch (the DALI pipelines are "
                "built with the checkpoint)"
            )
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported echo state version {state.get('version')!r}")
        saved = state["config"]
        if self.config.epochs == "auto":
            self.shard_size  # noqa: B018 - resolves epochs from the reader, as when it was saved
        mine = asdict(self.config)
        # echo_factor is runtime state (set_echo_factor): the checkpoint's factor is adopted.
        for key in ("mode", "batch_size", "upstream_batch_size", "epochs"):
            if saved.get(key) != mine.get(key):
                raise ValueError(
                    f"checkpoint has {key}={saved.get(key)!r} but this pipeline has "
                    f"{key}={mine.get(key)!r}"
                )
        if self._enable_checkpointing and "dali_upstream" not in state:
            raise ValueError(
                "this pipeline has enable_checkpointing=True but the checkpoint carries no DALI "
                "state (it was saved with enable_checkpointing=False)"
            )
        if self._enable_checkpointing and self.upstream is not None:
            # Built early (shard_size) without DALI's checkpoints; nothing ran, so rebuild.
            self.upstream = self.downstream = None
        self.set_echo_factor(float(saved["echo_factor"]))
        self._restore = state

    def _apply_restore(self, state: dict[str, Any]) -> None:
        self.cache.load_state_dict(state["cache"])
        plugin.set_layouts(self.cache_name, list(state["layouts"]))
        plugin.set_quota(self.cache_name, int(state["quota"]))
        self._runner.load(state["runner"])
        self._stash = [(list(arrays), info) for arrays, info in state["stash"]]
        self._input_done = bool(state["input_done"])
        self._handed = int(state.get("handed", 0))
        if self._runner.ended:
            self.cache.end_of_input()
        self.upstream_wait_s = float(state.get("upstream_wait_s", state.get("t_up", 0.0)))
        self.downstream_wait_s = float(state.get("downstream_wait_s", state.get("t_down", 0.0)))

    # -- info and lifetime --

    def set_echo_factor(self, echo_factor: float) -> None:
        """Changes the echo factor while the pipeline runs (no rebuild, cached samples stay).

        Fresh samples committed to the cache after the call get floor(e) or ceil(e) tickets;
        samples already cached keep theirs, so nothing is lost or repeated extra. ``config`` is
        replaced by a copy with the new ``echo_factor`` (the iterator's epoch length of an
        endless stream is computed from it). ValueError names a value that is not a finite
        number in [1, 65535].
        """
        if self._closed:
            raise RuntimeError("this EchoPipeline was closed")
        self.cache.echo_factor = echo_factor  # validates
        self.config = replace(self.config, echo_factor=self.cache.echo_factor)

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
        (cache); ``upstream_batches`` (= ``upstream_iterations``), ``upstream_time_s`` (seconds
        in those iterations), ``upstream_epochs``, ``upstream_fresh_stored``; ``t_up``
        (:meth:`upstream_step_seconds`); ``upstream_wait_s`` and ``downstream_wait_s`` (see the
        attributes).
        """
        s = self.cache.stats()
        batches, seconds, stored = self._runner.timing()
        return {
            "fresh_in": int(s.fresh_in),
            "emitted": int(s.emitted),
            "resident": int(s.resident),
            "tickets_left": int(s.tickets_left),
            "upstream_batches": batches,
            "upstream_iterations": batches,
            "upstream_time_s": seconds,
            "upstream_epochs": self._runner.epoch_index,
            "upstream_fresh_stored": stored,
            "t_up": self._per_step(batches, seconds),
            "upstream_wait_s": self.upstream_wait_s,
            "downstream_wait_s": self.downstream_wait_s,
            "emit_histogram": list(s.emit_histogram),
        }

    @property
    def upstream_alive(self) -> bool:
        """True while the free-running upstream thread is alive."""
        return self._runner.alive

    def close(self) -> None:
        """Closes the cache (waking every blocked operator) and joins the upstream thread."""
        self._closed = True
        self._finalizer()

    def __repr__(self) -> str:
        # DALI's proxy mode (DALIServer) names a pipeline it cannot take by its repr: this says
        # why and what to do instead, in that one line.
        return (
            f"EchoPipeline({self.cache_name!r}, echo_factor={self.config.echo_factor:g}): a pair "
            "of DALI pipelines joined by an echo cache, not one nvidia.dali.Pipeline; DALI's "
            "proxy mode (DALIServer) maps each output batch to one input batch, which echoing "
            "cannot keep; build the proxy pipeline without echo() and wrap the proxy's "
            "DataLoader in echopipe.torch.EchoLoader to echo its batches"
        )

    def __enter__(self) -> EchoPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
