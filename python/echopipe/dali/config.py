"""How an echoing pipeline echoes: :class:`EchoPipelineConfig`, its defaults and checks, and its
cache."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..echo.config import (
    DEFAULT_SHUFFLE_BATCHES,
    MAX_CAPACITY_SAMPLES,
    EchoConfig,
    check_factor,
    check_int,
)
from .builder_checks import MAX_PAIR_SEED


def slots_needed(
    batch_size: int, shuffle_buffer: int, upstream_batch_size: int, in_flight: int = 1
) -> int:
    """Sample slots a cache needs so that neither side stalls: what the first draw waits for
    (``max(shuffle_buffer, batch_size)``) plus ``in_flight`` upstream batches being stored."""
    return max(shuffle_buffer, batch_size) + in_flight * upstream_batch_size


@dataclass(frozen=True)
class EchoPipelineConfig:
    """How an :class:`EchoPipeline` echoes: the echo itself (:class:`~echopipe.echo.EchoConfig`,
    whose factor must be a number here) and the pipeline's batches, slots, epochs and seed (see
    :func:`echo_pipeline_def` for each field)."""

    batch_size: int
    echo: EchoConfig = field(default_factory=lambda: EchoConfig(factor=2.0))
    cache_samples: int | None = None
    upstream_batch_size: int | None = None
    epochs: int | str | None = "auto"
    deterministic: bool = False
    seed: int = 0

    def resolved(self) -> EchoPipelineConfig:
        """Validates the values and fills the defaults; errors name the bad value."""
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        echo = self.echo
        if not isinstance(echo, EchoConfig):
            raise TypeError(f"echo must be an echopipe.echo.EchoConfig, got {echo!r}")
        e = float(check_factor(echo.factor, "echo_factor"))  # a pipeline has no 'auto'
        # None is the default; 0 is a bad value, not another way to ask for it.
        up = self.batch_size if self.upstream_batch_size is None else self.upstream_batch_size
        if isinstance(up, bool) or not isinstance(up, int) or up < 1:
            raise ValueError(f"upstream_batch_size must be a positive int, got {up!r}")
        if echo.mode == "batch" and self.batch_size % up != 0:
            raise ValueError(
                f"batch echoing repeats whole upstream batches, so batch_size ({self.batch_size}) "
                f"must be a multiple of upstream_batch_size ({up})"
            )
        fill = echo.shuffle_buffer
        if fill is None:
            fill = DEFAULT_SHUFFLE_BATCHES * self.batch_size
            if isinstance(self.cache_samples, int):  # an explicit slot count bounds the default
                fill = max(self.batch_size, min(fill, self.cache_samples - up))
            fill = EchoConfig.check_field("shuffle_buffer", fill)
        need = slots_needed(self.batch_size, fill, up)
        samples = self.cache_samples if self.cache_samples is not None else max(2 * need, 256)
        if self.cache_samples is None and samples > MAX_CAPACITY_SAMPLES:
            raise ValueError(
                f"shuffle_buffer={fill} needs {samples} sample slots (twice max(shuffle_buffer, "
                f"batch_size) + upstream_batch_size, so that neither side stalls), more than a "
                f"cache has ({MAX_CAPACITY_SAMPLES}); give a shuffle_buffer of at most "
                f"{MAX_CAPACITY_SAMPLES // 2 - up}"
            )
        if not isinstance(samples, int) or not need <= samples <= MAX_CAPACITY_SAMPLES:
            raise ValueError(
                f"cache_samples={samples!r} is out of bounds: it must hold max(shuffle_buffer, "
                f"batch_size) + upstream_batch_size = {need} samples so that neither side "
                f"stalls, and at most {MAX_CAPACITY_SAMPLES}"
            )
        check_int("seed", self.seed, 0, MAX_PAIR_SEED)
        if self.epochs not in (None, "auto") and (
            not isinstance(self.epochs, int) or self.epochs < 1
        ):
            raise ValueError(
                "epochs must be an int >= 1, 'auto' (1 with a padded reader, else endless) or "
                f"None (endless), got {self.epochs!r}"
            )
        return EchoPipelineConfig(
            batch_size=self.batch_size,
            echo=replace(echo, factor=e, shuffle_buffer=fill),
            cache_samples=samples,
            upstream_batch_size=up,
            epochs=self.epochs,
            deterministic=bool(self.deterministic),
            seed=int(self.seed),
        )


def make_cache(
    config: EchoPipelineConfig, name: str, device_id: int | None = None, epoch_size: int = 0
) -> Any:
    """The pipeline's echo cache; a device arena is allocated on the pipeline's ``device_id``.
    ``epoch_size`` > 0 makes the copy totals exact per epoch of that many units."""
    from ..echo import EchoCache

    if config.echo.memory == "device" and device_id is not None:
        import torch

        with torch.cuda.device(device_id):  # the current device is where cudaMalloc allocates
            return _new_cache(EchoCache, config, name, epoch_size)
    return _new_cache(EchoCache, config, name, epoch_size)


def _new_cache(cls: Any, config: EchoPipelineConfig, name: str, epoch_size: int) -> Any:
    return cls(
        capacity_bytes=config.echo.cache_bytes,
        capacity_samples=config.cache_samples,
        echo_factor=config.echo.factor,
        min_fill=config.echo.shuffle_buffer,
        seed=config.seed,
        mode=config.echo.mode,
        batch_size=config.upstream_batch_size if config.echo.mode == "batch" else None,
        memory=config.echo.memory,
        name=name,
        epoch_size=epoch_size,
    )
