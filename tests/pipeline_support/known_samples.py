"""Samples the GPU tests can recognise by value: image k goes with label k."""

from __future__ import annotations

import numpy as np


def known_image(k: int) -> np.ndarray:
    """Sample k: random bytes from seed k, of a height that depends on k (ragged batches)."""
    return np.random.default_rng(k).integers(0, 256, size=(16 + k % 7, 24, 3), dtype=np.uint8)


class KnownSource:
    """Batches of known samples for ``fn.external_source``: image k goes with label k."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.next = 0

    def __call__(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        ks = range(self.next, self.next + self.batch)
        self.next += self.batch
        return [known_image(k) for k in ks], [np.array([k], dtype=np.int32) for k in ks]
