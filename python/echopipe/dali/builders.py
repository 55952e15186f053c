"""Ready-made DALI pipelines for ImageNet-layout JPEG folders: echo training, plain training, val.

Folder layout. ``data_dir`` may be either a dataset root holding the split folder (``train/`` or
``val/``), or the split folder itself; the split folder holds one sub-folder per class with the
JPEGs inside (``data_dir/train/<class>/*.JPEG`` or ``data_dir/<class>/*.JPEG``). Class ids are the
sorted class folder names. Files are listed in Python (:func:`echopipe.data.scan_image_folder`)
and checked before DALI opens them, so an empty or garbage file gives a
:class:`~echopipe.data.CorruptImageError` naming it (``on_corrupt="error"``) or is left out and
counted (``on_corrupt="skip"``); the index, including ``skipped``, is attached to the returned
pipeline as ``folder_index``.

Sharding works the way DALI readers do: ``shard_id``/``num_shards`` go to ``fn.readers.file``,
which reads a contiguous ``1/num_shards`` of the file list. The training file list is first
permuted with ``seed`` (the same permutation on every rank, so shards stay disjoint and each
holds a mix of classes), and an echoing rank echoes only the samples its own reader produced.

Read delay. ``read_delay_ms`` mimics a network file system: every upstream batch waits
``batch_size * read_delay_ms`` milliseconds (``time.sleep``, so it costs wall time but no CPU)
between the reader and the decoder, in a ``fn.python_function`` placed in the upstream pipeline
only. The same tap records the source paths of the last few batches, so a file that passes the
header check but that DALI's decoder rejects can be found and named afterwards
(:meth:`UpstreamTap.find_undecodable`).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..data import CorruptImageError, ImageFolderIndex, check_image_file, scan_image_folder
from .memory import resolve_memory
from .naming import naming_pipeline
from .pipeline import EchoConfig, EchoPipeline, current_stage
from .pipeline import echo as echo_point
from .specs import (
    AugmentSpec,
    CheckLevel,
    DecodeDevice,
    EchoSpec,
    OnCorrupt,
    OutputDType,
    ReaderSpec,
    resolve_specs,
)

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

IMAGENET_MEAN = (0.485, 0.456, 0.406)
"""Per-channel RGB mean of ImageNet, on a 0-1 scale (multiplied by 255 for uint8 pixels)."""
IMAGENET_STD = (0.229, 0.224, 0.225)
"""Per-channel RGB standard deviation of ImageNet, on a 0-1 scale."""


_READER_NAME = "Reader"


# --------------------------------------------------------------------------------------------
# Folder handling
# --------------------------------------------------------------------------------------------


def resolve_split_dir(data_dir: str | Path, split: str) -> Path:
    """The class-folder root for ``split``: ``data_dir/split`` if it exists, else ``data_dir``.

    Raises:
        FileNotFoundError: ``data_dir`` is missing or not a folder.
    """
    root = Path(data_dir)
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise FileNotFoundError(f"data_dir {str(root)!r} {what}")
    candidate = root / split
    return candidate if candidate.is_dir() else root


def index_imagenet_split(
    data_dir: str | Path,
    split: str,
    *,
    check: CheckLevel = "header",
    on_corrupt: OnCorrupt = "error",
) -> ImageFolderIndex:
    """List and check the images of one split (see the module notes on the accepted layouts).

    Raises:
        FileNotFoundError: no such folder.
        ValueError: no class folders or no images.
        CorruptImageError: a bad file and ``on_corrupt="error"`` (names the file).
    """
    return scan_image_folder(resolve_split_dir(data_dir, split), check=check, on_corrupt=on_corrupt)


# --------------------------------------------------------------------------------------------
# Upstream tap: read delay + recent source paths
# --------------------------------------------------------------------------------------------


class UpstreamTap:
    """Callable for ``fn.python_function`` between the reader and the decoder.

    Each call receives one batch of encoded files and their ``source_info`` paths, sleeps
    ``len(batch) * read_delay_ms`` milliseconds when a delay is set, remembers the paths of the
    last ``history_batches`` batches, and passes the encoded files through unchanged.

    Counters (read them any time; they are updated under a lock): ``samples``, ``batches`` and
    ``delay_s`` (total seconds slept).
    """

    def __init__(self, read_delay_ms: float = 0.0, *, history_batches: int = 8) -> None:
        delay = float(read_delay_ms)
        if not np.isfinite(delay) or delay < 0:
            raise ValueError(f"read_delay_ms must be a finite number >= 0, got {read_delay_ms!r}")
        if int(history_batches) < 1:
            raise ValueError(f"history_batches must be >= 1, got {history_batches!r}")
        self.read_delay_ms = delay
        self._lock = threading.Lock()
        self._recent: collections.deque[list[str]] = collections.deque(maxlen=int(history_batches))
        self.samples = 0
        self.batches = 0
        self.delay_s = 0.0

    def __call__(self, encoded: list[np.ndarray], sources: list[np.ndarray]) -> list[np.ndarray]:
        paths = [arr.tobytes().decode("utf-8", "replace") for arr in sources]
        pause = len(encoded) * self.read_delay_ms / 1000.0
        if pause > 0:
            # Sleep releases the GIL: the delay costs upstream wall time, not CPU.
            time.sleep(pause)
        with self._lock:
            self._recent.append(paths)
            self.samples += len(encoded)
            self.batches += 1
            self.delay_s += pause
        return encoded

    def recent_files(self) -> list[str]:
        """Paths of the most recent batches that went through the reader, oldest first."""
        with self._lock:
            return [p for batch in self._recent for p in batch]

    def find_undecodable(self) -> list[tuple[str, str]]:
        """Fully decode (Pillow) the recent files; ``(path, reason)`` for each that fails.

        Used after DALI's decoder failed, to name the file: the failing batch is among the
        recent ones, since the decoder runs right after this tap.
        """
        bad = []
        for path in dict.fromkeys(self.recent_files()):
            try:
                check_image_file(path, "decode")
            except CorruptImageError as exc:
                bad.append((exc.path, exc.reason))
        return bad

    def stats(self) -> dict[str, float]:
        """``{"samples", "batches", "delay_s"}`` so far."""
        with self._lock:
            return {"samples": self.samples, "batches": self.batches, "delay_s": self.delay_s}


def explain_decode_failure(tap: UpstreamTap, error: BaseException) -> BaseException:
    """An exception naming the file behind a DALI decoder failure, or ``error`` if none is found.

    DALI's own message (``nvImageCodec failure``) does not say which file failed. Errors that
    do not come from a decoder are returned unchanged.
    """
    chain, seen = [], error
    while seen is not None and len(chain) < 8:
        chain.append(str(seen))
        seen = seen.__cause__ or seen.__context__
    if not any(key in text for text in chain for key in ("decoders.image", "nvImageCodec")):
        return error
    bad = tap.find_undecodable()
    if not bad:
        return error
    path, reason = bad[0]
    more = f" (and {len(bad) - 1} more: {[p for p, _ in bad[1:4]]})" if len(bad) > 1 else ""
    exc = CorruptImageError(
        path,
        f"DALI's decoder failed on it ({reason}){more}; it passed the header check, "
        "so scan with check='decode' or on_corrupt='skip' to leave it out",
    )
    exc.__cause__ = error
    return exc


# --------------------------------------------------------------------------------------------
# Graph pieces (called inside a pipeline definition)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ReaderArgs:
    files: list[str]
    labels: list[int]
    shard_id: int
    num_shards: int
    random_shuffle: bool
    pad_last_batch: bool
    stick_to_shard: bool
    seed: int
    initial_fill: int


def _graph_read(args: _ReaderArgs, tap: UpstreamTap | None) -> tuple[Any, Any, Any]:
    """``(encoded files, labels, source paths)``; the files pass through ``tap`` if given."""
    from nvidia.dali import fn

    jpegs, labels = fn.readers.file(
        files=args.files,
        labels=args.labels,
        shard_id=args.shard_id,
        num_shards=args.num_shards,
        random_shuffle=args.random_shuffle,
        pad_last_batch=args.pad_last_batch,
        stick_to_shard=args.stick_to_shard,
        initial_fill=args.initial_fill,
        seed=args.seed,
        name=_READER_NAME,
    )
    sources = fn.get_property(jpegs, key="source_info")
    if tap is not None:
        jpegs = fn.python_function(
            jpegs, sources, function=tap, batch_processing=True, num_outputs=1
        )
    return jpegs, labels, sources


def _graph_decode(jpegs: Any, decode_device: DecodeDevice) -> Any:
    from nvidia.dali import fn, types

    return fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB)


def _dali_dtype(dtype: OutputDType) -> Any:
    from nvidia.dali import types

    return types.FLOAT16 if dtype == "half" else types.FLOAT


def _graph_train_augment(
    images: Any, image_size: int, dtype: OutputDType, random_area: tuple[float, float]
) -> Any:
    from nvidia.dali import fn

    images = fn.random_resized_crop(
        images, size=(image_size, image_size), random_area=list(random_area)
    )
    return fn.crop_mirror_normalize(
        images,
        dtype=_dali_dtype(dtype),
        output_layout="CHW",
        mean=[m * 255.0 for m in IMAGENET_MEAN],
        std=[s * 255.0 for s in IMAGENET_STD],
        mirror=fn.random.coin_flip(probability=0.5),
    )


def _graph_labels(labels: Any) -> Any:
    from nvidia.dali import fn, types

    # The reader gives int32 of shape (1,); torch losses want int64 scalars per sample.
    return fn.cast(fn.reshape(labels, shape=[]), dtype=types.INT64)


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _check_shard(shard_id: object, num_shards: object) -> tuple[int, int]:
    num = _check_positive_int("num_shards", num_shards)
    if isinstance(shard_id, bool) or not isinstance(shard_id, int | np.integer):
        raise TypeError(f"shard_id must be an int, got {shard_id!r}")
    if not 0 <= shard_id < num:
        raise ValueError(f"shard_id must be in [0, num_shards={num}), got {shard_id}")
    return int(shard_id), num


def _check_device(decode_device: object, device_id: object) -> int | None:
    _check_choice("decode_device", decode_device, ("cpu", "mixed"))
    if device_id is not None and (
        isinstance(device_id, bool) or not isinstance(device_id, int | np.integer) or device_id < 0
    ):
        raise ValueError(f"device_id must be None or an int >= 0, got {device_id!r}")
    if decode_device == "mixed" and device_id is None:
        raise ValueError("decode_device='mixed' decodes on a GPU and needs device_id, got None")
    return None if device_id is None else int(device_id)


def _check_common(
    batch_size: object,
    image_size: object,
    num_threads: object,
    dtype: object,
    shard_id: object,
    num_shards: object,
    decode_device: object,
    device_id: object,
    on_corrupt: object,
    check: object,
    read_delay_ms: object,
) -> tuple[int, int, int, int | None]:
    _check_positive_int("batch_size", batch_size)
    _check_positive_int("image_size", image_size)
    _check_positive_int("num_threads", num_threads)
    _check_choice("dtype", dtype, ("float", "half"))
    _check_choice("on_corrupt", on_corrupt, ("error", "skip"))
    _check_choice("check", check, ("none", "header", "decode"))
    if isinstance(read_delay_ms, bool) or not isinstance(read_delay_ms, int | float):
        raise TypeError(f"read_delay_ms must be a number, got {read_delay_ms!r}")
    if not np.isfinite(read_delay_ms) or read_delay_ms < 0:
        raise ValueError(f"read_delay_ms must be finite and >= 0, got {read_delay_ms!r}")
    shard, shards = _check_shard(shard_id, num_shards)
    dev = _check_device(decode_device, device_id)
    return shard, shards, int(image_size), dev


def _train_reader_args(
    index: ImageFolderIndex,
    *,
    shard_id: int,
    num_shards: int,
    seed: int,
    shuffle_files: bool,
    stick_to_shard: bool,
    initial_fill: int,
) -> _ReaderArgs:
    files, labels = list(index.files), list(index.labels)
    if shuffle_files:
        # One permutation, the same on every rank (it depends on seed only), so the contiguous
        # shards DALI cuts stay disjoint while each one mixes all classes.
        order = np.random.default_rng(seed).permutation(len(files))
        files = [files[i] for i in order]
        labels = [labels[i] for i in order]
    return _ReaderArgs(
        files=files,
        labels=labels,
        shard_id=shard_id,
        num_shards=num_shards,
        random_shuffle=True,
        pad_last_batch=False,
        stick_to_shard=stick_to_shard,
        seed=seed + shard_id,
        initial_fill=initial_fill,
    )


def _attach(pipe: Any, index: ImageFolderIndex, tap: UpstreamTap | None) -> Any:
    pipe.folder_index = index
    pipe.skipped_files = list(index.skipped)
    pipe.upstream_tap = tap
    pipe.reader_name = _READER_NAME
    return pipe


# --------------------------------------------------------------------------------------------
# Public builders
# --------------------------------------------------------------------------------------------


def imagenet_plain_train_pipeline(
    data_dir: str | Path,
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

    The arguments are those of :func:`imagenet_train_pipeline` that apply without echo.
    """
    shard, shards, size, dev = _check_common(
        batch_size, image_size, num_threads, dtype, shard_id, num_shards, decode_device,
        device_id, on_corrupt, check, read_delay_ms,
    )  # fmt: skip
    index = index_imagenet_split(data_dir, "train", check=check, on_corrupt=on_corrupt)
    reader = _train_reader_args(
        index, shard_id=shard, num_shards=shards, seed=int(seed), shuffle_files=shuffle_files,
        stick_to_shard=stick_to_shard, initial_fill=initial_fill,
    )  # fmt: skip
    tap = UpstreamTap(read_delay_ms) if (track_sources or read_delay_ms > 0) else None

    def plain_train() -> tuple[Any, Any]:
        jpegs, labels, _ = _graph_read(reader, tap)
        images = _graph_decode(jpegs, decode_device)
        images = _graph_train_augment(images, size, dtype, random_area)
        return images, _graph_labels(labels)

    pipe = naming_pipeline(
        plain_train,
        tap,
        batch_size=int(batch_size),
        num_threads=int(num_threads),
        device_id=dev,
        seed=int(seed) + shard,
        prefetch_queue_depth=prefetch_queue_depth,
    )
    return _attach(pipe, index, tap)


