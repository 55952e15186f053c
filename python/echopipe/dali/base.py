"""What both echoing DALI pipelines are: :class:`EchoPipelineBase` and :class:`PipelineStats`.

:class:`~echopipe.dali.EchoPipeline` (the native echo cache between two DALI pipelines) and
:class:`~echopipe.dali.PythonEchoPipeline` (the pure-Python peer it is measured against) share
this base: the same batch sizes, echo factor, upstream timing and one stats type whose fields
mean the same in both.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Self


@dataclass(frozen=True)
class PipelineStats:
    """Counters and timing of an echoing pipeline; each field means one thing in both classes.

    Attributes:
        fresh_in: fresh samples stored into the echo cache (or the peer's buffer).
        emitted: copies drawn from it for the downstream pipeline.
        resident: samples held now.
        tickets_left: copies still owed by the samples held now.
        upstream_batches: upstream iterations timed (one reader batch each): every one run
            at DALI depth 1; at depth 2 those that ran behind another, whose time is the
            pipelined rate (one started alone, after a wait for room, costs its whole latency).
        t_up_total_s: seconds those iterations cost, in total.
        t_up_per_batch_s: upstream seconds per downstream batch of fresh samples: the mean
            iteration time scaled from ``upstream_batch_size`` to ``batch_size`` samples (nan
            before any). With ``t_down`` the consumer's time per step, ``R = t_up_per_batch_s /
            t_down`` is the echo factor that keeps both sides busy.
        upstream_epochs: reader epochs the upstream completed (0 where it counts none).
        upstream_wait_s: seconds the consumer spent filling the cache itself (deterministic
            mode only; 0 otherwise).
        downstream_wait_s: seconds the consumer waited for downstream batches.
        copies_discarded: real copies of a pass that a reset ended before they were handed
            out: the rest of the pass at ``EchoIterator.reset()`` inside an epoch, or copies
            still queued after DALI's iterator had counted its epoch (0 unless the epoch length
            DALI was told is wrong).
        emit_histogram: ``[k]`` = retired samples that were emitted exactly ``k`` times.
        source_wait_s: seconds the downstream's echo source waited for samples (the peer's
            ``external_source``; nan where it is not timed: the native source waits in C++).
    """

    fresh_in: int
    emitted: int
    resident: int
    tickets_left: int
    upstream_batches: int
    t_up_total_s: float
    t_up_per_batch_s: float
    upstream_epochs: int = 0
    upstream_wait_s: float = 0.0
    downstream_wait_s: float = 0.0
    copies_discarded: int = 0
    emit_histogram: list[int] = field(default_factory=list)
    source_wait_s: float = math.nan


def per_batch_seconds(
    batches: int, seconds: float, batch_size: int, upstream_batch_size: int
) -> float:
    """Upstream seconds per downstream batch: the mean of ``batches`` iterations that took
    ``seconds`` in all, scaled from ``upstream_batch_size`` to ``batch_size`` samples."""
    if batches == 0:
        return math.nan
    return seconds / batches * batch_size / upstream_batch_size


class EchoPipelineBase(ABC):
    """An upstream DALI pipeline and a downstream one joined by an echo stage."""

    upstream: Any
    downstream: Any

    @property
    @abstractmethod
    def batch_size(self) -> int:
        """The downstream batch size (what each iteration returns)."""

    @property
    @abstractmethod
    def upstream_batch_size(self) -> int:
        """The reader's batch size (samples per upstream iteration)."""

    @property
    @abstractmethod
    def echo_factor(self) -> float:
        """Mean copies of each fresh sample."""

    @abstractmethod
    def build(self) -> None:
        """Builds both DALI pipelines (idempotent)."""

    @abstractmethod
    def upstream_time(self) -> tuple[int, float]:
        """``(upstream batches run, seconds they took)`` so far."""

    @abstractmethod
    def stats(self) -> PipelineStats:
        """Counters and timing so far."""

    @abstractmethod
    def close(self) -> None:
        """Stops the upstream and frees both pipelines; nothing waits afterwards."""

    def upstream_step_seconds(self) -> float:
        """``t_up``: upstream seconds per downstream batch of fresh samples (nan before any);
        :attr:`PipelineStats.t_up_per_batch_s`."""
        batches, seconds = self.upstream_time()
        return per_batch_seconds(batches, seconds, self.batch_size, self.upstream_batch_size)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
