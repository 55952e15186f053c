"""Building the two DALI pipelines of an :class:`~echopipe.dali.EchoPipeline` from one function.

:func:`build_pair` traces the pipeline function once per part (:mod:`.tracing`), learns the
reader's epochs from the built upstream (:func:`~.epochs.epoch_geometry`), and asks the caller
for a new cache when the built pipeline shows the cache must be another one (an arena on the
device, or exact copy totals per epoch). It holds no state: everything comes in as arguments
and goes out in a :class:`BuiltPair`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..echo.memory import resolve_memory
from .config import EchoPipelineConfig, slots_needed
from .epochs import EpochGeometry, epoch_geometry
from .tracing import Trace, trace


@dataclass(frozen=True)
class PairSettings:
    """How the DALI pipelines are made: the function and DALI's own settings."""

    fn: Callable[..., Any]
    fn_args: Sequence[Any]
    fn_kwargs: dict[str, Any]
    cache_name: str
    num_threads: int
    upstream_num_threads: int
    device_id: int | None
    prefetch: int | dict[str, int]  # as given to DALI: an int or separated queues
    enable_checkpointing: bool
    pipeline_kwargs: dict[str, Any]


@dataclass(frozen=True)
class BuiltPair:
    """The built pipelines and what building them resolved."""

    upstream: Any
    downstream: Any
    num_fields: int
    num_outputs: int
    geometry: EpochGeometry
    config: EchoPipelineConfig  # epochs resolved, memory placed
    cache_epoch_size: int
    depth: int  # the upstream's prefetch_queue_depth (upstream_depth)


#: Called with the config and epoch size a new, empty cache under the same name must have.
ReplaceCache = Callable[[EchoPipelineConfig, int], None]


def trace_stage(settings: PairSettings, stage: str, pipe: Any) -> tuple[Trace, list[Any]]:
    """The function traced into ``pipe`` as part ``stage``; its outputs as a list."""

    def build() -> Any:
        with pipe:
            return settings.fn(*settings.fn_args, **settings.fn_kwargs)

    state, result = trace(Trace(stage=stage, cache_name=settings.cache_name), build)
    if state.calls == 0:
        name = getattr(settings.fn, "__name__", settings.fn)
        raise RuntimeError(
            f"{name} never called echopipe.dali.echo(); "
            "mark the echo point with `images, labels = echo(images, labels)`"
        )
    outputs = list(result) if isinstance(result, (tuple, list)) else [result]
    return state, outputs


def build_pair(
    settings: PairSettings,
    config: EchoPipelineConfig,
    cache_epoch_size: int,
    restore: dict[str, Any],
    replace_cache: ReplaceCache,
) -> BuiltPair:
    """Builds both DALI pipelines (nothing runs), with DALI's checkpoints from ``restore``."""
    from nvidia.dali import Pipeline

    extra = dict(settings.pipeline_kwargs)
    seed = int(extra.pop("seed", config.seed))
    up_kwargs: dict[str, Any] = dict(device_id=settings.device_id, seed=seed, **extra)
    # Its own seed, so downstream augmentations do not replay the upstream's random numbers.
    down_kwargs: dict[str, Any] = dict(device_id=settings.device_id, seed=seed + 1, **extra)
    if settings.enable_checkpointing:
        up_kwargs.update(enable_checkpointing=True, checkpoint=restore.get("dali_upstream"))
        down_kwargs.update(enable_checkpointing=True, checkpoint=restore.get("dali_downstream"))

    def build_upstream(
        cfg: EchoPipelineConfig, depth: int
    ) -> tuple[Any, Trace, EchoPipelineConfig]:
        upstream = Pipeline(
            batch_size=cfg.upstream_batch_size,
            num_threads=settings.upstream_num_threads,
            prefetch_queue_depth=depth,
            **up_kwargs,
        )
        up_state, _ = trace_stage(settings, "upstream", upstream)
        placed = _placed(cfg, up_state.devices, settings.device_id)
        if placed is not cfg:
            replace_cache(placed, cache_epoch_size)
        upstream.set_outputs(up_state.sink)
        upstream.build()
        return upstream, up_state, placed

    depth = upstream_depth(config, settings, None, restore)
    upstream, up_state, config = build_upstream(config, depth)
    # An input that can end its epoch (external_source with a source): DALI's first schedule
    # after its reset starts `depth` iterations again, wherever the reader's epoch stands.
    resets = bool(getattr(upstream, "_input_callbacks", None))
    geometry = epoch_geometry(upstream.reader_meta(), config.epochs, config.upstream_batch_size)
    config = replace(config, epochs=geometry.epochs)
    blocks = geometry.units(config.echo.mode, config.upstream_batch_size)
    built_depth, depth = depth, upstream_depth(config, settings, geometry, restore, resets)
    if blocks != cache_epoch_size or depth != built_depth:
        # Exact copy totals per epoch need the cache to count the epoch's units, and the depth
        # the reader's epochs, which only the built reader tells; the sink holds the old
        # cache, so the upstream is built again (with a new cache if the units differ).
        if blocks != cache_epoch_size:
            cache_epoch_size = blocks
            replace_cache(config, cache_epoch_size)
        upstream, up_state, config = build_upstream(config, depth)
    downstream = Pipeline(
        batch_size=config.batch_size,
        num_threads=settings.num_threads,
        prefetch_queue_depth=settings.prefetch,
        **down_kwargs,
    )
    down_state, outputs = trace_stage(settings, "downstream", downstream)
    downstream.set_outputs(*outputs, down_state.info)
    downstream.build()
    # Only echopipe drives this pipeline; DALI's check against mixing its run APIs would
    # reject a checkpoint taken between a DALI iterator's steps.
    downstream.enable_api_check(False)
    return BuiltPair(
        upstream,
        downstream,
        up_state.num_fields,
        len(outputs),
        geometry,
        config,
        cache_epoch_size,
        depth,
    )


