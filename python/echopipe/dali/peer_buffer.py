"""The Python echo peer's shuffle buffer: a list with random swap-pop.

A take picks a random resident sample, and when its last ticket is used the sample is swapped
with the last element and popped, so draws are O(1). Every blocking wait is bounded and ends on
:meth:`PythonEchoBuffer.close`.
"""

from __future__ import annotations

import math
import random
import threading
import time
from typing import Any

import numpy as np

from ..echo.config import check_factor
from .builder_checks import check_positive_int

__all__ = ["PythonEchoBuffer", "Sample"]

Sample = tuple[np.ndarray, ...]


class PythonEchoBuffer:
    """Bounded shuffle buffer that emits every stored sample ``floor(e)`` or ``ceil(e)`` times.

    Args:
        capacity: most samples resident at once; :meth:`put` blocks while full.
        echo_factor: mean emissions per sample, in ``[1, MAX_ECHO_FACTOR]``.
        min_fill: :meth:`take` waits until this many samples are resident (or input ended).
        seed: seeds both the ticket draws and the random picks.
    """

    def __init__(
        self, capacity: int, echo_factor: float, *, min_fill: int = 0, seed: int = 0
    ) -> None:
        self.capacity = check_positive_int("capacity", capacity)
        e = float(check_factor(echo_factor, "echo_factor"))
        if not 0 <= int(min_fill) <= self.capacity:
            raise ValueError(f"min_fill must be in [0, capacity={capacity}], got {min_fill!r}")
        self.echo_factor = e
        self.min_fill = int(min_fill)
        self._rng = random.Random(seed)
        self._items: list[list[Any]] = []  # [sample, tickets left, tickets given]
        self._histogram: list[int] = []  # [k]: retired samples emitted exactly k times
        self._cond = threading.Condition()
        self._ended = False
        self._closed = False
        self.fresh = 0
        self.emitted = 0

    def _tickets(self) -> int:
        base = math.floor(self.echo_factor)
        return base + (1 if self._rng.random() < self.echo_factor - base else 0)

    def put(self, sample: Sample, timeout: float | None = None) -> bool:
        """Store one sample; ``False`` if the buffer was closed. ``TimeoutError`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._items) >= self.capacity and not self._closed:
                self._wait(deadline, "put")
            if self._closed:
                return False
            if self._ended:
                raise RuntimeError("put() after end_of_input()")
            tickets = self._tickets()
            self._items.append([sample, tickets, tickets])
            self.fresh += 1
            self._cond.notify_all()
            return True

    def take(self, n: int, timeout: float | None = None) -> list[Sample]:
        """Up to ``n`` samples; fewer only at the end of input, ``[]`` once everything was emitted.

        Raises:
            RuntimeError: the buffer was closed.
            TimeoutError: nothing arrived within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[Sample] = []
        with self._cond:
            while len(out) < n:
                if self._closed:
                    raise RuntimeError("the Python echo buffer was closed")
                ready = len(self._items) >= max(1, self.min_fill) or (self._ended and self._items)
                if not ready:
                    if self._ended:
                        break
                    self._wait(deadline, "take")
                    continue
                i = self._rng.randrange(len(self._items))
                item = self._items[i]
                out.append(item[0])
                item[1] -= 1
                if item[1] == 0:
                    self._retired(item[2])
                    self._items[i] = self._items[-1]
                    self._items.pop()
                    self._cond.notify_all()
            self.emitted += len(out)
        return out

    def _retired(self, emitted: int) -> None:
        if len(self._histogram) <= emitted:
            self._histogram.extend([0] * (emitted + 1 - len(self._histogram)))
        self._histogram[emitted] += 1

    def counts(self) -> tuple[int, int, list[int]]:
        """``(resident, tickets left, emit histogram)``, read together."""
        with self._cond:
            left = sum(item[1] for item in self._items)
            return len(self._items), left, list(self._histogram)

    def _wait(self, deadline: float | None, what: str) -> None:
        # Bounded waits so close() is noticed even if a notify is missed.
        left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
        if left <= 0:
            raise TimeoutError(f"Python echo buffer: {what}() timed out")
        self._cond.wait(left)

    def end_of_input(self) -> None:
        """No more puts; takes drain the remaining tickets, then return ``[]``."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def close(self) -> None:
        """Wake and fail every waiter; later puts return ``False`` and takes raise."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
