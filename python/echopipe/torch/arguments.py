"""The checks of :class:`echopipe.torch.EchoLoader`'s arguments: each value is taken or named
in one line where it is given, not met later as a failure inside a pass."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..echo import config as echo_config
from ..echo.config import FACTOR_AUTO, EchoConfig
from ..echo.controller import AUTO_HEADROOM, AUTO_WARMUP, EchoController

__all__ = [
    "check_count", "check_deterministic", "check_device", "check_echo", "check_factor",
    "check_seconds", "check_seed",
]  # fmt: skip


def check_factor(value: Any) -> float:
    """``value`` as a number ``echo_factor`` in EchoConfig's bound (EchoConfigError names it)."""
    return float(echo_config.check_factor(value, "echo_factor"))


def check_echo(echo_factor: Any, echo_max: Any) -> tuple[float, EchoController | None]:
    """The starting ``e`` and, for ``"auto"``, its controller; each value within EchoConfig's
    bound (EchoConfigError names ``echo_factor`` or ``echo_max``)."""
    factor = EchoConfig.check_field("factor", echo_factor, "echo_factor")
    e_max = EchoConfig.check_field("factor_max", echo_max, "echo_max")
    if factor == FACTOR_AUTO:
        return 1.0, EchoController(1.0, e_max=e_max, warmup=AUTO_WARMUP, headroom=AUTO_HEADROOM)
    return factor, None


def check_deterministic(value: Any, controller: EchoController | None) -> bool:
    """``deterministic`` as a bool; with ``"auto"`` (a timing-based e) it is refused."""
    if not isinstance(value, bool):
        raise TypeError(f"deterministic must be True or False, got {value!r}")
    if value and controller is not None:
        raise ValueError("deterministic=True needs a fixed echo_factor: 'auto' follows timings")
    return value


#: EchoLoader's arguments that are EchoConfig fields, and the field (whose bound they keep).
_ECHO_FIELDS = {"shuffle_buffer": "shuffle_buffer", "capacity_bytes": "cache_bytes"}


def check_count(name: str, value: Any, minimum: int = 1) -> int | None:
    """``value``: ``None`` or an int >= ``minimum``, and within its EchoConfig field's bound
    where ``name`` is one (:data:`_ECHO_FIELDS`); the error names ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if name in _ECHO_FIELDS:
        EchoConfig.check_field(_ECHO_FIELDS[name], value, name)
    return int(value)


def check_seed(value: Any) -> int:
    """``value`` as the cache's seed, within the core's bound (EchoConfigError names ``seed``)."""
    return echo_config.check_int("seed", value, 0, echo_config.MAX_SEED)


def check_seconds(name: str, value: Any, optional: bool = True) -> float | None:
    """``value``: a positive number of seconds, or ``None`` where ``optional``; the error
    names ``name``."""
    if (value is not None or not optional) and not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return None if value is None else float(value)


def check_device(device: Any) -> torch.device | None:
    """``device`` as a torch.device (None stays None), and for CUDA one that torch can use, so
    that a wrong one is named here rather than by torch at the first batch."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be a torch.device or a str, got {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"device must be a device such as 'cpu' or 'cuda:0', got {device!r}"
        ) from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            raise ValueError(
                f"device={device!r} needs CUDA device {dev.index or 0}, but torch sees {count} "
                "CUDA devices"
            )
    return dev
