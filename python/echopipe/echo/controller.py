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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["EchoChange", "EchoController"]


@dataclass(frozen=True)
class EchoChange:
    """One decision of the controller: from ``step`` on, echo with ``factor``.

    Attributes:
        step: downstream step at which the factor took effect.
        factor: the echo factor chosen.
        ratio: the smoothed ``R = t_up / t_down`` that led to it (``nan`` for the initial value).
    """

    step: int
    factor: float
    ratio: float


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
            (a raise is immediate). Too little echo leaves the accelerator waiting for input,
            while a little too much only repeats samples a bit more; a short slowdown of the
            downstream (another process, a validation pass) lowers the measured ``R`` for a few
            steps and should not drop ``e``.

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
        self.below = 0  # observations in a row whose target was below the band
        self.factor = initial_v
        self.observations = 0
        self.t_up: float | None = None
        self.t_down: float | None = None
        self.history: list[EchoChange] = [EchoChange(0, initial_v, math.nan)]

    @property
    def ratio(self) -> float:
        """The smoothed ``R = t_up / t_down`` (``nan`` before the first observation)."""
        if self.t_up is None or self.t_down is None or self.t_down <= 0:
            return math.nan
        return self.t_up / self.t_down

    def target(self, ratio: float) -> float:
        """The factor the controller aims at for ``ratio``: clamped to ``[1, e_max]``, rounded."""
        clamped = min(max(ratio, 1.0), self.e_max)
        rounded = round(clamped / self.quantum) * self.quantum
        return min(max(rounded, 1.0), self.e_max)

    def observe(self, t_up: float, t_down: float, step: int) -> float | None:
        """Feed one measurement; returns the new factor when it changes, else ``None``.

        Args:
            t_up: upstream seconds per batch (reading and decoding), ``>= 0``.
            t_down: downstream seconds per batch (augmenting and training), ``> 0``.
            step: the current downstream step (recorded with a change).
        """
        up = _check_positive_finite("t_up", t_up, allow_zero=True)
        down = _check_positive_finite("t_down", t_down)
        self.observations += 1
        if self.observations <= self.warmup:
            return None  # start-up costs: kept out of the averages, not only out of decisions
        a = self.smoothing
        self.t_up = up if self.t_up is None else (1 - a) * self.t_up + a * up
        self.t_down = down if self.t_down is None else (1 - a) * self.t_down + a * down
        ratio = self.ratio
        target = self.target(ratio)
        if abs(target - self.factor) <= self.hysteresis * self.factor:
            self.below = 0
            return None
        if target < self.factor:
            self.below += 1
            if self.below < self.patience:
                return None
        self.below = 0
        self.factor = target
        self.history.append(EchoChange(int(step), target, ratio))
        return target

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue after a restart (for checkpoints)."""
        return {
            "factor": self.factor,
            "observations": self.observations,
            "below": self.below,
            "t_up": self.t_up,
            "t_down": self.t_down,
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
        self.t_up = None if state["t_up"] is None else float(state["t_up"])
        self.t_down = None if state["t_down"] is None else float(state["t_down"])
        self.history = [EchoChange(int(c["step"]), float(c["factor"]), float(c["ratio"]))
                        for c in state["history"]]  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"EchoController(factor={self.factor:g}, ratio={self.ratio:.3g}, "
            f"e_max={self.e_max:g}, changes={len(self.history) - 1})"
        )
