"""The stale-weight schedule in numbers, and the hybrid pipelined-then-synchronous switch.

With ``K`` stages, stage ``k`` keeps up to ``D_k + 1`` minibatches in flight, where
``D_k = 2(K-1-k)`` is its staleness. Each stage performs its operations in one fixed order:
``fwd(0), ..., fwd(D_k), bwd(0), fwd(D_k+1), bwd(1), ...``, which is the tick schedule "at tick
``t`` stage ``k`` runs forward of minibatch ``t-k`` and then backward of minibatch
``t-(2K-2-k)``" with empty slots removed. Because the order is fixed per stage, a
thread-per-stage engine computes exactly what a single-threaded tick-by-tick simulation does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["DEFAULT_SWITCH_FRACTION", "HybridSchedule", "hybrid_lr_factor", "stage_staleness"]

DEFAULT_SWITCH_FRACTION = 0.25
"""Share of the epochs that :meth:`HybridSchedule.default` trains pipelined.

Chosen by ``bench/staleness_remedies.py`` (docs/pipeline.md, "How deep to pipeline and when to
switch"): with K = 4 and a learning rate that restarts at the switch, switching after 25 %
of the epochs gave the smallest accuracy drop of the switch points studied (25/50/75 %).
"""

LrAcrossSwitch = Literal["continue", "restart", "constant"]


def stage_staleness(num_stages: int, pipelined: bool = True) -> list[int]:
    """Staleness ``D_k`` of each stage: updates its forward misses in steady state.

    ``D_k = 2(K-1-k)`` when pipelined (stage 0 is the stalest, the last stage is never stale),
    and 0 for every stage in synchronous mode.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not pipelined:
        return [0] * num_stages
    return [2 * (num_stages - 1 - k) for k in range(num_stages)]


@dataclass(frozen=True)
class HybridSchedule:
    """Train pipelined for the first ``pipelined_steps`` minibatches, then synchronously.

    The switch happens just before minibatch ``pipelined_steps`` enters the pipeline: the engine
    drains (every in-flight minibatch finishes its backward and update exactly once) and then
    runs one minibatch at a time through all stages, which is plain SGD on the same stages.
    Use :meth:`from_epochs` or :meth:`from_fraction` to state the switch point otherwise.
    """

    pipelined_steps: int

    def __post_init__(self) -> None:
        if isinstance(self.pipelined_steps, bool) or not isinstance(self.pipelined_steps, int):
            raise TypeError(f"pipelined_steps must be an int, got {self.pipelined_steps!r}")
        if self.pipelined_steps < 0:
            raise ValueError(f"pipelined_steps must be >= 0, got {self.pipelined_steps}")

    @classmethod
    def from_epochs(cls, epochs: int, steps_per_epoch: int) -> HybridSchedule:
        """Pipelined for the first ``epochs`` epochs of ``steps_per_epoch`` minibatches each."""
        if epochs < 0 or steps_per_epoch < 1:
            raise ValueError(
                f"need epochs >= 0 and steps_per_epoch >= 1, got {epochs}, {steps_per_epoch}"
            )
        return cls(epochs * steps_per_epoch)

    @classmethod
    def from_fraction(cls, fraction: float, total_steps: int) -> HybridSchedule:
        """Pipelined for the first ``fraction`` of ``total_steps`` (rounded down)."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
        if total_steps < 0:
            raise ValueError(f"total_steps must be >= 0, got {total_steps}")
        # (rounded to 1e-6 first: 0.29 * 100 is 28.999... in binary)
        return cls(math.floor(round(fraction * total_steps, 6)))

    @classmethod
    def default(cls, epochs: int, steps_per_epoch: int) -> HybridSchedule:
        """Pipelined for the first :data:`DEFAULT_SWITCH_FRACTION` of ``epochs`` (whole epochs,
        rounded, at least one when ``epochs >= 2``), then synchronous.

        Pair it with a learning rate that restarts at the switch
        (``hybrid_lr_factor(..., mode="restart")``): the study found that a schedule which has
        already decayed when the switch comes leaves the synchronous epochs too little rate to
        recover the pipelined epochs' loss.
        """
        if epochs < 0 or steps_per_epoch < 1:
            raise ValueError(
                f"need epochs >= 0 and steps_per_epoch >= 1, got {epochs}, {steps_per_epoch}"
            )
        switch = round(DEFAULT_SWITCH_FRACTION * epochs)
        if epochs >= 2:
            switch = min(max(switch, 1), epochs - 1)
        return cls.from_epochs(switch, steps_per_epoch)

    def pipelined_at(self, step: int) -> bool:
        """Whether minibatch ``step`` (0-based) is trained in pipelined mode."""
        return step < self.pipelined_steps


def _cosine(t: int, span: int) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * t / span)) if span > 0 else 1.0


def hybrid_lr_factor(
    epoch: int, epochs: int, switch_epoch: int | None, mode: LrAcrossSwitch = "restart"
) -> float:
    """Cosine learning-rate multiplier for ``epoch`` (0-based) of a hybrid run.

    ``mode`` says what happens at ``switch_epoch`` (the first synchronous epoch):
    ``"continue"``: one cosine over all ``epochs``, the switch changes nothing;
    ``"restart"``: a cosine over the pipelined epochs, then a new one from the full rate over
    the synchronous epochs; ``"constant"``: the full rate while pipelined, then one cosine over
    the synchronous epochs. Without a switch inside the run (``None``, 0 or ``epochs``) every
    mode is the plain cosine. Use with ``torch.optim.lr_scheduler.LambdaLR`` stepped per epoch.
    """
    if mode not in ("continue", "restart", "constant"):
        raise ValueError(f"mode must be 'continue', 'restart' or 'constant', got {mode!r}")
    if mode == "continue" or switch_epoch is None or switch_epoch in (0, epochs):
        return _cosine(epoch, epochs)
    if epoch >= switch_epoch:
        return _cosine(epoch - switch_epoch, epochs - switch_epoch)
    return _cosine(epoch, switch_epoch) if mode == "restart" else 1.0
