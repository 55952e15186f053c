"""The counters of an :class:`~echopipe.dali.EchoIterator` (:class:`EchoIteratorStats`), kept
apart from :mod:`.iterator` so that module stays short (the package keeps modules <= 400
lines)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class EchoIteratorStats:
    """Counters of an :class:`EchoIterator` since it was created (restored with its state)."""

    steps: int = 0
    samples: int = 0  #: samples handed out (after the last-batch policy)
    fresh: int = 0  #: of those, first copies of a sample (emission 0)
    echoed: int = 0  #: of those, repeated copies
    padded: int = 0  #: padding samples handed out (FILL policy at the end of a finite stream)
    dropped: int = 0  #: real samples not handed out (DROP / PARTIAL trimming)
    epochs: int = 0
    #: upstream seconds per downstream batch of fresh samples (the pipeline's
    #: :meth:`~echopipe.dali.EchoPipeline.upstream_step_seconds`, in both modes); nan before any
    t_up: float = math.nan
    t_down: float = 0.0  #: seconds the consumer waited for downstream batches, in total
    upstream_batches: int = 0  #: upstream (reader) iterations run so far
    upstream_time_s: float = 0.0  #: seconds those upstream iterations took

    @property
    def echo_ratio(self) -> float:
        """Samples handed out per fresh sample (the realised echo factor)."""
        return self.samples / self.fresh if self.fresh else math.nan

    @property
    def t_down_per_step(self) -> float:
        """Mean seconds the consumer waited per step for the downstream (nan before a step)."""
        return self.t_down / self.steps if self.steps else math.nan

    @property
    def ratio(self) -> float:
        """``R = t_up / t_down`` per step, as the iterator sees it (nan until both are known).

        ``t_down`` here is the wait for the downstream DALI pipeline only; a training loop that
        computes between steps should divide :attr:`t_up` by its own step time instead.
        """
        down = self.t_down_per_step
        return self.t_up / down if down > 0 else math.nan