def upstream_depth(
    config: EchoPipelineConfig,
    settings: PairSettings,
    geometry: EpochGeometry | None,
    restore: dict[str, Any],
    resets: bool = False,
) -> int:
    """The upstream's ``prefetch_queue_depth``: 2, so that its next iteration runs while this
    one is collected (:mod:`echopipe.dali.upstream_flight`), unless two in flight would break
    something, then 1. ``geometry`` is ``None`` before the reader is built (the guess the first
    build makes).

    * a deterministic pipeline runs its iterations on demand, one at a time;
    * DALI's executor told not to pipeline would run the second only after the first;
    * a cache whose slots cannot hold two upstream batches beyond what the first draw waits
      for would hold the second back anyway;
    * with epochs, DALI's first ``schedule_run()`` starts two iterations, and both must lie in
      the reader epoch the runner stands in (restored from ``restore`` or at its start): the
      next epoch's quota is set only after its last is back. An input that ``resets`` (an
      ``external_source`` ending its epoch) starts two again anywhere in the reader's epoch.
      A restore at an epoch's last batch keeps depth 1 for the pipeline's life.
    """
    kwargs = settings.pipeline_kwargs
    if config.deterministic or not all(
        kwargs.get(k, True) for k in ("exec_pipelined", "exec_async")
    ):
        return 1
    # (config is resolved: its slots, shuffle buffer and upstream batch are numbers)
    up, fill = int(config.upstream_batch_size), int(config.echo.shuffle_buffer)
    if int(config.cache_samples) < slots_needed(config.batch_size, fill, up, in_flight=2):
        return 1
    if geometry is None or geometry.epochs is None:
        return 2
    if resets:
        return 1
    at = int((restore.get("runner") or {}).get("iter_in_epoch", 0))
    return 2 if geometry.reader is not None and at + 2 <= geometry.iterations else 1


def _placed(
    config: EchoPipelineConfig, devices: list[str], device_id: int | None
) -> EchoPipelineConfig:
    """``memory="auto"`` with the echo input on the GPU: the cache moves to the device arena
    when it fits (:func:`echopipe.echo.memory.choose_memory`). The trace is the first place
    that knows where the input lives; nothing has used the cache yet (DALI builds before
    anything runs, and a checkpoint is applied after the build)."""
    if config.echo.memory != "auto" or "gpu" not in devices:
        return config
    memory = resolve_memory(
        "auto", input_device="gpu", arena_bytes=config.echo.cache_bytes, device_id=device_id
    )
    if memory != "device":
        return config
    return replace(config, echo=replace(config.echo, memory=memory))
