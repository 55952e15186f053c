"""What echoing takes, defined once: :class:`EchoConfig`, its fields, defaults, help and bounds.

Every bound is the native core's own (constants of the compiled module, e.g.
``MAX_ECHO_FACTOR``: a sample's tickets are 16 bits wide), so a value the core would refuse is
refused here, before any cache is made, by one typed error, :class:`EchoConfigError`, whose
message names the field and the value. The DALI pipelines, the echo cache and the training CLI
check their echo values with :meth:`EchoConfig.check_field` (or :func:`check_factor` for the
factor alone), so no other module writes these bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from ..native import core
from .memory import MEMORY_KINDS

__all__ = [
    "DEFAULT_SHUFFLE_BATCHES",
    "FACTOR_AUTO",
    "MAX_CAPACITY_BYTES",
    "MAX_CAPACITY_SAMPLES",
    "MAX_ECHO_FACTOR",
    "MAX_EPOCH_SIZE",
    "MAX_SEED",
    "MIN_CAPACITY_BYTES",
    "MODES",
    "PLACEMENTS",
    "EchoConfig",
    "EchoConfigError",
    "check_factor",
    "check_int",
]

#: Largest echo factor: the core keeps a sample's tickets in 16 bits.
MAX_ECHO_FACTOR: float = float(core.MAX_ECHO_FACTOR)
#: Smallest arena: one field, aligned.
MIN_CAPACITY_BYTES: int = int(core.MIN_CAPACITY_BYTES)
#: Most resident samples (slots) of one cache.
MAX_CAPACITY_SAMPLES: int = int(core.MAX_CAPACITY_SAMPLES)
#: Largest ``epoch_size`` (units per block of exact copy totals).
MAX_EPOCH_SIZE: int = int(core.MAX_EPOCH_SIZE)
#: Largest arena: the core addresses it by int64 offsets (and allocates what it is given).
MAX_CAPACITY_BYTES: int = (1 << 63) - 1
#: Largest cache seed: the core's seed is an unsigned 64-bit integer.
MAX_SEED: int = (1 << 64) - 1

#: Default shuffle buffer, in downstream batches. The cache draws uniformly from what it holds,
#: so a buffer of F fresh samples spreads echoed copies like a full shuffle of F samples: at
#: e = 2 and batch 16, one batch's worth puts two copies of a sample into nearly every batch
#: (copies about 1 batch apart), four batches' worth into about 60 % (5 batches apart), which is
#: what a full shuffle of a 60-file data set gives (tests/test_dali_spread.py).
DEFAULT_SHUFFLE_BATCHES = 4

FACTOR_AUTO = "auto"
PLACEMENTS = ("after_decode", "after_augment")
MODES = ("example", "batch")


class EchoConfigError(ValueError):
    """An echo value out of its bound; ``field`` and ``value`` name it (so does the message)."""

    def __init__(self, field: str, value: Any, requirement: str) -> None:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else f"{shown[:77]}..."  # a crafted value stays one line
        super().__init__(f"{field} must be {requirement}, got {shown}")
        self.field = field
        self.value = value


def _is_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def check_factor(value: Any, name: str = "factor", *, allow_auto: bool = False) -> float | str:
    """``value`` as an echo factor: a finite number in ``[1, MAX_ECHO_FACTOR]`` (a float), or
    ``"auto"`` when ``allow_auto``. EchoConfigError names ``name`` and the value otherwise."""
    if allow_auto and value == FACTOR_AUTO:
        return FACTOR_AUTO
    requirement = f"a finite number in [1, {MAX_ECHO_FACTOR:g}]" + (
        " or 'auto'" if allow_auto else ""
    )
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise EchoConfigError(name, value, requirement)
    e = float(value)
    if not (math.isfinite(e) and 1.0 <= e <= MAX_ECHO_FACTOR):
        raise EchoConfigError(name, value, requirement)
    return e


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise EchoConfigError(name, value, f"one of {choices}")
    return value


def check_int(name: str, value: Any, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high]``; EchoConfigError names ``name`` and the value."""
    if not _is_int(value) or not low <= value <= high:
        raise EchoConfigError(name, value, f"an integer in [{low}, {high}]")
    return int(value)


def _check_shuffle_buffer(name: str, value: Any) -> int | None:
    if value is None:
        return None
    return check_int(name, value, 0, MAX_CAPACITY_SAMPLES)


_CHECKS: dict[str, Any] = {
    "factor": lambda name, v: check_factor(v, name, allow_auto=True),
    "factor_max": lambda name, v: check_factor(v, name),
    "placement": lambda name, v: _check_choice(name, v, PLACEMENTS),
    "mode": lambda name, v: _check_choice(name, v, MODES),
    "shuffle_buffer": _check_shuffle_buffer,
    "cache_bytes": lambda name, v: check_int(name, v, MIN_CAPACITY_BYTES, MAX_CAPACITY_BYTES),
    "memory": lambda name, v: _check_choice(name, v, MEMORY_KINDS),
}


@dataclass(frozen=True)
class EchoConfig:
    """What echoing takes; validated when made (:class:`EchoConfigError` names a bad field).

    Each field's ``metadata["help"]`` says what it means, so a command line can be generated
    from the fields; :meth:`check_field` checks one value on its own.
    """

    factor: float | str = field(
        default=FACTOR_AUTO,
        metadata={
            "help": "echo factor e >= 1 (1 = no echoing): each fresh sample is emitted floor(e) "
            "or ceil(e) times; or 'auto': e follows R = t_up/t_down (up to its maximum) and "
            "stays 1 while the input keeps up"
        },
    )
    factor_max: float = field(
        default=4.0, metadata={"help": "upper bound of the echo factor chosen by 'auto'"}
    )
    placement: str = field(
        default="after_decode",
        metadata={
            "help": "where the echo cache sits: after_decode (copies get their own "
            "augmentation) or after_augment (copies are identical)"
        },
    )
    mode: str = field(
        default="example",
        metadata={"help": "echo single examples, or whole upstream batches (batch)"},
    )
    shuffle_buffer: int | None = field(
        default=None,
        metadata={
            "help": "samples the echo cache holds before the first draw (default: "
            f"{DEFAULT_SHUFFLE_BATCHES} batches' worth, which spreads the copies of a sample "
            "about as far apart as a full shuffle of the buffer)"
        },
    )
    cache_bytes: int = field(
        default=256 << 20,
        metadata={"help": "size of the echo cache arena, which holds the cached samples"},
    )
    memory: str = field(
        default="auto",
        metadata={
            "help": "where the cache arena lives: auto, pageable, pinned or device (GPU memory)"
        },
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, self.check_field(f.name, getattr(self, f.name)))

    @classmethod
    def check_field(cls, name: str, value: Any, label: str | None = None) -> Any:
        """``value`` of field ``name``, checked (and a factor made a float); EchoConfigError
        names ``label`` (the caller's name for the field, e.g. an option; default ``name``) and
        the value when it is out of bounds. KeyError for an unknown name."""
        if name not in _CHECKS:
            raise KeyError(f"EchoConfig has no field {name!r}")
        return _CHECKS[name](label or name, value)

    @classmethod
    def help(cls, name: str) -> str:
        """The help text of field ``name``."""
        return str(next(f for f in fields(cls) if f.name == name).metadata["help"])

    @property
    def adaptive(self) -> bool:
        """True for ``factor="auto"``."""
        return self.factor == FACTOR_AUTO
