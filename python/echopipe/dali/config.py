"""How an echoing pipeline echoes: :class:`EchoConfig`, its defaults and checks, and its cache."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..echo.memory import check_memory

_ECHO_MODES = ("example", "batch")
#: Default shuffle buffer, in downstream batches. The cache draws uniformly from what it holds,
#: so a buffer of F fresh samples spreads echoed copies like a full shuffle of F samples: at
#: e = 2 and batch 16, one batch's worth puts two copies of a sample into nearly every batch
#: (copies about 1 batch apart), four batches' worth into about 60 % (5 batches apart), which is
#: what a full shuffle of a 60-file data set gives (tests/test_dali_spread.py).
DEFAULT_SHUFFLE_BATCHES = 4


@dataclass(frozen=True)
class EchoConfig:
    """How an :class:`EchoPipeline` echoes (see :func:`echo_pipeline_def` for each field)."""

    batch_size: int
    echo_factor: float = 2.0
    mode: str = "example"
    shuffle_buffer: int | None = None
    cache_samples: int | None = None
    cache_bytes: int = 256 << 20
    upstream_batch_size: int | None = None
    epochs: int | str | None = "auto"
    deterministic: bool = False
    seed: int = 0
    memory: str = "auto"

    def resolved(self) -> EchoConfig:
        """Validates the values and fills the defaults; errors name the bad value."""
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        e = float(self.echo_factor)
        if not math.isfinite(e) or e < 1.0:
            raise ValueError(f"echo_factor must be a finite number >= 1, got {self.echo_factor!r}")
        if self.mode not in _ECHO_MODES:
            raise ValueError(f"mode must be one of {_ECHO_MODES}, got {self.mode!r}")
        up = self.upstream_batch_size or self.batch_size
        if not isinstance(up, int) or up < 1:
            raise ValueError(f"upstream_batch_size must be a positive int, got {up!r}")
        if self.mode == "batch" and self.batch_size % up != 0:
            raise ValueError(
                f"batch echoing repeats whole upstream batches, so batch_size ({self.batch_size}) "
                f"must be a multiple of upstream_batch_size ({up})"
            )
        fill = self.shuffle_buffer
        if fill is None:
            fill = DEFAULT_SHUFFLE_BATCHES * self.batch_size
            if isinstance(self.cache_samples, int):  # an explicit slot count bounds the default
                fill = max(self.batch_size, min(fill, self.cache_samples - up))
        if not isinstance(fill, int) or fill < 0:
            raise ValueError(f"shuffle_buffer must be an int >= 0, got {fill!r}")
        need = max(fill, self.batch_size) + up
        samples = self.cache_samples if self.cache_samples is not None else max(2 * need, 256)
        if not isinstance(samples, int) or samples < need:
            raise ValueError(
                f"cache_samples={samples!r} is too small: it must hold max(shuffle_buffer, "
                f"batch_size) + upstream_batch_size = {need} samples so that neither side stalls"
            )
        if not isinstance(self.cache_bytes, int) or self.cache_bytes < 64:
            raise ValueError(f"cache_bytes must be an int >= 64, got {self.cache_bytes!r}")
        if self.epochs not in (None, "auto") and (
            not isinstance(self.epochs, int) or self.epochs < 1
        ):
            raise ValueError(
                "epochs must be an int >= 1, 'auto' (1 with a padded reader, else endless) or "
                f"None (endless), got {self.epochs!r}"
            )
        check_memory(self.memory)
        return EchoConfig(
            batch_size=self.batch_size,
            echo_factor=e,
            mode=self.mode,
            shuffle_buffer=fill,
            cache_samples=samples,
            cache_bytes=self.cache_bytes,
            upstream_batch_size=up,
            epochs=self.epochs,
            deterministic=bool(self.deterministic),
            seed=int(self.seed),
            memory=self.memory,
        )


def make_cache(
    config: EchoConfig, name: str, device_id: int | None = None, epoch_size: int = 0
) -> Any:
    """The pipeline's echo cache; a device arena is allocated on the pipeline's ``device_id``.
    ``epoch_size`` > 0 makes the copy totals exact per epoch of that many units."""
    from ..echo import EchoCache

    if config.memory == "device" and device_id is not None:
        import torch

        with torch.cuda.device(device_id):  # the current device is where cudaMalloc allocates
            return _new_cache(EchoCache, config, name, epoch_size)
    return _new_cache(EchoCache, config, name, epoch_size)


def _new_cache(cls: Any, config: EchoConfig, name: str, epoch_size: int) -> Any:
    return cls(
        capacity_bytes=config.cache_bytes,
        capacity_samples=config.cache_samples,
        echo_factor=config.echo_factor,
        min_fill=config.shuffle_buffer,
        seed=config.seed,
        mode=config.mode,
        batch_size=config.upstream_batch_size if config.mode == "batch" else None,
        memory=config.memory,
        name=name,
        epoch_size=epoch_size,
    )
