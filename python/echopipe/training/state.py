"""The run's own state: counters, clocks and history, saved and restored from one place.

Everything the trainer counts lives in :class:`RunState`. A checkpoint stores
:meth:`RunState.state_dict`, a resumed run starts from :meth:`RunState.from_state_dict`, and the
metric rows and the summary read their figures from it, so a counter is written in one place.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["RunState", "get_rng_state", "is_partial", "set_rng_state"]


@dataclass
class RunState:
    """Counters of one run, continued over resumes.

    Attributes:
        epoch: epochs finished.
        global_step: training steps taken.
        step_in_epoch: steps taken in the unfinished epoch.
        steps_per_epoch: planned steps of the current epoch.
        epoch_fresh: fresh samples the unfinished epoch has taken (``batch / e`` per step).
        epoch_loss_sum, epoch_losses, epoch_samples, epoch_train_s, epoch_fresh_start,
            epoch_wall_s: the unfinished epoch's loss sum and count, samples delivered,
            training seconds, the input's fresh count when it started, and wall seconds (up to
            the checkpoint, validation included); a resumed epoch goes on from them, so its
            metrics row and epoch line are the whole epoch's.
        epoch_clock: the LR schedule's segments (see :class:`~.schedule.EpochClock`).
        checkpoints_written: checkpoint files written, over all resumes.
        wall_s: wall time of the earlier (resumed) runs.
        train_s: time spent in training steps and waiting for their input (the waits before
            the first step included), without start-up, validation and checkpoints (up to the
            last checkpoint or epoch end).
        samples_trained: samples delivered to the model (fresh and echoed).
        step_time_s, steps_timed: the trainer's compute time per step (``t_down``) sums.
        factors_used: echo factors in the order they were used.
        rows: one metrics row per finished epoch, then the ``partial`` row of a --max-steps
            stop inside an epoch (replaced by that epoch's row).
        best_top1: the best validation top-1 so far.
        world_size: replicas of the run that wrote the state.
        run_id: the run's identity, shared by its checkpoints and its folder's config.json.
        schedule_epochs: the epochs the LR schedule spans (``--epochs`` of the first start).
        schedule_warp: how later ``--epochs`` stretched the rest of the schedule (see
            :func:`~.schedule.schedule_epoch`).
    """

    epoch: int = 0
    global_step: int = 0
    step_in_epoch: int = 0
    steps_per_epoch: int = 0
    epoch_fresh: float = 0.0
    epoch_loss_sum: float = 0.0
    epoch_losses: int = 0
    epoch_samples: int = 0
    epoch_train_s: float = 0.0
    epoch_fresh_start: int = 0
    epoch_wall_s: float = 0.0
    epoch_clock: list[tuple[int, float, float]] = field(default_factory=list)
    checkpoints_written: int = 0
    wall_s: float = 0.0
    train_s: float = 0.0
    samples_trained: int = 0
    step_time_s: float = 0.0
    steps_timed: int = 0
    factors_used: list[float] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    best_top1: float = -1.0
    world_size: int = 1
    run_id: str = ""
    schedule_epochs: int = 0
    schedule_warp: list[tuple[float, float, float]] = field(default_factory=list)

    #: Fields that checkpoints of earlier versions lack: those take the defaults.
    LATER_FIELDS = frozenset(
        {"epoch_loss_sum", "epoch_losses", "epoch_samples", "epoch_train_s", "epoch_fresh_start",
         "epoch_wall_s"}
    )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Plain values for a checkpoint."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> RunState:
        """The state a checkpoint stored (unknown keys are an error: a different format)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(state) - names
        if unknown:
            raise ValueError(f"run state has unknown fields {sorted(unknown)}")
        out = cls(**state)
        out.epoch_clock = [tuple(s) for s in out.epoch_clock]  # type: ignore[misc]
        out.schedule_warp = [tuple(s) for s in out.schedule_warp]  # type: ignore[misc]
        return out

    @property
    def validation_due(self) -> bool:
        """The epoch's steps are all taken but it is not validated yet: so stands a checkpoint
        written by a stop during the epoch's validation, and a resume from it validates the
        epoch before anything else (``--checkpoint-every`` never writes one at the epoch's last
        step, so no other checkpoint is of this kind)."""
        return 0 < self.steps_per_epoch <= self.step_in_epoch

    def position(self) -> str:
        """Where in the run this state stands, as the interrupt and resume lines say it."""
        if self.validation_due:
            return f"epoch {self.epoch + 1} trained, not validated"
        if self.step_in_epoch == 0:
            return f"end of epoch {self.epoch}"
        return f"epoch {self.epoch + 1}"

    def resume_position(self) -> str:
        """:meth:`position` as a resume says it. In the stop line's words: the epochs done
        ("epoch 1") named step 5 of the epoch that the stop line had called "epoch 2"."""
        return self.position() + (": it is validated first" if self.validation_due else "")

    def epoch_figures(self, world: int, fresh: float, epoch_s: float) -> dict[str, Any]:
        """The unfinished epoch's own time and rates for its row and line: ``epoch_s``, its
        wall seconds over every process that trained it (``epoch_wall_s`` and this one's), and
        the rates over its training seconds, ``fresh`` its fresh samples (the row's other rates
        are over the whole run)."""
        train_s = max(self.epoch_train_s, 1e-9)
        return {
            "epoch_s": epoch_s,
            "epoch_img_per_s": world * self.epoch_samples / train_s,
            "epoch_fresh_per_s": world * fresh / train_s,
            "partial": self.step_in_epoch != 0,  # last: the columns before it keep their places
        }

    @property
    def t_down_s(self) -> float:
        """Mean compute seconds per step, or NaN before any was timed."""
        return self.step_time_s / self.steps_timed if self.steps_timed else float("nan")


def get_rng_state() -> dict[str, Any]:
    """torch, numpy and Python RNG states (the checkpoint codec stores their tuples)."""
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def is_partial(row: dict[str, Any]) -> bool:
    """Whether a metrics row is of an epoch a --max-steps stop cut short (an earlier version's
    row says so by its fractional epoch alone)."""
    return bool(row.get("partial", isinstance(row.get("epoch"), float)))
