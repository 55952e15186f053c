"""The echo cache's Python side: the cache, its put/take paths, what it hands back, the device
gather and its leases, the arena's memory kind, and the controller that picks the echo factor.

* :mod:`.config`: :class:`EchoConfig`, what echoing takes and its bounds (the core's);
* :mod:`.cache`: :class:`EchoCache`, construction, stats and state;
* :mod:`.lifetime`: closing caches at garbage collection and at interpreter exit;
* :mod:`.transfer`: host arrays in, samples and batches out (functions of the native cache);
* :mod:`.values`: the errors (one hierarchy under :class:`EchoCacheError`), :class:`EchoStats`,
  :class:`EchoSample`, :class:`EchoBatch`;
* :mod:`.device_gather` and :mod:`.inflight`: one gather launch per batch into device memory,
  with the samples' leases kept until the GPU has read them;
* :mod:`.memory`: where an arena lives (``memory="auto"``);
* :mod:`.controller`: :class:`EchoController`, ``e`` kept close to ``R = t_up / t_down``.
"""

from __future__ import annotations

from .cache import EchoCache, copies_per_epoch
from .config import EchoConfig, EchoConfigError
from .controller import EchoChange, EchoController
from .values import (
    CacheClosedError,
    CacheForkedError,
    CacheStateError,
    CacheTooSmallError,
    EchoBatch,
    EchoCacheError,
    EchoSample,
    EchoStats,
    InputEndedError,
    SampleTooLargeError,
)

__all__ = [
    "CacheClosedError",
    "CacheForkedError",
    "CacheStateError",
    "CacheTooSmallError",
    "EchoBatch",
    "EchoCache",
    "EchoCacheError",
    "EchoChange",
    "EchoConfig",
    "EchoConfigError",
    "EchoController",
    "EchoSample",
    "EchoStats",
    "InputEndedError",
    "SampleTooLargeError",
    "copies_per_epoch",
]
