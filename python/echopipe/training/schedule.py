"""The learning-rate schedule over epochs done, and the SGD optimizer of each stage."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .config import DataError, TrainConfig

__all__ = [
    "EpochClock",
    "LrSchedule",
    "check_losses",
    "decay_groups",
    "hybrid_switch_epoch",
    "lr_factor",
    "schedule_epoch",
    "sgd_factory",
    "stage_staleness_of",
    "stretch_schedule",
]


class EpochClock:
    """Epochs of training done after a given number of steps, for the LR schedule.

    With ``--echo auto`` the steps per epoch change with the echo factor, also within an epoch,
    so a schedule counted in steps would end early or late. The training loop starts a segment
    whenever the epoch length is (re)planned: from step ``first`` on, each step adds ``rate``
    epochs. Stage threads read it while the loop appends to it.
    """

    def __init__(self, segments: list[tuple[int, float, float]] | None = None) -> None:
        self.segments: list[tuple[int, float, float]] = list(segments or [])

    def plan(self, step: int, epochs_done: float, steps_left: int, epoch_end: float) -> None:
        """From ``step`` on, ``steps_left`` steps take the run from ``epochs_done`` to
        ``epoch_end`` epochs."""
        rate = max(epoch_end - epochs_done, 0.0) / max(steps_left, 1)
        self.segments.append((step, epochs_done, rate))

    def epochs_at(self, step: int) -> float:
        """Epochs done once ``step`` steps have run (0 before the first planned segment)."""
        # reversed() reads the length once, and list appends are atomic: no copy is needed
        # while the training loop plans a new segment.
        for first, done, rate in reversed(self.segments):
            if step >= first:
                return done + (step - first) * rate
        return 0.0


def hybrid_switch_epoch(cfg: TrainConfig) -> tuple[int | None, bool]:
    """``(epoch, restart)``: the epoch the run turns synchronous (None: never), and whether the
    learning rate restarts there.

    ``--hybrid-switch auto`` is the study's default hybrid (``HybridSchedule.default``: the
    first 25 % of the epochs pipelined, the rate restarting at the switch); an explicit epoch
    keeps one schedule over the whole run.
    """
    if cfg.hybrid_switch != "auto":
        return cfg.hybrid_switch, False  # type: ignore[return-value]
    from ..pipeline.schedule import HybridSchedule

    switch = HybridSchedule.default(cfg.epochs, 1).pipelined_steps
    return switch, 0 < switch < cfg.epochs


def stage_staleness_of(cfg: TrainConfig, stages: int) -> list[int]:
    """Each stage's staleness in the run's pipelined phase, also after a hybrid switch ended
    it; a run that was never pipelined (``--hybrid-switch 0``) had none."""
    from ..pipeline import stage_staleness

    return stage_staleness(stages, hybrid_switch_epoch(cfg)[0] != 0)


def lr_factor(
    epochs_next: float,
    epochs_now: float,
    warmup_epochs: float,
    epochs: int,
    restart_at: int | None = None,
) -> float:
    """Linear warm-up over ``warmup_epochs``, then cosine decay to 2 % at ``epochs``.

    ``epochs_next`` is the progress once the coming update is applied (warm-up never starts at
    zero), ``epochs_now`` the progress before it. With ``restart_at``, the decay ends there
    and a second cosine (no warm-up) runs from the full rate over the remaining epochs.
    """
    if restart_at is not None and epochs_now >= restart_at:
        span = max(epochs - restart_at, 1e-9)
        progress = min(1.0, max(0.0, (epochs_now - restart_at) / span))
        return 0.02 + 0.98 * 0.5 * (1.0 + math.cos(math.pi * progress))
    end = epochs if restart_at is None else restart_at
    if warmup_epochs > 0 and epochs_next <= warmup_epochs:
        return epochs_next / warmup_epochs
    span = max(end - warmup_epochs, 1e-9)
    progress = min(1.0, max(0.0, (epochs_now - warmup_epochs) / span))
    return 0.02 + 0.98 * 0.5 * (1.0 + math.cos(math.pi * progress))


def decay_groups(params: list[Any]) -> list[list[Any]]:
    """The optimizer's parameter groups, in order: weight-decayed (matrices and kernels), then
    the rest (biases, norms) when there are any. A checkpoint numbers parameters in this order.
    """
    decay = [p for p in params if p.ndim > 1]
    no_decay = [p for p in params if p.ndim <= 1]
    return [decay, no_decay] if no_decay else [decay]


def schedule_epoch(epochs: float, warp: list[tuple[float, float, float]]) -> float:
    """Where the LR schedule stands after ``epochs`` epochs of training.

    The identity until a resume changed ``--epochs``: each ``(start, at, slope)`` of ``warp``
    says that from ``start`` epochs on, the schedule goes on from ``at`` at ``slope`` schedule
    epochs per epoch, so the rate continues from where it stopped to its floor at the new end.
    """
    for start, at, slope in reversed(warp):
        if epochs >= start:
            return at + (epochs - start) * slope
    return epochs


def stretch_schedule(
    warp: list[tuple[float, float, float]], now: float, schedule_end: int, new_end: int
) -> tuple[float, float, float]:
    """The ``warp`` segment that takes the schedule from where it stands ``now`` (epochs done)
    to ``schedule_end`` at ``new_end`` epochs (a resume with another ``--epochs``)."""
    at = schedule_epoch(now, warp)
    slope = (schedule_end - at) / (new_end - now) if schedule_end > at and new_end > now else 1.0
    return now, at, slope


class LrSchedule:
    """The LR factor after a number of updates: epochs done (:class:`EpochClock`), where the
    schedule stands (``schedule_warp``), warm-up, cosine and the hybrid restart."""

    def __init__(self, cfg: TrainConfig, clock: EpochClock, state: object) -> None:
        self.cfg, self.clock, self.state = cfg, clock, state

    def span(self) -> TrainConfig:
        """The config with ``--epochs`` as the schedule spans it."""
        import dataclasses

        epochs = getattr(self.state, "schedule_epochs", 0) or self.cfg.epochs
        return dataclasses.replace(self.cfg, epochs=epochs)

    def at(self, epochs: float) -> float:
        return schedule_epoch(epochs, getattr(self.state, "schedule_warp", []))

    def factor(self, updates: int) -> float:
        span = self.span()
        switch, restart = hybrid_switch_epoch(span)
        return lr_factor(
            self.at(self.clock.epochs_at(updates + 1)),
            self.at(self.clock.epochs_at(updates)),
            span.warmup_epochs,
            span.epochs,
            switch if restart else None,
        )


def sgd_factory(cfg: TrainConfig) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        decay, *rest = decay_groups(params)
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
        groups += [{"params": no_decay, "weight_decay": 0.0} for no_decay in rest]
        # Nesterov needs momentum: --momentum 0 is plain SGD.
        nesterov = cfg.momentum > 0
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=nesterov)

    return make


def check_losses(losses: list[float], step: int, cfg: TrainConfig) -> None:
    """A loss that is not finite ends the run with the options that set the step size."""
    bad = next((v for v in losses if not math.isfinite(v)), None)
    if bad is not None:
        raise DataError(
            f"the training loss became {bad} at step {step}: training diverged; lower --lr (now "
            f"{cfg.lr:g}) or --weight-decay (now {cfg.weight_decay:g}), or lengthen the warm-up "
            "(--warmup-epochs)"
        )
