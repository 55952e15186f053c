"""The ImageNet builders without echo: plain training, decode-only, and validation pipelines.

Each returns an ``nvidia.dali.Pipeline`` (a :class:`~echopipe.dali.naming.FileNamingPipeline`,
not built) that names the file behind a DALI decoder failure, with the folder index, skipped
files, upstream tap and reader name attached. Plain training is the "plain DALI" baseline of the
echoing builder (:func:`echopipe.dali.builders.imagenet_train_pipeline`), decode-only the
upstream of the Python echo peer, and validation the trainer's validation input. The public
names are re-exported by :mod:`echopipe.dali.builders` and :mod:`echopipe.dali`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..data import ImageFolderIndex
from .builder_checks import check_common, check_resize
from .imagenet_files import attach, index_imagenet_split, train_reader_args, val_reader_args
from .imagenet_graph import (
    graph_center_crop,
    graph_decode,
    graph_labels,
    graph_read,
    graph_train_augment,
)
from .naming import naming_pipeline
from .source_tap import UpstreamTap, optional_tap
from .specs import CheckLevel, DecodeDevice, OnCorrupt, OutputDType

__all__ = ["imagenet_decode_pipeline", "imagenet_plain_train_pipeline", "imagenet_val_pipeline"]


def imagenet_plain_train_pipeline(
    data_dir: str | Path | ImageFolderIndex,
    *,
    batch_size: int,
    image_size: int = 224,
    decode_device: DecodeDevice = "cpu",
    device_id: int | None = None,
    num_threads: int = 2,
    seed: int = 0,
    shard_id: int = 0,
    num_shards: int = 1,
    dtype: OutputDType = "float",
    read_delay_ms: float = 0.0,
    on_corrupt: OnCorrupt = "error",
    check: CheckLevel = "header",
    random_area: tuple[float, float] = (0.08, 1.0),
    shuffle_files: bool = True,
    stick_to_shard: bool = False,
    initial_fill: int = 1024,
    prefetch_queue_depth: int = 2,
    track_sources: bool = True,
) -> Any:
    """The training pipeline without echo (the "plain DALI" baseline).

    Graph: ``fn.readers.file`` -> [read delay / source tap] -> ``fn.decoders.image`` ->
    ``fn.random_resized_crop`` -> ``fn.crop_mirror_normalize`` (random mirror, ImageNet mean and
    std, ``CHW``). Outputs ``(images, labels)``: ``images`` is ``(batch, 3, image_size,
    image_size)`` float32 or float16, ``labels`` int64 scalars.

    Returns an ``nvidia.dali.Pipeline`` (not built) with extra attributes ``folder_index``
    (:class:`~echopipe.data.ImageFolderIndex`), ``skipped_files`` (``(path, reason)`` pairs),
    ``upstream_tap`` (:class:`UpstreamTap` or ``None``) and ``reader_name``.

    The arguments are those of :func:`~echopipe.dali.imagenet_train_pipeline` that apply without
    echo.
    """
    shard, shards, size, dev = check_common(
        batch_size, image_size, num_threads, dtype, shard_id, num_shards, decode_device,
        device_id, on_corrupt, check, read_delay_ms, seed,
    )  # fmt: skip
    index = index_imagenet_split(data_dir, "train", check=check, on_corrupt=on_corrupt)
    reader = train_reader_args(
        index, shard_id=shard, num_shards=shards, seed=int(seed), shuffle_files=shuffle_files,
        stick_to_shard=stick_to_shard, initial_fill=initial_fill,
    )  # fmt: skip
    tap = optional_tap(read_delay_ms, track_sources, check, on_corrupt)

    def plain_train() -> tuple[Any, Any]:
        jpegs, labels, _ = graph_read(reader, tap)
        images = graph_decode(jpegs, decode_device)
        images = graph_train_augment(images, size, dtype, random_area)
        return images, graph_labels(labels)

    pipe = naming_pipeline(
        plain_train,
        tap,
        batch_size=int(batch_size),
        num_threads=int(num_threads),
        device_id=dev,
        seed=int(seed) + shard,
        prefetch_queue_depth=prefetch_queue_depth,
    )
    return attach(pipe, index, tap)


def imagenet_decode_pipeline(
    data_dir: str | Path | ImageFolderIndex,
    *,
    batch_size: int,
    num_threads: int = 1,
    seed: int = 0,
    shard_id: int = 0,
    num_shards: int = 1,
    read_delay_ms: float = 0.0,
    on_corrupt: OnCorrupt = "error",
    check: CheckLevel = "header",
    shuffle_files: bool = True,
    prefetch_queue_depth: int = 1,
) -> Any:
    """The upstream half of the training pipeline on its own: read, [delay], decode (CPU).

    Outputs ``(images, labels)``: decoded ``HWC`` uint8 images of their own sizes and int64
    labels. This is the upstream of the Python echo peer (:mod:`echopipe.dali.peer`) and what
    ``bench/dali_echo.py`` times as "upstream alone". Attributes as for the other builders.
    """
    shard, shards, _, _ = check_common(
        batch_size, 1, num_threads, "float", shard_id, num_shards, "cpu", None, on_corrupt,
        check, read_delay_ms, seed,
    )  # fmt: skip
    index = index_imagenet_split(data_dir, "train", check=check, on_corrupt=on_corrupt)
    reader = train_reader_args(
        index, shard_id=shard, num_shards=shards, seed=int(seed), shuffle_files=shuffle_files,
        stick_to_shard=False, initial_fill=1024,
    )  # fmt: skip
    tap = UpstreamTap(read_delay_ms, check=check, on_corrupt=on_corrupt)

    def decode_only() -> tuple[Any, Any]:
        jpegs, labels, _ = graph_read(reader, tap)
        return graph_decode(jpegs, "cpu"), graph_labels(labels)

    pipe = naming_pipeline(
        decode_only,
        tap,
        batch_size=int(batch_size),
        num_threads=int(num_threads),
        device_id=None,
        seed=int(seed) + shard,
        prefetch_queue_depth=prefetch_queue_depth,
    )
    return attach(pipe, index, tap)


def imagenet_val_pipeline(
    data_dir: str | Path | ImageFolderIndex,
    *,
    batch_size: int,
    image_size: int = 224,
    resize_size: int | None = None,
    decode_device: DecodeDevice = "cpu",
    device_id: int | None = None,
    num_threads: int = 2,
    seed: int = 0,
    shard_id: int = 0,
    num_shards: int = 1,
    dtype: OutputDType = "float",
    read_delay_ms: float = 0.0,
    on_corrupt: OnCorrupt = "error",
    check: CheckLevel = "header",
    stick_to_shard: bool = True,
    prefetch_queue_depth: int = 2,
    track_sources: bool = True,
    return_paths: bool = False,
) -> Any:
    """The validation pipeline: no echo, no random augmentation.

    Graph: ``fn.readers.file`` (sorted files, no shuffle, ``pad_last_batch=True``) -> decode ->
    [an image longer than 8 : 1 cut to its centre at that ratio, so that a valid 65000 x 2 JPEG
    is not resized to gigabytes] -> ``fn.resize(resize_shorter=resize_size)`` -> centre crop
    ``image_size`` + normalise (``fn.crop_mirror_normalize``, ``CHW``). Outputs ``(images,
    labels)`` like the training pipeline, plus the file path of each sample as a uint8 array
    when ``return_paths``.

    Every image of the shard is read exactly once per epoch when the pipeline is iterated with
    ``reader_name=pipe.reader_name`` and ``LastBatchPolicy.PARTIAL`` (the padding repeats of the
    last sample are then dropped). ``stick_to_shard=True`` (default) keeps a rank on the same
    shard every epoch; with ``False`` the shards rotate like DALI's default, still disjoint.

    Args:
        data_dir: dataset root holding ``val/``, or the class-folder root itself, or
            the split's :class:`~echopipe.data.ImageFolderIndex` (used as it is).
        batch_size: samples per batch (the last one of an epoch may be partial).
        image_size: side of the square centre crop.
        resize_size: shorter side after resize; default ``round(image_size * 256 / 224)``.
        decode_device: ``"cpu"``, or ``"mixed"`` (GPU decode; needs ``device_id``).
        device_id: GPU id, or ``None`` for a CPU-only pipeline.
        num_threads: DALI CPU worker threads.
        seed: pipeline seed (no randomness is used; kept for symmetry).
        shard_id, num_shards: this rank's shard, as in DALI readers.
        dtype: ``"float"`` or ``"half"`` output.
        read_delay_ms: simulated per-sample read latency (see :mod:`echopipe.dali.source_tap`).
        on_corrupt, check: how bad files are handled (see
            :func:`~echopipe.dali.imagenet_train_pipeline`).
        stick_to_shard: see above.
        prefetch_queue_depth: DALI prefetch depth.
        track_sources: keep an :class:`UpstreamTap` to name files DALI fails to decode.
        return_paths: add a third output with each sample's file path (uint8 bytes).

    Returns:
        An ``nvidia.dali.Pipeline`` (not built) with ``folder_index``, ``skipped_files``,
        ``upstream_tap`` and ``reader_name`` attributes.
    """
    shard, shards, size, dev = check_common(
        batch_size, image_size, num_threads, dtype, shard_id, num_shards, decode_device,
        device_id, on_corrupt, check, read_delay_ms, seed,
    )  # fmt: skip
    resize = check_resize(resize_size, size)
    index = index_imagenet_split(data_dir, "val", check=check, on_corrupt=on_corrupt)
    reader = val_reader_args(
        index, shard_id=shard, num_shards=shards, seed=int(seed), stick_to_shard=stick_to_shard
    )
    tap = optional_tap(read_delay_ms, track_sources, check, on_corrupt)

    def val() -> tuple[Any, ...]:
        jpegs, labels, sources = graph_read(reader, tap)
        images = graph_center_crop(graph_decode(jpegs, decode_device), resize, size, dtype)
        if return_paths:
            return images, graph_labels(labels), sources
        return images, graph_labels(labels)

    pipe = naming_pipeline(
        val,
        tap,
        batch_size=int(batch_size),
        num_threads=int(num_threads),
        device_id=dev,
        seed=int(seed),
        prefetch_queue_depth=prefetch_queue_depth,
    )
    return attach(pipe, index, tap)
