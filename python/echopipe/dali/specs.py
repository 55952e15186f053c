"""What an ImageNet training pipeline is made of, as three specs instead of 30 keywords.

:func:`~echopipe.dali.imagenet_train_pipeline` and the Python echo peer
(:func:`~echopipe.dali.python_echo_train_pipeline`) take the same three specs:

* :class:`ReaderSpec`: which files, how they are sharded, checked, read and decoded, and how
  DALI runs (threads, prefetch, device);
* :class:`AugmentSpec`: the random-resized crop, flip and normalisation after decoding;
* :class:`EchoSpec`: where and how samples are echoed, and the cache that holds them
  (``None`` for the plain pipeline without echo).

Each field also works as a keyword of those functions (``imagenet_train_pipeline(root,
batch_size=64, echo_factor=3)``), routed to its spec by name: every field name belongs to
exactly one spec, so a value is written in one place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Literal

from ..echo.config import EchoConfig

DecodeDevice = Literal["cpu", "mixed"]
OutputDType = Literal["float", "half"]
OnCorrupt = Literal["error", "skip"]
CheckLevel = Literal["none", "header", "decode"]


@dataclass(frozen=True)
class ReaderSpec:
    """The reader side: files, shards, checks, decode, and how DALI runs.

    Attributes:
        shard_id, num_shards: this rank's shard of the (permuted) file list, as in DALI readers.
        seed: seeds the file permutation (same on every rank), and ``seed + shard_id`` the
            reader, the echo cache and the augmentations.
        shuffle_files: permute the file list once with ``seed`` before sharding.
        stick_to_shard: keep this rank on its shard in every epoch (DALI's meaning).
        initial_fill: the reader's shuffle buffer.
        on_corrupt: ``"error"`` names the first bad file; ``"skip"`` leaves bad files out.
        check: what the scan checks: ``"none"``, ``"header"`` or ``"decode"``.
        read_delay_ms: simulated per-sample read latency in the upstream only.
        track_sources: keep the tap that names a file DALI's decoder rejects.
        decode_device: ``"cpu"``, or ``"mixed"`` (GPU decode, needs ``device_id``).
        device_id: GPU id or ``None`` (CPU-only pipelines).
        num_threads: DALI threads of the (downstream) pipeline.
        prefetch_queue_depth: downstream DALI prefetch.
    """

    shard_id: int = 0
    num_shards: int = 1
    seed: int = 0
    shuffle_files: bool = True
    stick_to_shard: bool = False
    initial_fill: int = 1024
    on_corrupt: OnCorrupt = "error"
    check: CheckLevel = "header"
    read_delay_ms: float = 0.0
    track_sources: bool = True
    decode_device: DecodeDevice = "cpu"
    device_id: int | None = None
    num_threads: int = 2
    prefetch_queue_depth: int = 2


@dataclass(frozen=True)
class AugmentSpec:
    """The training augmentation: random-resized crop, random flip, ImageNet normalisation.

    Attributes:
        image_size: side of the square random-resized crop.
        dtype: ``"float"`` or ``"half"`` images.
        random_area: area range of the random-resized crop.
    """

    image_size: int = 224
    dtype: OutputDType = "float"
    random_area: tuple[float, float] = (0.08, 1.0)


@dataclass(frozen=True)
class EchoSpec:
    """Where and how samples are echoed, and the cache that holds them.

    Attributes:
        echo_factor: mean emissions per fresh sample, in [1, MAX_ECHO_FACTOR].
        echo_insert: ``"after_decode"`` or ``"after_augment"`` (copies are then identical).
        echo_mode: ``"example"`` (single samples) or ``"batch"`` (whole upstream batches).
        shuffle_buffer: samples resident before a draw (default 4 batches' worth).
        cache_bytes, cache_samples: cache capacity (decoded images are stored).
        upstream_batch_size: reader batch size (default ``batch_size``).
        upstream_threads: DALI threads of the upstream pipeline (default ``num_threads``).
        epochs: ``None`` for an endless stream, or ``N`` epochs of this shard and then end.
        deterministic: upstream in lock-step with the consumer (reproducible stream).
        memory: cache memory (``"auto"``, ``"pageable"``, ``"pinned"``, ``"device"``); the
            ImageNet builder's ``"auto"`` takes ``"device"`` for a ``"mixed"`` decode when the
            arena fits (:func:`echopipe.echo.memory.choose_memory`).
        enable_checkpointing: also checkpoint DALI's operator states.
    """

    echo_factor: float = 2.0
    echo_insert: Literal["after_decode", "after_augment"] = "after_decode"
    echo_mode: Literal["example", "batch"] = "example"
    shuffle_buffer: int | None = None
    cache_bytes: int = 256 << 20
    cache_samples: int | None = None
    upstream_batch_size: int | None = None
    upstream_threads: int | None = None
    epochs: int | None = None
    deterministic: bool = False
    memory: str = "auto"
    enable_checkpointing: bool = False

    def __post_init__(self) -> None:
        # Each echo value is checked here, once, against the core's bounds (EchoConfigError
        # names the spec's field), so a bad value is refused before anything is built.
        for spec_name, name in _ECHO_FIELDS.items():
            EchoConfig.check_field(name, getattr(self, spec_name), spec_name)

    @classmethod
    def of(cls, config: EchoConfig, **others: Any) -> EchoSpec:
        """The spec of an :class:`~echopipe.echo.EchoConfig` (whose factor must be a number),
        with ``others`` for the fields that are not the config's."""
        return cls(**{s: getattr(config, name) for s, name in _ECHO_FIELDS.items()}, **others)

    def echo_config(self) -> EchoConfig:
        """The :class:`~echopipe.echo.EchoConfig` these fields make."""
        return EchoConfig(**{name: getattr(self, s) for s, name in _ECHO_FIELDS.items()})


#: EchoSpec's fields that make its EchoConfig, and the EchoConfig field each sets.
_ECHO_FIELDS = {
    "echo_factor": "factor",
    "echo_insert": "placement",
    "echo_mode": "mode",
    "shuffle_buffer": "shuffle_buffer",
    "cache_bytes": "cache_bytes",
    "memory": "memory",
}


_SPECS: tuple[type, ...] = (ReaderSpec, AugmentSpec, EchoSpec)
_OWNER = {f.name: spec for spec in _SPECS for f in fields(spec)}


def resolve_specs(
    reader: ReaderSpec | None,
    augment: AugmentSpec | None,
    echo: EchoSpec | EchoConfig | None,
    keywords: dict[str, Any],
) -> tuple[ReaderSpec, AugmentSpec, EchoSpec | None]:
    """The three specs with ``keywords`` applied, each to the spec that owns its name; an
    :class:`~echopipe.echo.EchoConfig` for ``echo`` is its :meth:`EchoSpec.of`.

    ``echo_factor=None`` among the keywords means no echo (``echo`` becomes ``None``; the other
    echo keywords then have no effect). TypeError names a keyword that no spec has, or an echo
    keyword given with ``echo=None``.
    """
    specs: dict[type, Any] = {
        ReaderSpec: reader if reader is not None else ReaderSpec(),
        AugmentSpec: augment if augment is not None else AugmentSpec(),
        EchoSpec: echo,
    }
    if isinstance(echo, EchoConfig):
        specs[EchoSpec] = echo = EchoSpec.of(echo)
    for spec, value in ((ReaderSpec, reader), (AugmentSpec, augment), (EchoSpec, echo)):
        if value is not None and not isinstance(value, spec):
            raise TypeError(f"expected a {spec.__name__}, got {type(value).__name__}")
    if "echo_factor" in keywords and keywords["echo_factor"] is None:
        # The keyword spelling of "no echo" leaves the other echo keywords without effect, so
        # one call site can switch echo on and off by echo_factor alone.
        keywords = {k: v for k, v in keywords.items() if _OWNER.get(k) is not EchoSpec}
        specs[EchoSpec] = None
    changes: dict[type, dict[str, Any]] = {}
    for name, value in keywords.items():
        owner = _OWNER.get(name)
        if owner is None:
            raise TypeError(
                f"unexpected keyword {name!r}; the pipeline takes batch_size, the fields of "
                "ReaderSpec, AugmentSpec and EchoSpec, or those specs as reader=, augment=, echo="
            )
        changes.setdefault(owner, {})[name] = value
    for owner, values in changes.items():
        if specs[owner] is None:
            raise TypeError(f"{sorted(values)} given for a pipeline without echo (echo=None)")
        specs[owner] = dataclasses.replace(specs[owner], **values)
    return specs[ReaderSpec], specs[AugmentSpec], specs[EchoSpec]
