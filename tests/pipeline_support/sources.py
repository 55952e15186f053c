"""Per-sample ``external_source`` callbacks for the DALI tests, in a module of their own so that
DALI's parallel workers (started with ``spawn``) can import them."""

from __future__ import annotations

from typing import Any

import numpy as np


class EpochSource:
    """DALI's per-sample callback shape: sample ``k`` of an epoch is a 4 x 4 image of grey ``k``
    with label ``k``, and ``StopIteration`` after ``count`` samples ends the epoch."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __call__(self, info: Any) -> tuple[np.ndarray, np.ndarray]:
        if info.idx_in_epoch >= self.count:
            raise StopIteration
        k = info.idx_in_epoch
        return np.full((4, 4, 3), k, np.uint8), np.array([k], np.int32)


class EndlessSource:
    """Sample ``k`` of the stream is an image of ``shape`` filled with ``k % 251`` and label ``k``;
    the stream never ends. Large images put each batch in fresh shared memory of DALI's pool."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def __call__(self, info: Any) -> tuple[np.ndarray, np.ndarray]:
        k = info.idx_in_epoch
        return np.full(self.shape, k % 251, np.uint8), np.array(k, np.int32)
