"""Adaptive echo factor: keep the echo factor ``e`` close to ``R = t_up / t_down``.

Data echoing pays off when the upstream part of the input pipeline (reading, decoding) is
slower than the downstream part (augmenting, training): with ``R = t_up / t_down`` upstream
time per batch over downstream time per batch, echoing each fresh sample ``e ≈ R`` times keeps
the accelerator busy without reusing data more than needed (Choi et al., 2019). ``R`` is not
known in advance and drifts (network reads, thermal throttling, a hybrid schedule that slows
the downstream), so :class:`EchoController` measures it as training runs.

The controller smooths both times with exponential moving averages, clamps the ratio to
``[1, e_max]``, rounds it to a grid (``quantum``) and changes ``e`` only when the target leaves
a relative band around the current value (hysteresis). The band keeps ``e`` from flapping
between neighbouring values on noisy timings. A raise is immediate, a lower factor must be asked
for ``patience`` observations in a row: too little echo leaves the accelerator idle, so a short
dip of ``R`` (measured in ``echopipe train``: a busy machine dropped ``e`` from 7.25 to 3.75 for
20 steps) must not cost input-bound steps. Each real change is recorded with the step, the
measured ratio and the new factor, so a run can report the ``e`` it used over time.

:meth:`EchoController.prime` takes the first decision before the first step from estimates
(the upstream's rate while the pipeline fills, the downstream step of a timing trial), so a
run does not spend its first steps input-bound at ``e = 1``. Augmentation placed after the echo
point runs once per *delivered* sample, so ``e`` times per fresh one; where it shares the input
workers with the upstream, :func:`model_ratio` counts it: the input side keeps up when
``t_up / e + t_aug <= t_down``. A lowering goes only as far as every observation of the run
that asked for it agrees (the highest target among them), so noise does not drop ``e`` deep.
With ``headroom`` the target sits that share above ``R``: too little echo costs more than too
much (see the argument of that name). The upstream goes on reading while the downstream pauses
(validation, checkpoints) as far as the cache has room; :meth:`EchoController.set_pause` counts
that share of its time (``t_pause``), which the steps do not wait for.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "AUTO_HEADROOM",
    "AUTO_WARMUP",
    "PAUSE_WINDOW",
    "EchoChange",
    "EchoController",
    "model_ratio",
]

_RATIO_CAP = 1e9  # recorded instead of inf (checkpoints and JSON files hold finite numbers)

#: ``headroom`` of every ``"auto"`` echo factor (``echopipe train --echo auto`` and
#: ``EchoLoader(echo_factor="auto")``): none. Aiming 10 % above ``R`` made up for a step-0
#: estimate of ``R`` that came out 0.79-0.85 of the run's (a trial window that counted the
#: pipeline's fill as step time); with that bias gone, ``e = 1.1 R`` reached the target later than
#: ``e = 0.85 R`` at every target of bench/wallclock_train.py (docs/design.md, "`--echo auto`").
AUTO_HEADROOM = 0.0

#: Pauses :meth:`EchoController.set_pause` keeps: ``t_pause`` is the least of the last ones.
#: The pauses between epochs of the wall-clock study scattered between 0.33 and 0.70 s
#: (checkpoint writes), and the first also built the validation pipeline (about 1 s): one by one
#: they moved the factor after every epoch, and an average kept the first one's reads for epochs
#: (a factor too low from then on). The least of three errs to the cheaper side (more echo).
PAUSE_WINDOW = 3

#: ``warmup`` of every ``"auto"`` echo factor: one observation. Until the first decision the
#: input runs at ``e = 1`` with the trainer waiting for each batch; the first reading carries
#: start-up costs, the second is the trainer's own. ``EchoLoader`` used the class default of
#: 3: its first decision came at batch 6 instead of 2, and a new loader's first epoch ran at
#: 2,315 against 2,458 images/s (bench/echo_loader.py's slow reader, R = 4, median of 4
#: alternating pairs, the later decision slower in each pair).
AUTO_WARMUP = 1


@dataclass(frozen=True)
class EchoChange:
    """One decision of the controller: from ``step`` on, echo with ``factor``.

    Attributes:
        step: downstream step at which the factor took effect.
        factor: the echo factor chosen.
        ratio: the modelled ``R`` (:func:`model_ratio`) that led to it (``nan`` for an initial
            value that was not primed; capped at ``1e9`` where no factor keeps up).
    """

    step: int
    factor: float
    ratio: float


def model_ratio(t_up: float, t_down: float, t_aug: float = 0.0, t_pause: float = 0.0) -> float:
    """The echo factor at which the input side just keeps up with the downstream.

    Per delivered batch the input workers spend ``t_up / e`` on fresh data (read, decode: the
    part before the echo point) and ``t_aug`` on the augmentation after it, which runs for every
    copy. They keep up with a downstream step of ``t_down`` when ``t_up / e + t_aug <= t_down``,
    so at ``e = t_up / (t_down - t_aug)``; ``inf`` when ``t_aug >= t_down`` (no factor makes
    the input keep up; the most echo loses least). ``t_aug = 0`` gives ``R = t_up / t_down``.

    ``t_pause`` is the part of ``t_up`` per fresh batch that the upstream does while the
    downstream pauses (validation, checkpoints: it reads into the cache's room meanwhile), so
    no step waits for it: ``(t_up - t_pause) / e + t_aug <= t_down``. A pause that reads all of
    the next fresh data gives 0, which a controller clamps to 1.
    """
    if t_aug >= t_down:
        return math.inf
    return max(t_up - t_pause, 0.0) / (t_down - t_aug)


def _check_positive_finite(name: str, value: float, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return v


class EchoController:
    """Chooses the echo factor from measured upstream and downstream times.

    Args:
        initial: the factor to start with (in ``[1, e_max]``).
        e_max: upper bound on the factor (``>= 1``).
        smoothing: EMA weight of a new observation, in ``(0, 1]`` (1 = no smoothing).
        hysteresis: relative band: ``e`` changes only when the rounded target differs from it by
            more than ``hysteresis * e``.
        warmup: observations to skip before averaging and deciding (timings of the first steps
            include start-up costs, which would bias the averages for many steps).
        quantum: factors are rounded to multiples of this (``> 0``), and never below 1.
        patience: observations in a row that must ask for a *lower* factor before it is lowered
            (to the highest target among them). Too little echo leaves the accelerator waiting
            for input, while a little too much only repeats samples a bit more; a short
            slowdown of the downstream (another process, a validation pass) lowers the measured
            ``R`` for a few steps and should not drop ``e``.
        raise_patience: observations in a row that must ask for a *higher* factor before it is
            raised (to the lowest target among them), in ``[1, patience]``; 1 raises at once.
            The first decision of a controller that was not primed is always taken at once.
        headroom: the target is ``R * (1 + headroom)``, ``>= 0``. The two errors do not cost
            the same: ``e`` below the true ``R`` idles the accelerator for a share
            ``1 - e / R`` of the time, while ``e`` above it only repeats samples a little more
            at full step rate. Where ``R`` is measured to within some noise, aiming a little
            above it trades the costly error for the cheap one.

    Example::

        controller = EchoController(e_max=4)
        for step, (t_up, t_down) in enumerate(timings):
            new_factor = controller.observe(t_up, t_down, step)
            if new_factor is not None:
                cache.set_echo_factor(new_factor)
    """

    def __init__(
        self,
        initial: float = 1.0,
        *,
        e_max: float = 8.0,
        smoothing: float = 0.2,
        hysteresis: float = 0.15,
        warmup: int = 3,
        quantum: float = 0.25,
        patience: int = 10,
        raise_patience: int = 1,
        headroom: float = 0.0,
    ) -> None:
        self.e_max = _check_positive_finite("e_max", e_max)
        if self.e_max < 1:
            raise ValueError(f"e_max must be >= 1, got {e_max!r}")
        initial_v = _check_positive_finite("initial", initial)
        if not 1 <= initial_v <= self.e_max:
            raise ValueError(f"initial must be in [1, e_max={self.e_max:g}], got {initial!r}")
        self.smoothing = _check_positive_finite("smoothing", smoothing)
        if self.smoothing > 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.hysteresis = _check_positive_finite("hysteresis", hysteresis, allow_zero=True)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
        self.warmup = warmup
        self.quantum = _check_positive_finite("quantum", quantum)
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be an int >= 1, got {patience!r}")
        self.patience = patience
        if isinstance(raise_patience, bool) or not isinstance(raise_patience, int):
            raise ValueError(f"raise_patience must be an int >= 1, got {raise_patience!r}")
        if not 1 <= raise_patience <= patience:
            raise ValueError(f"raise_patience must be in [1, patience], got {raise_patience!r}")
        self.raise_patience = raise_patience
        self.headroom = _check_positive_finite("headroom", headroom, allow_zero=True)
        self.above = 0  # observations in a row whose target was above the band
        self.above_target = 0.0  # the lowest target among them
        self.below = 0  # observations in a row whose target was below the band
        self.below_target = 0.0  # the highest target among them
        self.factor = initial_v
        self.observations = 0
        self.t_up: float | None = None
        self.t_down: float | None = None
        self.t_aug: float | None = None
        self.pauses: list[float] = []  # set_pause's last PAUSE_WINDOW readings
        self.history: list[EchoChange] = [EchoChange(0, initial_v, math.nan)]

    @property
    def ratio(self) -> float:
        """The modelled ``R`` from the smoothed times (:func:`model_ratio`; ``nan`` before the
        first observation)."""
        if self.t_up is None or self.t_down is None or self.t_down <= 0:
            return math.nan
        return model_ratio(self.t_up, self.t_down, self.t_aug or 0.0, self.t_pause)

    @property
    def t_pause(self) -> float:
        """:func:`model_ratio`'s ``t_pause``: the least of the last :data:`PAUSE_WINDOW`
        readings of :meth:`set_pause` (0 before any)."""
        return min(self.pauses, default=0.0)

    def target(self, ratio: float) -> float:
        """The factor the controller aims at for ``ratio``: ``ratio * (1 + headroom)``, clamped
        to ``[1, e_max]`` and rounded.

        A ratio the times cannot define (``nan``: a smoothed ``t_down`` that underflowed to 0)
        keeps the current factor.
        """
        if math.isnan(ratio):
            return self.factor
        clamped = min(max(ratio * (1.0 + self.headroom), 1.0), self.e_max)
        steps = clamped / self.quantum
        if not math.isfinite(steps):  # a quantum too small to count in
            return clamped
        return min(max(round(steps) * self.quantum, 1.0), self.e_max)

    def prime(self, t_up: float, t_down: float, t_aug: float = 0.0) -> float:
        """The step-0 decision from estimates taken before the first step; returns the factor.

        Seeds the averages with the estimates (so the first observations refine them rather
        than start from nothing) and replaces the initial entry of :attr:`history` with
        ``EchoChange(0, factor, ratio)``. Only before any observation.

        Args:
            t_up: estimated upstream seconds per batch of fresh samples, ``>= 0``.
            t_down: estimated downstream seconds per step, ``> 0``.
            t_aug: estimated seconds per delivered batch of the augmentation after the echo
                point that runs on the input workers, ``>= 0``.
        """
        up = _check_positive_finite("t_up", t_up, allow_zero=True)
        down = _check_positive_finite("t_down", t_down)
        aug = _check_positive_finite("t_aug", t_aug, allow_zero=True)
        if self.observations or len(self.history) > 1:
            raise RuntimeError("prime() is the first decision: the controller already observed")
        self.t_up, self.t_down, self.t_aug = up, down, aug
        ratio = self.ratio
        self.factor = self.target(ratio)
        self.history = [EchoChange(0, self.factor, min(ratio, _RATIO_CAP))]
        return self.factor

    def observe(self, t_up: float, t_down: float, step: int, t_aug: float = 0.0) -> float | None:
        """Feed one measurement; returns the new factor when it changes, else ``None``.

        Args:
            t_up: upstream seconds per batch (reading and decoding), ``>= 0``.
            t_down: downstream seconds per batch (augmenting and training), ``> 0``.
            step: the current downstream step (recorded with a change).
            t_aug: seconds per delivered batch of augmentation after the echo point that runs
                on the input workers (:func:`model_ratio`), ``>= 0``.
        """
        up = _check_positive_finite("t_up", t_up, allow_zero=True)
        down = _check_positive_finite("t_down", t_down)
        aug = _check_positive_finite("t_aug", t_aug, allow_zero=True)
        self.observations += 1
        if self.observations <= self.warmup:
            return None  # start-up costs: kept out of the averages, not only out of decisions
        a = self.smoothing
        self.t_up = up if self.t_up is None else (1 - a) * self.t_up + a * up
        self.t_down = down if self.t_down is None else (1 - a) * self.t_down + a * down
        self.t_aug = aug if self.t_aug is None else (1 - a) * self.t_aug + a * aug
        ratio = self.ratio
        target = self.target(ratio)
        if abs(target - self.factor) <= self.hysteresis * self.factor:
            self.below = self.above = 0
            return None
        if target > self.factor:
            self.below = 0
            self.above_target = target if self.above == 0 else min(self.above_target, target)
            self.above += 1
            # The first decision of a controller that was not primed is taken at once.
            first = len(self.history) == 1 and math.isnan(self.history[0].ratio)
            if self.above < self.raise_patience and not first:
                return None
            target = self.above_target
        else:
            self.above = 0
            # Lowered only as far as every observation of this run agrees: under noise the
            # run's lowest readings are not what the machine does (bench/README.md, 2b).
            self.below_target = target if self.below == 0 else max(self.below_target, target)
            self.below += 1
            if self.below < self.patience:
                return None
            target = self.below_target
        return self._change(target, step, ratio)

    def _change(self, target: float, step: int, ratio: float) -> float:
        """Takes ``target`` as the factor from ``step`` on, recorded with the ``ratio`` that led
        to it; a decision clears the runs of readings that asked for one."""
        self.below = self.above = 0
        self.factor = target
        self.history.append(EchoChange(int(step), target, min(ratio, _RATIO_CAP)))
        return target

    def set_pause(self, t_pause: float, step: int) -> float | None:
        """One pause's upstream seconds per fresh batch that ran while the downstream paused
        (:func:`model_ratio`'s ``t_pause``); returns the new factor when it changes, else
        ``None``.

        The model takes the least of the last :data:`PAUSE_WINDOW` readings. Where that moves
        the target more than one grid step (``quantum``) from the factor, the factor goes there
        at once, band and patience aside: those are for the scatter of single steps, while a
        pause is measured whole and recurs (validation after every epoch), and what its reads
        give (at R = 7.1, about 1 of e in the wall-clock study) is within the band. Before the
        first observation it is only kept.

        Args:
            t_pause: seconds per fresh batch, ``>= 0`` (``0``: the pause read nothing).
            step: the current downstream step (recorded with a change).
        """
        new = _check_positive_finite("t_pause", t_pause, allow_zero=True)
        self.pauses = [*self.pauses, new][-PAUSE_WINDOW:]
        target = self.target(self.ratio)
        if abs(target - self.factor) <= self.quantum:
            return None
        return self._change(target, step, self.ratio)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue after a restart (for checkpoints)."""
        return {
            "factor": self.factor,
            "observations": self.observations,
            "below": self.below,
            "below_target": self.below_target,
            "above": self.above,
            "above_target": self.above_target,
            "t_up": self.t_up,
            "t_down": self.t_down,
            "t_aug": self.t_aug,
            "pauses": list(self.pauses),
            "history": [asdict(c) for c in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the bounds and tuning come from the constructor."""
        factor = float(state["factor"])
        if not 1 <= factor <= self.e_max:
            raise ValueError(f"saved echo factor {factor:g} is outside [1, {self.e_max:g}]")
        self.factor = factor
        self.observations = int(state["observations"])
        self.below = int(state.get("below", 0))
        self.below_target = float(state.get("below_target", 0.0))
        self.above = int(state.get("above", 0))
        self.above_target = float(state.get("above_target", 0.0))
        self.t_up = None if state["t_up"] is None else float(state["t_up"])
        self.t_down = None if state["t_down"] is None else float(state["t_down"])
        aug = state.get("t_aug")
        self.t_aug = None if aug is None else float(aug)
        self.pauses = [float(v) for v in state.get("pauses", [])][-PAUSE_WINDOW:]
        self.history = [EchoChange(int(c["step"]), float(c["factor"]), float(c["ratio"]))
                        for c in state["history"]]  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"EchoController(factor={self.factor:g}, ratio={self.ratio:.3g}, "
            f"e_max={self.e_max:g}, headroom={self.headroom:g}, changes={len(self.history) - 1})"
        )
