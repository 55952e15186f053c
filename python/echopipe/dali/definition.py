"""``@echo_pipeline_def``: DALI's ``@pipeline_def``, with one :func:`echo` point.

A call that builds no echo point (``echo()`` under a condition that is false, e.g. the
validation call of a function with ``if is_training:``) returns the plain DALI pipeline that
``@pipeline_def`` would return.

It is used the way ``@pipeline_def`` is: bare or with arguments, and every argument of the
decorator, every ``nvidia.dali.Pipeline`` argument (``batch_size``, ``num_threads``,
``device_id``, ``seed``, ``prefetch_queue_depth``, ``enable_checkpointing``, ``checkpoint``,
``exec_dynamic``, ...) and every echo option can also be given when the decorated function is
called. Keywords the pipeline function itself declares go to the function.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import secrets
from collections.abc import Callable
from typing import Any

from ..echo.config import EchoConfig, check_factor
from .builder_checks import MAX_PAIR_SEED
from .config import EchoPipelineConfig
from .pipeline import EchoPipeline
from .state_check import DaliStateError
from .state_codec import MAGIC
from .tracing import trace_counting_echo

#: Echo options and their defaults (see :func:`echo_pipeline_def`).
ECHO_DEFAULTS: dict[str, Any] = dict(
    batch_size=None,
    num_threads=2,
    device_id=None,
    echo_factor=2.0,
    mode="example",
    shuffle_buffer=None,
    cache_samples=None,
    cache_bytes=256 << 20,
    upstream_batch_size=None,
    upstream_num_threads=None,
    epochs="auto",
    deterministic=False,
    seed=0,
    memory="auto",
    prefetch_queue_depth=2,
    enable_checkpointing=False,
    on_upstream_error=None,
)
#: The keywords that make the :class:`~echopipe.echo.EchoConfig`, and its field each sets.
_ECHO_KEYS = {
    "echo_factor": "factor",
    "mode": "mode",
    "shuffle_buffer": "shuffle_buffer",
    "cache_bytes": "cache_bytes",
    "memory": "memory",
}
_CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(EchoPipelineConfig) if f.name != "echo")


@functools.cache
def _dali_pipeline_params() -> frozenset[str]:
    from nvidia.dali import Pipeline

    return frozenset(inspect.signature(Pipeline.__init__).parameters) - {"self"}


def _plain_pipeline(
    func: Callable[..., Any], decorator_kwargs: dict[str, Any], args: Any, kwargs: dict[str, Any]
) -> Any:
    """The DALI pipeline ``@pipeline_def`` gives for this call when the function calls no
    :func:`echo` (e.g. ``if is_training:`` around it and ``is_training=False``), else None.

    The function is traced with DALI's own ``pipeline_def`` and only the DALI arguments given
    (DALI's defaults otherwise), so outputs, reader metadata and epoch size are plain DALI's.
    """
    from nvidia.dali import pipeline_def

    own = set(inspect.signature(func).parameters)
    echo_only = set(ECHO_DEFAULTS) - _dali_pipeline_params()
    dali_decorator = {k: v for k, v in decorator_kwargs.items() if k not in echo_only}
    call = {k: v for k, v in kwargs.items() if k in own or k not in echo_only}
    checkpoint = call.pop("checkpoint", None) if "checkpoint" not in own else None
    pipe, calls = trace_counting_echo(lambda: pipeline_def(func, **dali_decorator)(*args, **call))
    if calls:
        return None
    if checkpoint is not None:  # not given to the probe: it may be an echo checkpoint
        _refuse_echo_checkpoint(checkpoint)
        pipe = pipeline_def(func, **dali_decorator)(*args, checkpoint=checkpoint, **call)
    return pipe


def _refuse_echo_checkpoint(checkpoint: Any) -> None:
    """An echo pipeline's state given to a call that builds no echo point (DALI would say only
    that it failed to parse a protobuf)."""
    blob = checkpoint.encode("latin-1") if isinstance(checkpoint, str) else checkpoint
    if isinstance(blob, bytes | bytearray) and bytes(blob[: len(MAGIC)]) == MAGIC:
        raise DaliStateError(
            "checkpoint= holds an echoing pipeline's state, but this call builds no echo() "
            "point (a plain DALI pipeline, e.g. the validation call); pass it to the call that "
            "echoes, and here a checkpoint of this pipeline"
        )


def _create(
    func: Callable[..., Any], decorator_kwargs: dict[str, Any], args: Any, kwargs: dict[str, Any]
) -> Any:
    plain = _plain_pipeline(func, decorator_kwargs, args, kwargs)
    if plain is not None:
        return plain
    own = set(inspect.signature(func).parameters)
    opts = {**ECHO_DEFAULTS}
    extra: dict[str, Any] = {}
    for source in (decorator_kwargs, kwargs):
        for key in list(source):
            if source is kwargs and key in own:
                continue  # the pipeline function's own argument
            value = source[key] if source is decorator_kwargs else kwargs.pop(key)
            if key in opts:
                opts[key] = value
            elif key in _dali_pipeline_params() or source is decorator_kwargs:
                extra[key] = value
    if opts["batch_size"] is None:
        name = getattr(func, "__name__", "the pipeline function")
        raise ValueError(
            f"{name}: batch_size is required; pass it to @echo_pipeline_def(batch_size=...) or "
            f"when calling {name}(..., batch_size=...)"
        )
    checkpoint = extra.pop("checkpoint", None)
    if opts["seed"] is None or (type(opts["seed"]) is int and opts["seed"] == -1):
        # DALI's "no seed" (None, its default; -1 before it): a random one, as DALI draws
        opts["seed"] = secrets.randbelow(MAX_PAIR_SEED + 1)
    # A pipeline's factor is a number (set_echo_factor changes it between epochs): its error
    # must not offer EchoConfig's 'auto'.
    check_factor(opts["echo_factor"], "echo_factor")
    for key, field in _ECHO_KEYS.items():  # errors name the keyword, not the field
        EchoConfig.check_field(field, opts[key], key)
    echo = EchoConfig(**{field: opts[key] for key, field in _ECHO_KEYS.items()})
    config = EchoPipelineConfig(echo=echo, **{k: opts[k] for k in _CONFIG_KEYS})
    pipe = EchoPipeline(
        func,
        args,
        kwargs,
        config=config,
        num_threads=opts["num_threads"],
        device_id=opts["device_id"],
        upstream_num_threads=opts["upstream_num_threads"],
        prefetch_queue_depth=opts["prefetch_queue_depth"],
        enable_checkpointing=opts["enable_checkpointing"],
        pipeline_kwargs=extra,
        on_upstream_error=opts["on_upstream_error"],
    )
    if checkpoint is not None:
        pipe._restore_checkpoint(checkpoint)
    return pipe


def echo_pipeline_def(fn: Callable[..., Any] | None = None, **decorator_kwargs: Any) -> Any:
    """Decorator: a DALI pipeline function with one :func:`echo` call becomes an echoing pipeline.

    Use it as DALI's ``@pipeline_def``: ``@echo_pipeline_def`` or
    ``@echo_pipeline_def(echo_factor=2, ...)``, then ``pipe = train_pipe(batch_size=64,
    num_threads=4, device_id=0, seed=12)``. Calling the decorated function returns an
    :class:`EchoPipeline` (nothing runs until the first batch); it works with
    :class:`EchoIterator` and with DALI's own framework iterators. A call in which the function
    calls no :func:`echo` (it may call it under a Python condition) returns the plain
    ``nvidia.dali.Pipeline`` that DALI's ``pipeline_def`` builds from the DALI arguments given.

    Keyword arguments (decorator or call; the call wins):
        batch_size: downstream batch size (what the training loop sees). Required.
        num_threads, device_id: as in DALI (``device_id=None`` for CPU-only pipelines).
        echo_factor: e in [1, MAX_ECHO_FACTOR]; each fresh sample is emitted floor(e) or
            ceil(e) times (ceil with probability frac(e)), e.g. 2.0 or 1.5.
        mode: ``"example"`` echoes samples; ``"batch"`` echoes whole upstream batches (requires
            ``batch_size`` to be a multiple of ``upstream_batch_size``).
        shuffle_buffer: samples the cache must hold before the first draw (its min fill);
            default: 4 batches' worth (see :data:`~.config.DEFAULT_SHUFFLE_BATCHES`).
        cache_samples, cache_bytes: capacity of the cache, in samples and bytes.
        upstream_batch_size: batch size of the reader part (None: ``batch_size``; 0 is refused).
        upstream_num_threads: DALI threads of the upstream pipeline (None: ``num_threads``; 0 is
            refused).
        epochs: ``"auto"`` (default): epoch-aligned (1) with a reader that pads its last batch,
            free-running otherwise (DALI's iterators then refuse ``reader_name=`` for an
            unpadded reader).
            N: each pass of the stream is N reader epochs of this shard, each sample e times per
            epoch (an exact total for a fractional e), never padding, then the stream ends until
            ``reset()`` (DALI's iterators reset it themselves); the reader needs
            ``pad_last_batch=True``. None: one endless, free-running stream (copies cross epoch
            boundaries; iterator epochs are sample counts). See docs/dali.md, "Epochs".
        deterministic: run the upstream in lock-step with the consumer, so the output is a pure
            function of ``seed`` and the input order (also what makes checkpoints replay exactly).
        seed: seeds the cache's tickets and draws, and both DALI pipelines (default 0); None,
            DALI's "no seed" (or its older -1), draws a random one, as DALI does.
        memory: cache arena: ``"auto"`` (pinned when a GPU is present), ``"pageable"``,
            ``"pinned"`` or ``"device"`` (GPU memory, for inputs on the GPU; see
            :mod:`echopipe.echo.memory`).
        prefetch_queue_depth: downstream DALI prefetch, an int or DALI's separated queues
            ``{"cpu_size": c, "gpu_size": g}`` (forced to 1 when deterministic).
        enable_checkpointing: also checkpoint DALI's own operator states (reader position,
            random augmentation state), so checkpoints resume exactly; needed for DALI
            iterators' ``checkpoints()``.
        checkpoint: (call only) a checkpoint from a DALI iterator's ``checkpoints()`` or
            :meth:`EchoPipeline.checkpoint`; the pipeline resumes from it.
        on_upstream_error: ``callback(error) -> exception or None`` for upstream failures
            (see :meth:`EchoPipeline.describe_upstream_error`).
        other ``nvidia.dali.Pipeline`` arguments: passed to both DALI pipelines.
    """

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def create(*args: Any, **kwargs: Any) -> Any:
            return _create(func, decorator_kwargs, args, kwargs)

        return create

    if fn is not None:
        return decorate(fn)
    return decorate
