"""What a run says while its input fills before the first step.

The first step waits until the echo cache holds the shuffle buffer (``--shuffle-buffer``, 4
batches by default), and with ``--echo auto`` the start first times a few upstream batches (at
most :data:`~.echo_start.FILL_TIMEOUT_S`). With a slow reader (a network file system,
``--read-delay-ms``) that is many seconds in which nothing else is said, so a wait longer than
:data:`FILL_QUIET_S` says what it waits for, and then again about every :data:`FILL_EVERY_S`,
as the data check's lines do (not with ``--no-progress``). A fill that ends sooner says nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .progress import format_duration

__all__ = ["FILL_EVERY_S", "FILL_QUIET_S", "FillReport", "fill_report", "wait_for_fill"]

FILL_QUIET_S = 2.0
"""A wait before step 1 shorter than this says nothing (a local disk fills in well under it)."""

FILL_EVERY_S = 10.0
"""Seconds between the lines of a longer wait."""

_POLL_S = 0.05  # the cache's counters have no event to wait on


class FillReport:
    """The lines of the waits before step 1, through ``say``; ``clock`` is injectable so that
    the lines can be checked on given timings.

    Call it with the samples read so far, those the wait needs, and what it waits for; it says
    a line only once the waits have lasted ``quiet_s``, then at most every ``every_s``.
    """

    def __init__(
        self,
        say: Callable[[str], None],
        *,
        quiet_s: float = FILL_QUIET_S,
        every_s: float = FILL_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.say, self.clock, self.every_s = say, clock, every_s
        self.began = clock()
        self.next_at = self.began + quiet_s
        self.lines = 0

    def __call__(self, read: int, need: int, what: str) -> None:
        now = self.clock()
        if read >= need or now < self.next_at:
            return
        self.next_at = now + self.every_s
        line = f"input: before step 1, {what}: {read} of {need} samples read so far"
        if read:
            rate = read / max(now - self.began, 1e-9)
            line += f" ({rate:.2g}/s, about {format_duration((need - read) / rate)} left)"
        self.say(line)
        self.lines += 1


def fill_report(cfg: Any, ctx: Any, say: Callable[[str], None]) -> FillReport | None:
    """The report of a wait that starts now: on the process that shows progress, unless
    ``--no-progress`` (as the data check's lines)."""
    return FillReport(say) if cfg.progress and ctx.is_main else None


def wait_for_fill(pipe: Any, report: FillReport | None, poll_s: float = _POLL_S) -> None:
    """Wait until ``pipe``'s echo cache holds what the first draw waits for (the shuffle buffer
    and a batch), saying so through ``report``.

    Returns at once without ``report`` (the first step waits, as before), in deterministic
    mode (the consumer's thread fills the cache, inside the first step), and as soon as the
    cache cannot fill further: its input ended, a producer waits for room (the draws then skip
    the shuffle buffer), or it was closed (the upstream failed: the first step raises its
    error). So this waits no longer than that draw would."""
    if report is None or pipe.config.deterministic:
        return
    need = max(int(pipe.config.echo.shuffle_buffer), int(pipe.batch_size))
    what = f"filling the echo cache (--shuffle-buffer {pipe.config.echo.shuffle_buffer})"
    pipe.start()
    while True:
        s = pipe.cache.stats()
        if s.closed or s.input_ended or s.producers_waiting or s.resident_with_tickets >= need:
            return
        report(int(s.resident_with_tickets), need, what)
        time.sleep(poll_s)