def imagenet_decode_pipeline(
    data_dir: str | Path,
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
    shard, shards, _, _ = _check_common(
        batch_size, 1, num_threads, "float", shard_id, num_shards, "cpu", None, on_corrupt,
        check, read_delay_ms,
    )  # fmt: skip
    index = index_imagenet_split(data_dir, "train", check=check, on_corrupt=on_corrupt)
    reader = _train_reader_args(
        index, shard_id=shard, num_shards=shards, seed=int(seed), shuffle_files=shuffle_files,
        stick_to_shard=False, initial_fill=1024,
    )  # fmt: skip
    tap = UpstreamTap(read_delay_ms)

    def decode_only() -> tuple[Any, Any]:
        jpegs, labels, _ = _graph_read(reader, tap)
        return _graph_decode(jpegs, "cpu"), _graph_labels(labels)

    pipe = naming_pipeline(
        decode_only,
        tap,
        batch_size=int(batch_size),
        num_threads=int(num_threads),
        device_id=None,
        seed=int(seed) + shard,
        prefetch_queue_depth=prefetch_queue_depth,
    )
    return _attach(pipe, index, tap)


def imagenet_val_pipeline(
    data_dir: str | Path,
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
    ``fn.resize(resize_shorter=resize_size)`` -> centre crop ``image_size`` + normalise
    (``fn.crop_mirror_normalize``, ``CHW``). Outputs ``(images, labels)`` like the training
    pipeline, plus the file path of each sample as a uint8 array when ``return_paths``.

    Every image of the shard is read exactly once per epoch when the pipeline is iterated with
    ``reader_name=pipe.reader_name`` and ``LastBatchPolicy.PARTIAL`` (the padding repeats of the
    last sample are then dropped). ``stick_to_shard=True`` (default) keeps a rank on the same
    shard every epoch; with ``False`` the shards rotate like DALI's default, still disjoint.

    Args:
        data_dir: dataset root holding ``val/``, or the class-folder root itself.
        batch_size: samples per batch (the last one of an epoch may be partial).
        image_size: side of the square centre crop.
        resize_size: shorter side after resize; default ``round(image_size * 256 / 224)``.
        decode_device: ``"cpu"``, or ``"mixed"`` (GPU decode; needs ``device_id``).
        device_id: GPU id, or ``None`` for a CPU-only pipeline.
        num_threads: DALI CPU worker threads.
        seed: pipeline seed (no randomness is used; kept for symmetry).
        shard_id, num_shards: this rank's shard, as in DALI readers.
        dtype: ``"float"`` or ``"half"`` output.
        read_delay_ms: simulated per-sample read latency (see the module notes).
        on_corrupt, check: how bad files are handled (see :func:`imagenet_train_pipeline`).
        stick_to_shard: see above.
        prefetch_queue_depth: DALI prefetch depth.
        track_sources: keep an :class:`UpstreamTap` to name files DALI fails to decode.
        return_paths: add a third output with each sample's file path (uint8 bytes).

    Returns:
        An ``nvidia.dali.Pipeline`` (not built) with ``folder_index``, ``skipped_files``,
        ``upstream_tap`` and ``reader_name`` attributes.
    """
    shard, shards, size, dev = _check_common(
        batch_size, image_size, num_threads, dtype, shard_id, num_shards, decode_device,
        device_id, on_corrupt, check, read_delay_ms,
    )  # fmt: skip
    if resize_size is None:
        resize = round(size * 256 / 224)
    else:
        resize = _check_positive_int("resize_size", resize_size)
        if resize < size:
            raise ValueError(f"resize_size ({resize}) must be >= image_size ({size})")
    index = index_imagenet_split(data_dir, "val", check=check, on_corrupt=on_corrupt)
    reader = _ReaderArgs(
        files=list(index.files),
        labels=list(index.labels),
        shard_id=shard,
        num_shards=shards,
        random_shuffle=False,
        pad_last_batch=True,
        stick_to_shard=stick_to_shard,
        seed=int(seed),
        initial_fill=1,
    )
    tap = UpstreamTap(read_delay_ms) if (track_sources or read_delay_ms > 0) else None

    from nvidia.dali import fn

    def val() -> tuple[Any, ...]:
        jpegs, labels, sources = _graph_read(reader, tap)
        images = _graph_decode(jpegs, decode_device)
        images = fn.resize(images, resize_shorter=resize)
        images = fn.crop_mirror_normalize(
            images,
            dtype=_dali_dtype(dtype),
            output_layout="CHW",
            crop=(size, size),
            mean=[m * 255.0 for m in IMAGENET_MEAN],
            std=[s * 255.0 for s in IMAGENET_STD],
        )
        if return_paths:
            return images, _graph_labels(labels), sources
        return images, _graph_labels(labels)

    pipe = naming_pipeline(
        val,
        tap,
        batch_size=int(batch_size),
        num_threads=int(num_threads),
        device_id=dev,
        seed=int(seed),
        prefetch_queue_depth=prefetch_queue_depth,
    )
    return _attach(pipe, index, tap)


# --------------------------------------------------------------------------------------------
# Echoing training pipeline
# --------------------------------------------------------------------------------------------


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


def imagenet_train_pipeline(
    data_dir: str | Path,
    *,
    batch_size: int,
    reader: ReaderSpec | None = None,
    augment: AugmentSpec | None = None,
    echo: EchoSpec | None = DEFAULT_ECHO,
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
        data_dir: dataset root holding ``train/``, or the class-folder root itself.
        batch_size: downstream (training) batch size.
        reader: files, shards, checks, decode and DALI threads (:class:`ReaderSpec`).
        augment: crop size, dtype and crop area (:class:`AugmentSpec`).
        echo: echo factor, placement, mode and cache (:class:`EchoSpec`); ``None`` returns the
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
    shard, shards, size, dev = _check_common(
        batch_size, a.image_size, r.num_threads, a.dtype, r.shard_id, r.num_shards,
        r.decode_device, r.device_id, r.on_corrupt, r.check, r.read_delay_ms,
    )  # fmt: skip
    _check_choice("echo_insert", e.echo_insert, ("after_decode", "after_augment"))
    _check_choice("echo_mode", e.echo_mode, ("example", "batch"))
    if e.upstream_threads is not None:
        _check_positive_int("upstream_threads", e.upstream_threads)
    index = index_imagenet_split(data_dir, "train", check=r.check, on_corrupt=r.on_corrupt)
    files = _train_reader_args(
        index, shard_id=shard, num_shards=shards, seed=int(r.seed), shuffle_files=r.shuffle_files,
        stick_to_shard=r.stick_to_shard, initial_fill=r.initial_fill,
    )  # fmt: skip
    if e.epochs is not None:
        # echopipe counts epochs in whole reader batches, so the last one must not wrap.
        files = _ReaderArgs(**{**files.__dict__, "pad_last_batch": True})
    tap = UpstreamTap(r.read_delay_ms) if (r.track_sources or r.read_delay_ms > 0) else None

    def imagenet_train() -> tuple[Any, Any]:
        # The function is traced twice; the reader is pruned from the downstream trace, but a
        # python_function never is, so the tap goes into the upstream trace only.
        upstream = current_stage() != "downstream"
        jpegs, labels, _ = _graph_read(files, tap if upstream else None)
        images = _graph_decode(jpegs, r.decode_device)
        labels = _graph_labels(labels)
        if e.echo_insert == "after_augment":
            images = _graph_train_augment(images, size, a.dtype, a.random_area)
            return echo_point(images, labels)
        images, labels = echo_point(images, labels)
        return _graph_train_augment(images, size, a.dtype, a.random_area), labels

    config = EchoConfig(
        batch_size=int(batch_size),
        echo_factor=float(e.echo_factor),
        mode=e.echo_mode,
        shuffle_buffer=e.shuffle_buffer,
        cache_samples=e.cache_samples,
        cache_bytes=int(e.cache_bytes),
        upstream_batch_size=e.upstream_batch_size,
        epochs=e.epochs,
        deterministic=e.deterministic,
        seed=int(r.seed) + shard,
        memory=resolve_memory(
            e.memory,
            input_device="gpu" if r.decode_device == "mixed" else "cpu",
            arena_bytes=int(e.cache_bytes),
            device_id=dev,
        ),
    )
    pipe = ImagenetEchoPipeline(
        imagenet_train,
        config=config,
        num_threads=int(r.num_threads),
        device_id=dev,
        upstream_num_threads=e.upstream_threads,
        prefetch_queue_depth=r.prefetch_queue_depth,
        enable_checkpointing=e.enable_checkpointing,
    )
    return _attach(pipe, index, tap)
