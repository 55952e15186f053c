"""The pieces of the ImageNet builders' DALI graphs, called inside a pipeline definition.

Read (``fn.readers.file``, through the :class:`~echopipe.dali.source_tap.UpstreamTap` when
there is one), decode, the training augmentation (random-resized crop, random mirror,
normalise), the validation resize and centre crop, and the labels as int64 scalars. The
builders (:mod:`echopipe.dali.builders`, :mod:`echopipe.dali.plain_builders`) and the Python
echo peer compose their graphs from these.
"""

from __future__ import annotations

from typing import Any

from .imagenet_files import READER_NAME, ReaderArgs
from .source_tap import UpstreamTap
from .specs import DecodeDevice, OutputDType

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
"""Per-channel RGB mean of ImageNet, on a 0-1 scale (multiplied by 255 for uint8 pixels)."""
IMAGENET_STD = (0.229, 0.224, 0.225)
"""Per-channel RGB standard deviation of ImageNet, on a 0-1 scale."""


def graph_read(args: ReaderArgs, tap: UpstreamTap | None) -> tuple[Any, Any, Any]:
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
        name=READER_NAME,
    )
    sources = fn.get_property(jpegs, key="source_info")
    if tap is not None:
        jpegs = fn.python_function(
            jpegs, sources, function=tap, batch_processing=True, num_outputs=1
        )
    return jpegs, labels, sources


def graph_decode(jpegs: Any, decode_device: DecodeDevice) -> Any:
    from nvidia.dali import fn, types

    return fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB)


def _dali_dtype(dtype: OutputDType) -> Any:
    from nvidia.dali import types

    return types.FLOAT16 if dtype == "half" else types.FLOAT


def graph_train_augment(
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


MAX_VAL_ASPECT = 8
"""Longest side over shorter side that the validation resize is given: a longer image is first
cut to its centre at this ratio (the centre crop comes from well inside it)."""


def graph_center_crop(images: Any, resize: int, size: int, dtype: OutputDType) -> Any:
    """Resize the shorter side to ``resize``, centre-crop ``size`` square, normalise to CHW.

    An image longer than :data:`MAX_VAL_ASPECT` times its width (or wider) is first cut to its
    centre at that ratio: resized whole, a valid 65000 x 2 JPEG of a few KiB would become
    2.4 M x 73 pixels (520 MB) at ``--image-size 64`` and 8.3 M x 256 (6.4 GB) at 224, a 1-pixel
    high PNG more, for a centre crop that uses none of the rest. Other images pass unchanged.
    """
    import nvidia.dali.math as dmath
    from nvidia.dali import fn, types

    shape = images.shape(dtype=types.FLOAT)
    height, width = shape[0], shape[1]
    images = fn.crop(
        images,
        crop_h=dmath.min(height, width * MAX_VAL_ASPECT),
        crop_w=dmath.min(width, height * MAX_VAL_ASPECT),
    )
    images = fn.resize(images, resize_shorter=resize)
    return fn.crop_mirror_normalize(
        images,
        dtype=_dali_dtype(dtype),
        output_layout="CHW",
        crop=(size, size),
        mean=[m * 255.0 for m in IMAGENET_MEAN],
        std=[s * 255.0 for s in IMAGENET_STD],
    )


def graph_labels(labels: Any) -> Any:
    from nvidia.dali import fn, types

    # The reader gives int32 of shape (1,); torch losses want int64 scalars per sample.
    return fn.cast(fn.reshape(labels, shape=[]), dtype=types.INT64)
