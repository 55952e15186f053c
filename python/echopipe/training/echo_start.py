"""``--echo auto``'s first decision, taken before the first training step.

The controller needs ``t_up`` (upstream seconds per batch of fresh samples) and ``t_down``
(seconds per training step). ``t_down`` comes from the stage timing trial of :mod:`.decide`;
``t_up`` from the upstream's own timers while it fills the echo cache, which it does before any
step needs it. Without both, the run starts at ``e = 1`` and the controller decides from its
first observations, as before.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ..echo.controller import EchoController, model_ratio
from .decide import measure_step_seconds
from .fill import FillReport
from .progress import format_duration

__all__ = ["FILL_TIMEOUT_S", "fill_seconds_per_batch", "prime_echo"]

FILL_TIMEOUT_S = 30.0  # how long the step-0 decision waits for the upstream's timed batches

_FILL_BATCHES = 3  # timed upstream iterations after the first (which carries start-up costs)
_POLL_S = 0.005  # the samples put between a batch and the poll that sees it get the old factor
_STALL_S = 1.0  # no upstream iteration for this long (or 5 of its iterations): it is blocked


def fill_seconds_per_batch(
    pipe: Any,
    timeout_s: float,
    report: FillReport | None = None,
    on_estimate: Callable[[float], None] | None = None,
) -> float | None:
    """Starts ``pipe`` (an :class:`~echopipe.dali.EchoPipeline`) and returns its upstream
    seconds per downstream batch of fresh samples over a few iterations after the first, or
    ``None`` when the upstream did not run them within ``timeout_s`` (a full cache, a slow
    reader) or ``pipe`` keeps no timers. ``report`` is told the samples read meanwhile;
    ``on_estimate`` gets each new estimate while the timing goes on."""
    from ..dali.base import per_batch_seconds  # DALI only once a pipeline exists

    if not hasattr(pipe, "upstream_time") or not hasattr(pipe, "start"):
        return None
    pipe.start()
    now = time.monotonic()
    deadline, moved = now + timeout_s, now
    first: tuple[int, float] | None = None
    last = -1
    while True:
        batches, seconds = pipe.upstream_time()
        now = time.monotonic()
        new = batches != last
        if new:
            last, moved = batches, now
        if first is None and batches >= 1:
            first = (batches, seconds)
        timed = 0 if first is None else batches - first[0]
        # The batches timed: those after the first (which carries start-up costs), or, when the
        # upstream ran every batch it will before the first poll saw it (a small shard's whole
        # epoch, a full cache), all of them, start-up included.
        if first is None:
            n, span = 0, 0.0
        elif timed or first[0] == 1:
            n, span = timed, seconds - first[1]
        else:
            n, span = first
        # A cache too small for the fill stops the upstream early: use what it timed.
        stalled = n >= 1 and now - moved > max(_STALL_S, 5 * span / n)
        estimate = per_batch_seconds(n, span, pipe.batch_size, pipe.upstream_batch_size)
        if on_estimate is not None and new and n >= 1:
            on_estimate(estimate)
        if timed >= _FILL_BATCHES or stalled:
            return estimate
        if now >= deadline:
            return None
        if report is not None:
            per = int(pipe.upstream_batch_size)
            report(batches * per, (_FILL_BATCHES + 1) * per, f"timing the reader for --echo auto "
                   f"(at most {format_duration(timeout_s)})")  # fmt: skip
        time.sleep(_POLL_S)  # the runner's counters have no event to wait on


def prime_echo(
    controller: EchoController,
    pipe: Any,
    t_down: float | None,
    decisions: list[str],
    timeout_s: float | None = None,
    report: FillReport | None = None,
    agree: Callable[[float], float] | None = None,
) -> float:
    """The step-0 echo factor: ``controller.prime`` from the fill's ``t_up`` and ``t_down``
    (seconds per training step, timed while the upstream reads, as the steps will run; ``None``
    when not measured); the decision is appended to ``decisions``. The factor
    (1 when either time is missing; the wait for ``t_up`` is ``timeout_s``, by default
    :data:`FILL_TIMEOUT_S`; ``report`` is told how it goes), passed through ``agree`` (the
    ranks' broadcast; every rank calls it once), is set on ``pipe`` and returned.

    The samples the fill put before it, at e = 1 or at an estimate's target, get its tickets
    too (``EchoCache.top_up``): put at e = 1, the first upstream batches were used once each,
    and the first steps waited for the reader twice (bench/wallclock_train.py)."""
    factor = _first_factor(controller, pipe, t_down, decisions, timeout_s, report)
    if agree is not None:
        factor = agree(factor)
    pipe.set_echo_factor(factor)
    pipe.cache.top_up()
    return factor


def _first_factor(
    controller: EchoController,
    pipe: Any,
    t_down: float | None,
    decisions: list[str],
    timeout_s: float | None,
    report: FillReport | None,
) -> float:
    timeout_s = FILL_TIMEOUT_S if timeout_s is None else timeout_s
    on_estimate: Callable[[float], None] | None = None
    if timeout_s > 0 and t_down is not None and t_down > 0:
        # Tickets are fixed when a sample is published, and the samples the fill publishes
        # while it is timed are the first steps' input: all published at e = 1, they were used
        # up in as many steps as upstream batches, and the stages then waited for the upstream
        # at every step until the factor set after the timing had echoed enough
        # (bench/wallclock_train.py: the first 10 steps took 1.76 s against 0.64 s at a fixed
        # e = 6; 1.07 s with this). So after the second upstream batch, the first one timed
        # without start-up, they are published at the target of the timing's estimate of the
        # moment; prime_echo's top-up then raises those put before it.
        # (Published at e_max before that, a fast upstream's first batches were echoed: 66
        # copies in the first epoch of the default run, whose factor is 1.)
        def provisional(t_up: float) -> None:
            pipe.set_echo_factor(controller.target(model_ratio(t_up, t_down)))

        on_estimate = provisional

    t_up = (
        fill_seconds_per_batch(pipe, timeout_s, report=report, on_estimate=on_estimate)
        if timeout_s > 0
        else None
    )
    if t_up is None or t_down is None or not math.isfinite(t_up) or t_down <= 0:
        decisions.append(
            "echo: starts at e = 1: no estimate of t_up before the first step (the upstream "
            f"did not time {_FILL_BATCHES + 1} batches within {timeout_s:g} s)"
            if t_up is None
            else "echo: starts at e = 1: the step time was not measured"
        )
        return 1.0
    factor = controller.prime(t_up, t_down)
    decisions.append(
        f"echo: e = {factor:g} from step 0 (R = {controller.ratio:.2f}: t_up "
        f"{1000 * t_up:.1f} ms per batch while the pipeline filled, t_down {1000 * t_down:.1f} "
        "ms per step in the stage trial"
        + (f"; aimed {100 * controller.headroom:g} % above R)" if controller.headroom else ")")
    )
    return factor


def start_factor(
    cfg: Any,
    ctx: Any,
    controller: EchoController,
    data: Any,
    model: Any,
    balance: list[int],
    devices: list[str],
    timings: dict[str, float],
    decisions: list[str],
    report: FillReport | None = None,
) -> float:
    """``--echo auto``'s factor before step 1, the same on every rank: the fill's ``t_up``
    over the stage trial's step time (measured on ``balance`` when the trial did not run);
    the input starts at it. ``report`` is told how the wait for ``t_up`` goes."""
    sample = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size)
    step_s = timings.get("step_s")
    if not step_s:
        # The reader goes on while the step is timed: started after the trial, it stood still
        # for the trial's length, and with the upstream the slower side that was time the run
        # lost (what it reads meanwhile is the first steps' input: prime_echo tops it up).
        data.pipe.start()
        step_s = measure_step_seconds(model, sample, balance, devices)
    factor = prime_echo(
        controller, data.pipe, step_s, decisions, report=report, agree=ctx.broadcast_object
    )
    data.set_factor(factor)
    return factor
