"""The upstream pipeline's iterations, scheduled ahead of the one being collected.

With DALI's ``run()`` and ``prefetch_queue_depth=1`` an upstream iteration's stages run one
after another and the next iteration starts only when this one is back: with mixed decode, the
host half of the decoder waits for the GPU half and the reader for both. The first H200 run
measured what that costs: the decode pipeline fed the echo cache at 9,700 images/s, while the
same reader and decoder alone (DALI's default depth of 2) ran at 14,800.

:class:`UpstreamFlight` drives the upstream with DALI's scheduled API (``schedule_run`` /
``outputs``) at depth 2, so iteration i + 1 runs while iteration i is collected. The runner
(:class:`~echopipe.dali.upstream.UpstreamRunner`) decides when to schedule: never more than
``depth`` in flight (DALI takes more ``schedule_run()`` calls, but a parallel
``external_source`` reuses its buffers after ``depth`` batches), only with room in the cache
for every iteration in flight, never past a reader epoch's end (the next epoch's quota is set
once the epoch's last iteration is back), and none while it pauses, after collecting the ones
in flight, so a checkpoint sees every scheduled iteration finished.

The schedule, as DALI runs it:

* the first ``schedule_run()`` (and the first after a ``reset()``) starts ``depth`` iterations,
  each later one a single iteration;
* ``outputs()`` returns the oldest iteration in flight; with none left DALI raises
  ``StopIteration``, which for an ``external_source`` that ended its epoch means: reset and
  go on, as ``run()`` does for one iteration at a time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any


class EmptyUpstreamEpochError(ValueError):
    """The upstream pipeline's input (an ``external_source``) ended an epoch with no batch,
    so reading it epoch after epoch would never store a sample."""


def empty_epoch() -> EmptyUpstreamEpochError:
    return EmptyUpstreamEpochError(
        "the upstream pipeline's input ended an epoch without a single batch (its "
        "external_source raised StopIteration at once after a reset); give the source "
        "at least one batch per epoch (an iterable or generator function source starts "
        'again only with cycle="raise", or never ends with cycle="quiet")'
    )


class UpstreamFlight:
    """Iterations of one DALI pipeline in flight, scheduled and collected in order.

    Args:
        pipe: the built upstream pipeline, made with ``prefetch_queue_depth=depth`` and DALI's
            pipelined executor (a depth of 1 gains nothing here: use ``run()``).
        depth: the pipeline's ``prefetch_queue_depth``.
        clock: seconds, for what each iteration cost (tests give their own).
    """

    def __init__(
        self, pipe: Any, depth: int, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._pipe = pipe
        self._clock = clock
        self._depth = depth
        self._first = True  # DALI's next schedule_run() prefetches `depth` iterations
        self._scheduled: deque[float] = deque()  # when each iteration in flight was scheduled
        self._ready_at = 0.0  # when the last collect returned
        self._since_reset = 0  # iterations collected since the last reset

    @property
    def in_flight(self) -> int:
        """Iterations scheduled and not yet collected (DALI may hold fewer: see ``collect``)."""
        return len(self._scheduled)

    @property
    def next_count(self) -> int:
        """How many iterations the next :meth:`schedule` starts."""
        return self._depth if self._first else 1

    def schedule(self) -> None:
        now = self._clock()
        self._pipe.schedule_run()
        self._scheduled.extend([now] * self.next_count)
        self._first = False

    def collect(self) -> tuple[Any, float, bool] | None:
        """The oldest iteration's outputs, the seconds it cost the upstream and whether that
        is the pipelined rate. The cost runs from when this side was ready for it (its
        schedule, or the last collect if later) until it was back, so that iterations
        overlapping each other are not counted twice. It is the pipelined rate (``True``) when
        the iteration ran behind another, scheduled before the last collect; one started alone
        (after a wait for room, a pause or an epoch's end) costs its whole latency, and
        counting that would make an upstream held back by a full cache look slower the more it
        is held back. ``None`` when the input ended its epoch (the pipeline is reset, nothing is
        in flight)."""
        try:
            outputs = self._pipe.outputs()
        except StopIteration:
            # An external_source ended its epoch: DALI holds no iteration, whatever was
            # counted as scheduled (a schedule_run that met the end started none).
            self._scheduled.clear()
            if self._since_reset == 0:
                raise empty_epoch() from None
            self._pipe.reset()
            self._first, self._since_reset = True, 0
            return None
        done = self._clock()
        scheduled = self._scheduled.popleft() if self._scheduled else done
        behind = scheduled < self._ready_at
        cost = done - max(scheduled, self._ready_at)
        self._ready_at = done
        self._since_reset += 1
        return outputs, cost, behind
