"""Checkpoints of a :class:`~echopipe.pipeline.engine.StalePipeline`: what they hold and how
they are restored.

A checkpoint is taken only with no minibatch in flight (the pipeline drains first), so a run
resumed from it continues exactly as an uninterrupted run that drained at the same step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .checkpoint import atomic_save, load_file
from .stage import StageCore
from .stream import synchronize_devices

__all__ = ["CHECKPOINT_FORMAT", "PipelineState"]

CHECKPOINT_FORMAT = 1


class PipelineState:
    """Mixin: ``state_dict``/``load_state_dict`` and checkpoint files for :class:`StalePipeline`.

    It also relies on StalePipeline's ``drain()``, ``set_pipelined()``, ``_check()`` and its
    ``optimizers``, ``schedulers`` and ``updates_per_stage`` properties.
    """

    # Provided by StalePipeline.
    balance: list[int]
    stages: list[nn.Sequential]
    devices: list[torch.device]
    recompute: bool
    steps_fed: int
    samples_seen: int
    _cores: list[StageCore]
    _pipelined: bool
    _idle: bool

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: weights, optimizers, schedulers, counters, mode.

        Drains first (the checkpoint policy): no minibatch is in flight in a checkpoint, so
        resuming continues exactly as an uninterrupted run that drained at the same step.
        """
        if not self._idle:
            self.drain()
        self._check()
        return {
            "format": CHECKPOINT_FORMAT,
            "balance": list(self.balance),
            "stages": [s.state_dict() for s in self.stages],
            "optimizers": [o.state_dict() if o is not None else None for o in self.optimizers],
            "schedulers": [s.state_dict() if s is not None else None for s in self.schedulers],
            "updates_per_stage": self.updates_per_stage,
            "scheduler_steps": [c.scheduler_steps for c in self._cores],
            "steps_fed": self.steps_fed,
            "samples_seen": self.samples_seen,
            "pipelined": self._pipelined,
            "recompute": self.recompute,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the balance must match this pipeline's."""
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError("not an echopipe pipeline checkpoint (missing or unknown 'format')")
        if list(state["balance"]) != self.balance:
            raise ValueError(
                f"checkpoint balance {state['balance']!r} does not match this pipeline's "
                f"{self.balance!r}"
            )
        if not self._idle:
            self.drain()
        self._check()
        for stage, sd in zip(self.stages, state["stages"], strict=True):
            stage.load_state_dict(sd)
        for core, osd, ssd, updates, ssteps in zip(
            self._cores,
            state["optimizers"],
            state["schedulers"],
            state["updates_per_stage"],
            state["scheduler_steps"],
            strict=True,
        ):
            if core.optimizer is not None and osd is not None:
                core.optimizer.load_state_dict(osd)
            if core.scheduler is not None and ssd is not None:
                core.scheduler.load_state_dict(ssd)
            core.updates_applied = int(updates)
            core.scheduler_steps = int(ssteps)
            core.last_forward_index = core.last_backward_index = int(state["steps_fed"]) - 1
        synchronize_devices(self.devices)
        self.steps_fed = int(state["steps_fed"])
        self.samples_seen = int(state["samples_seen"])
        if bool(state["pipelined"]) != self._pipelined:
            self.set_pipelined(bool(state["pipelined"]))

    def save_checkpoint(self, path: str | Any) -> None:
        """Drain, then write :meth:`state_dict` to ``path`` atomically (tmp file + os.replace)."""
        atomic_save(self.state_dict(), path)

    def load_checkpoint(self, path: str | Any) -> None:
        """Load a file written by :meth:`save_checkpoint` (``FileNotFoundError`` names it)."""
        self.load_state_dict(load_file(path))
