"""Argument checks shared by the ImageNet builders and the Python echo peer.

Each check raises ``TypeError`` or ``ValueError`` with one line naming the argument and the
value, before any folder is scanned or DALI pipeline is made.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Largest pipeline seed. DALI takes signed 64-bit seeds, and a pipeline's parts get its seed plus
#: small offsets (the shard id, 1 for the downstream pipeline, 7919 in the Python peer): half of
#: that range leaves them room.
MAX_PIPELINE_SEED = (1 << 62) - 1

#: Largest seed an :class:`~echopipe.dali.EchoPipelineConfig` takes: the pair's downstream
#: pipeline gets ``seed + 1``, which must fit DALI's int64 (a builder's seed plus its shard id
#: stays below it).
MAX_PAIR_SEED = (1 << 63) - 2


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def positive_or_default(name: str, value: object, default: int) -> int:
    """``value`` checked by :func:`check_positive_int`, or ``default`` when it is None (0 is
    refused, not taken for the default)."""
    return default if value is None else check_positive_int(name, value)


def check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _check_shard(shard_id: object, num_shards: object) -> tuple[int, int]:
    num = check_positive_int("num_shards", num_shards)
    if isinstance(shard_id, bool) or not isinstance(shard_id, int | np.integer):
        raise TypeError(f"shard_id must be an int, got {shard_id!r}")
    if not 0 <= shard_id < num:
        raise ValueError(f"shard_id must be in [0, num_shards={num}), got {shard_id}")
    return int(shard_id), num


def _check_device(decode_device: object, device_id: object) -> int | None:
    check_choice("decode_device", decode_device, ("cpu", "mixed"))
    if device_id is not None and (
        isinstance(device_id, bool) or not isinstance(device_id, int | np.integer) or device_id < 0
    ):
        raise ValueError(f"device_id must be None or an int >= 0, got {device_id!r}")
    if decode_device == "mixed" and device_id is None:
        raise ValueError("decode_device='mixed' decodes on a GPU and needs device_id, got None")
    return None if device_id is None else int(device_id)


def check_common(
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
    seed: object,
) -> tuple[int, int, int, int | None]:
    check_positive_int("batch_size", batch_size)
    check_positive_int("image_size", image_size)
    check_positive_int("num_threads", num_threads)
    check_choice("dtype", dtype, ("float", "half"))
    check_choice("on_corrupt", on_corrupt, ("error", "skip"))
    check_choice("check", check, ("none", "header", "decode"))
    if isinstance(read_delay_ms, bool) or not isinstance(read_delay_ms, int | float):
        raise TypeError(f"read_delay_ms must be a number, got {read_delay_ms!r}")
    if not np.isfinite(read_delay_ms) or read_delay_ms < 0:
        raise ValueError(f"read_delay_ms must be finite and >= 0, got {read_delay_ms!r}")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(f"seed must be an int, got {seed!r} ({type(seed).__name__})")
    if not 0 <= seed <= MAX_PIPELINE_SEED:
        raise ValueError(f"seed must be in [0, {MAX_PIPELINE_SEED}], got {seed}")
    shard, shards = _check_shard(shard_id, num_shards)
    dev = _check_device(decode_device, device_id)
    return shard, shards, int(image_size), dev


def check_resize(resize_size: object, image_size: int) -> int:
    """The validation resize side: ``resize_size``, or ``image_size * 256 / 224`` by default."""
    if resize_size is None:
        return round(image_size * 256 / 224)
    resize = check_positive_int("resize_size", resize_size)
    if resize < image_size:
        raise ValueError(f"resize_size ({resize}) must be >= image_size ({image_size})")
    return resize
