"""Checkpoints of the pipeline engines: what they hold and how they are restored.

A checkpoint is taken only with no minibatch in flight (the engines drain first), so a run
resumed from it continues exactly as an uninterrupted run that drained at the same step. The
functions here are given the stages, their cores and the counters explicitly; the engines
drain, call them and adopt the counters they return.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .stage import StageCore
from .stream import synchronize_devices

__all__ = [
    "CHECKPOINT_FORMAT",
    "Progress",
    "check_format",
    "check_pipeline_state",
    "check_rank_state",
    "pipeline_state",
    "rank_state",
    "restore_pipeline",
    "restore_rank",
]

CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class Progress:
    """The counters a checkpoint carries besides the weights: minibatches fed, samples seen,
    and whether the engine runs pipelined."""

    steps_fed: int
    samples_seen: int
    pipelined: bool


def check_format(state: Any) -> None:
    """Raise ``ValueError`` unless ``state`` is an echopipe pipeline checkpoint."""
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError("not an echopipe pipeline checkpoint (missing or unknown 'format')")


def _state_or_none(owner: Any) -> Any:
    return owner.state_dict() if owner is not None else None


def _restore_core(
    core: StageCore, optimizer: Any, scheduler: Any, updates: int, scheduler_steps: int
) -> None:
    if core.optimizer is not None and optimizer is not None:
        core.optimizer.load_state_dict(optimizer)
    if core.scheduler is not None and scheduler is not None:
        core.scheduler.load_state_dict(scheduler)
    core.updates_applied = int(updates)
    core.scheduler_steps = int(scheduler_steps)


# One process, every stage (StalePipeline) ----------------------------------------------------
def pipeline_state(
    balance: Sequence[int],
    stages: Sequence[nn.Sequential],
    cores: Sequence[StageCore],
    progress: Progress,
    recompute: bool,
) -> dict[str, Any]:
    """Everything needed to resume a drained ``StalePipeline``: weights, optimizers,
    schedulers, counters, mode."""
    return {
        "format": CHECKPOINT_FORMAT,
        "balance": list(balance),
        "stages": [s.state_dict() for s in stages],
        "optimizers": [_state_or_none(c.optimizer) for c in cores],
        "schedulers": [_state_or_none(c.scheduler) for c in cores],
        "updates_per_stage": [c.updates_applied for c in cores],
        "scheduler_steps": [c.scheduler_steps for c in cores],
        "steps_fed": progress.steps_fed,
        "samples_seen": progress.samples_seen,
        "pipelined": progress.pipelined,
        "recompute": recompute,
    }


def check_pipeline_state(state: Any, balance: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``state`` is a checkpoint of a pipeline with ``balance``."""
    check_format(state)
    if list(state["balance"]) != list(balance):
        raise ValueError(
            f"checkpoint balance {state['balance']!r} does not match this pipeline's "
            f"{list(balance)!r}"
        )


def restore_pipeline(
    state: dict[str, Any],
    stages: Sequence[nn.Sequential],
    cores: Sequence[StageCore],
    devices: Sequence[torch.device],
) -> Progress:
    """Load a checked :func:`pipeline_state` into drained stages; returns its counters."""
    for stage, sd in zip(stages, state["stages"], strict=True):
        stage.load_state_dict(sd)
    steps_fed = int(state["steps_fed"])
    for core, osd, ssd, updates, ssteps in zip(
        cores,
        state["optimizers"],
        state["schedulers"],
        state["updates_per_stage"],
        state["scheduler_steps"],
        strict=True,
    ):
        _restore_core(core, osd, ssd, updates, ssteps)
        core.last_forward_index = core.last_backward_index = steps_fed - 1
    synchronize_devices(list(devices))
    return Progress(steps_fed, int(state["samples_seen"]), bool(state["pipelined"]))


# One rank, one stage (DistributedStalePipeline) ----------------------------------------------
def rank_state(
    balance: Sequence[int],
    stage_index: int,
    stage: nn.Sequential,
    core: StageCore,
    progress: Progress,
) -> dict[str, Any]:
    """One rank's stage of a drained ``DistributedStalePipeline``."""
    return {
        "format": CHECKPOINT_FORMAT,
        "balance": list(balance),
        "stage_index": stage_index,
        "stage": stage.state_dict(),
        "optimizer": _state_or_none(core.optimizer),
        "scheduler": _state_or_none(core.scheduler),
        "updates_applied": core.updates_applied,
        "scheduler_steps": core.scheduler_steps,
        "steps_fed": progress.steps_fed,
        "samples_seen": progress.samples_seen,
        "pipelined": progress.pipelined,
    }


def check_rank_state(state: Any, balance: Sequence[int], stage_index: int) -> None:
    """Raise ``ValueError`` unless ``state`` is stage ``stage_index`` of ``balance``."""
    check_format(state)
    if list(state["balance"]) != list(balance) or state["stage_index"] != stage_index:
        raise ValueError(
            f"checkpoint is stage {state['stage_index']} of balance {state['balance']!r}; "
            f"this rank runs stage {stage_index} of {list(balance)!r}"
        )


def restore_rank(state: dict[str, Any], stage: nn.Sequential, core: StageCore) -> Progress:
    """Load a checked :func:`rank_state` into a drained stage; returns its counters."""
    stage.load_state_dict(state["stage"])
    _restore_core(
        core, state["optimizer"], state["scheduler"], state["updates_applied"],
        state["scheduler_steps"],
    )  # fmt: skip
    steps_fed = int(state["steps_fed"])
    core.last_forward_index = core.last_backward_index = steps_fed - 1
    return Progress(steps_fed, int(state["samples_seen"]), bool(state["pipelined"]))
