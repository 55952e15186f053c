"""Ready-made DALI pipelines for ImageNet-layout JPEG folders: echo training, plain training, val.

This module is the public face of the ImageNet builders and holds the echoing training builder,
:func:`imagenet_train_pipeline`. The rest lives next to it, one idea per module:

* :mod:`echopipe.dali.imagenet_files`: the accepted folder layouts, the checked file index
  (a bad file is named or skipped before DALI opens it) and how shards are cut;
* :mod:`echopipe.dali.source_tap`: the simulated read delay and the record of recent source
  paths that names the file behind a DALI decoder failure (:class:`UpstreamTap`);
* :mod:`echopipe.dali.imagenet_graph`: the graph pieces (read, decode, augment, labels);
* :mod:`echopipe.dali.builder_checks`: the argument checks;
* :mod:`echopipe.dali.plain_builders`: the builders without echo (plain training, decode-only,
  validation).

Their public names are re-exported here and by :mod:`echopipe.dali`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ..data import ImageFolderIndex
from ..echo.config import EchoConfig
from ..echo.memory import resolve_memory
from .builder_checks import check_common, check_positive_int
from .config import EchoPipelineConfig
from .imagenet_files import (
    ReaderArgs,
    attach,
    index_imagenet_split,
    resolve_split_dir,
    train_reader_args,
)
from .imagenet_graph import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    graph_decode,
    graph_labels,
    graph_read,
    graph_train_augment,
)
from .pipeline import EchoPipeline
from .plain_builders import (
    imagenet_decode_pipeline,
    imagenet_plain_train_pipeline,
    imagenet_val_pipeline,
)
from .source_tap import UpstreamTap, explain_decode_failure, optional_tap
from .specs import AugmentSpec, EchoSpec, ReaderSpec, resolve_specs
from .tracing import current_stage
from .tracing import echo as echo_point

DEFAULT_ECHO = EchoSpec()

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImagenetEchoPipeline",
    "UpstreamTap",
    "explain_decode_failure",
    "imagenet_decode_pipeline",
    "imagenet_plain_train_pipeline",
    "imagenet_train_pipeline",
    "imagenet_val_pipeline",
    "index_imagenet_split",
    "resolve_split_dir",
]


class ImagenetEchoPipeline(EchoPipeline):
    """:class:`~echopipe.dali.EchoPipeline` that names the file when DALI's decoder fails.

    DALI reports a bad JPEG as ``nvImageCodec failure`` without a path; when the upstream fails,
    :meth:`describe_upstream_error` decodes the files of the last few upstream batches with
    Pillow, and the consumer gets a :class:`~echopipe.data.CorruptImageError` naming the culprit
    (chained to DALI's error) instead of the generic ``RuntimeError``.
    """

    upstream_tap: UpstreamTap | None = None

    def describe_upstream_error(self, error: BaseException) -> BaseException:
        """A :class:`~echopipe.data.CorruptImageError` naming the file DALI could not decode."""
        tap = self.upstream_tap
        named = error if tap is None else explain_decode_failure(tap, error)
        return named if named is not error else super().describe_upstream_error(error)

    def close(self) -> None:
        """Ends the tap's read delay first: the upstream thread that the close joins may be
        inside it, for up to a batch's ``read_delay_ms`` (seconds with a slow reader)."""
        if self.upstream_tap is not None:
            self.upstream_tap.stop()
        super().close()


def imagenet_train_pipeline(
    data_dir: str | Path | ImageFolderIndex,
    *,
    batch_size: int,
    reader: ReaderSpec | None = None,
    augment: AugmentSpec | None = None,
    echo: EchoSpec | EchoConfig | None = DEFAULT_ECHO,
    **keywords: Any,
) -> Any:
    """ImageNet-style training pipeline with data echoing.

    Graph: ``fn.readers.file`` -> [read delay / source tap] -> ``fn.decoders.image`` ->
    **echo** -> ``fn.random_resized_crop`` -> ``fn.crop_mirror_normalize`` (random mirror from
    ``fn.random.coin_flip``, ImageNet mean/std, ``CHW``). With ``echo_insert="after_augment"``
    the echo point moves after the normalisation, so repeats are identical copies (cheapest
    downstream; less diversity). Everything before the echo point runs in the upstream DALI
    pipeline on its own thread at ``upstream_batch_size``; everything after it in the downstream
    pipeline at ``batch_size``, ``echo_factor`` times as many iterations.

    Outputs ``(images, labels)``: images ``(batch_size, 3, image_size, image_size)`` float32 or
    float16 (``dtype``), labels int64 scalars (class ids, sorted folder names). Iterate with
    :class:`~echopipe.dali.EchoIterator`.

    Args:
        data_dir: dataset root holding ``train/``, or the class-folder root itself, or
            the split's :class:`~echopipe.data.ImageFolderIndex` (used as it is).
        batch_size: downstream (training) batch size.
        reader: files, shards, checks, decode and DALI threads (:class:`ReaderSpec`).
        augment: crop size, dtype and crop area (:class:`AugmentSpec`).
        echo: echo factor, placement, mode and cache (:class:`EchoSpec`, or an
            :class:`~echopipe.echo.EchoConfig` with a number for its factor); ``None`` returns the
            plain pipeline (:func:`imagenet_plain_train_pipeline`) instead.
        **keywords: any field of the three specs by name (``echo_factor=3``,
            ``read_delay_ms=2``, ``image_size=128``), applied to the spec that owns it;
            ``echo_factor=None`` is the same as ``echo=None``. See the specs for each field.

    Returns:
        An :class:`ImagenetEchoPipeline` (an :class:`~echopipe.dali.EchoPipeline` that turns
        a DALI decoder failure into a
        :class:`~echopipe.data.CorruptImageError` naming the file when it can find it), with
        attributes ``folder_index``, ``skipped_files``, ``upstream_tap`` and ``reader_name``.
    """
    reader, augment, echo = resolve_specs(reader, augment, echo, keywords)
    r, a = reader, augment
    if echo is None:
        return imagenet_plain_train_pipeline(
            data_dir, batch_size=batch_size, **asdict(r), **asdict(a)
        )
    e = echo
    shard, shards, size, dev = check_common(
        batch_size, a.image_size, r.num_threads, a.dtype, r.shard_id, r.num_shards,
        r.decode_device, r.device_id, r.on_corrupt, r.check, r.read_delay_ms, r.seed,
    )  # fmt: skip
    if e.upstream_threads is not None:
        check_positive_int("upstream_threads", e.upstream_threads)
    index = index_imagenet_split(data_dir, "train", check=r.check, on_corrupt=r.on_corrupt)
    files = train_reader_args(
        index, shard_id=shard, num_shards=shards, seed=int(r.seed), shuffle_files=r.shuffle_files,
        stick_to_shard=r.stick_to_shard, initial_fill=r.initial_fill,
    )  # fmt: skip
    if e.epochs is not None:
        # echopipe counts epochs in whole reader batches, so the last one must not wrap.
        files = ReaderArgs(**{**files.__dict__, "pad_last_batch": True})
    tap = optional_tap(r.read_delay_ms, r.track_sources, r.check, r.on_corrupt)
    pipe = ImagenetEchoPipeline(
        _echo_train_graph(files, tap, r, a, e, size),
        config=_echo_config(batch_size, r, e, shard, dev),
        num_threads=int(r.num_threads),
        device_id=dev,
        upstream_num_threads=e.upstream_threads,
        prefetch_queue_depth=r.prefetch_queue_depth,
        enable_checkpointing=e.enable_checkpointing,
    )
    return attach(pipe, index, tap)


def _echo_train_graph(
    files: ReaderArgs,
    tap: UpstreamTap | None,
    r: ReaderSpec,
    a: AugmentSpec,
    e: EchoSpec,
    size: int,
) -> Callable[[], tuple[Any, Any]]:
    """The echoing training graph: read, decode, echo, augment (or augment, then echo)."""

    def imagenet_train() -> tuple[Any, Any]:
        # The function is traced twice; the reader is pruned from the downstream trace, but a
        # python_function never is, so the tap goes into the upstream trace only.
        upstream = current_stage() != "downstream"
        jpegs, labels, _ = graph_read(files, tap if upstream else None)
        images = graph_decode(jpegs, r.decode_device)
        labels = graph_labels(labels)
        if e.echo_insert == "after_augment":
            images = graph_train_augment(images, size, a.dtype, a.random_area)
            return echo_point(images, labels)
        images, labels = echo_point(images, labels)
        return graph_train_augment(images, size, a.dtype, a.random_area), labels

    return imagenet_train


def _echo_config(
    batch_size: int, r: ReaderSpec, e: EchoSpec, shard: int, dev: int | None
) -> EchoPipelineConfig:
    """The echo cache and schedule of one rank; its seed differs per shard."""
    memory = resolve_memory(
        e.memory,
        input_device="gpu" if r.decode_device == "mixed" else "cpu",
        arena_bytes=int(e.cache_bytes),
        device_id=dev,
    )
    return EchoPipelineConfig(
        batch_size=int(batch_size),
        echo=replace(e.echo_config(), memory=memory),
        cache_samples=e.cache_samples,
        upstream_batch_size=e.upstream_batch_size,
        epochs=e.epochs,
        deterministic=e.deterministic,
        seed=int(r.seed) + shard,
    )
