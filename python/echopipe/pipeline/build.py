"""Building a :class:`~echopipe.pipeline.engine.StalePipeline`: its arguments checked, its
balance resolved, and one :class:`~echopipe.pipeline.stage.StageCore` (optimizer, scheduler,
gradient hook) per stage.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from .balance import partition_balance
from .partition import DeviceLike, check_stale_share
from .schedule import HybridSchedule
from .stage import StageCore

__all__ = [
    "LossFn",
    "OptimizerFactory",
    "SchedulerFactory",
    "StageGradHook",
    "build_cores",
    "check_arguments",
    "resolve_balance",
]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
StageGradHook = Callable[[int, list[nn.Parameter], list[torch.Tensor | None]], None]
"""``hook(stage, params, grads)``: sees (and may replace entries of) a stage's gradients, which
the parameters' ``.grad`` also hold while it runs."""


def check_arguments(
    module: Any,
    optimizer: Any,
    loss_fn: Any,
    grad_hook: Any,
    scheduler_interval: Any,
    hybrid: Any,
    recompute: Any = False,
    max_prefetch: Any = 1,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the first bad argument of ``StalePipeline``
    (and of ``DistributedStalePipeline``, which has no ``max_prefetch``)."""
    if not isinstance(module, nn.Sequential):
        # torch.compile(model) wraps the sequential; the stages are cut from its children.
        compiled = isinstance(getattr(module, "_orig_mod", None), nn.Sequential)
        raise TypeError(
            f"StalePipeline needs an nn.Sequential (one child per block), got "
            f"{type(module).__name__}"
            + (
                ": torch.compile the children (model[i] = torch.compile(model[i]))"
                if compiled
                else ""
            )
        )
    if not callable(optimizer):
        raise TypeError("optimizer must be a factory: params -> torch.optim.Optimizer")
    if not callable(loss_fn):
        raise TypeError("loss_fn must be callable as loss_fn(output, target)")
    if grad_hook is not None and not callable(grad_hook):
        raise TypeError(
            "grad_hook must be callable as hook(stage, params, grads), got "
            f"{type(grad_hook).__name__}"
        )
    if scheduler_interval not in ("epoch", "step"):
        raise ValueError(
            f"scheduler_interval must be 'epoch' or 'step', got {scheduler_interval!r}"
        )
    if hybrid is not None and not isinstance(hybrid, HybridSchedule):
        raise TypeError(f"hybrid must be a HybridSchedule, got {type(hybrid).__name__}")
    if not isinstance(recompute, bool):  # ("no" would be true)
        raise TypeError(f"recompute must be a bool, got {recompute!r}")
    if isinstance(max_prefetch, bool) or not isinstance(max_prefetch, int) or max_prefetch < 1:
        raise ValueError(f"max_prefetch must be an int >= 1, got {max_prefetch!r}")


def resolve_balance(
    module: nn.Sequential,
    balance: Sequence[int] | Literal["auto"] | None,
    devices: Sequence[DeviceLike] | None,
    num_stages: int | None,
    sample_input: torch.Tensor | None,
    max_stale_share: float | None,
    balance_cost: Literal["time", "model"],
    balance_cache: str | os.PathLike[str] | None,
) -> Sequence[int]:
    """Children per stage: ``balance`` itself, profiled for ``"auto"``, one stage for ``None``;
    checked against ``max_stale_share`` when given."""
    if isinstance(balance, str):
        if balance != "auto":
            raise ValueError(f"balance must be a list of ints, 'auto' or None, got {balance!r}")
        if sample_input is None:
            raise ValueError("balance='auto' needs sample_input (a representative batch)")
        stages_wanted = num_stages or (len(devices) if devices is not None else None)
        if stages_wanted is None:
            raise ValueError("balance='auto' needs num_stages or devices")
        balance = partition_balance(
            module, sample_input, stages_wanted, devices, max_stale_share=max_stale_share,
            cost=balance_cost, cache=balance_cache,
        )  # fmt: skip
    elif balance is None:
        balance = [len(module)]
    if max_stale_share is not None:
        check_stale_share(module, balance, max_stale_share)
    return balance


def _bind_grad_hook(
    hook: StageGradHook | None, stage: int, params: list[nn.Parameter]
) -> Callable[[list[torch.Tensor | None]], None] | None:
    if hook is None:
        return None

    def bound(grads: list[torch.Tensor | None]) -> None:
        hook(stage, params, grads)

    return bound


def stage_optimizer(
    factory: OptimizerFactory, params: list[nn.Parameter], stage: int
) -> torch.optim.Optimizer | None:
    """``factory(params)`` for stage ``stage`` (``None`` without trainable parameters), checked
    to be an optimizer over those parameters only."""
    if not params:
        return None
    optimizer = factory(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer factory must return a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    # Each stage steps its optimizer in its own thread at its own time: one holding another
    # stage's parameters (a factory that ignores its argument, SGD(model.parameters())) would
    # step them whenever that stage's gradient happens to be set, which depends on timing.
    given = {id(p) for p in params}
    foreign = sum(id(p) not in given for g in optimizer.param_groups for p in g["params"])
    if foreign:
        raise ValueError(
            f"the optimizer factory returned for stage {stage} an optimizer holding {foreign} "
            "parameter(s) it was not given: build it over the stage's parameters passed to it "
            "(optimizer=lambda params: torch.optim.SGD(params, ...)), not model.parameters()"
        )
    return optimizer


def build_cores(
    stages: Sequence[nn.Sequential],
    devices: Sequence[torch.device],
    optimizer: OptimizerFactory,
    scheduler: SchedulerFactory | None,
    scheduler_interval: Literal["epoch", "step"],
    loss_fn: LossFn,
    recompute: bool,
    grad_hook: StageGradHook | None,
    staleness: Sequence[int],
) -> list[StageCore]:
    """One core per stage with its own optimizer (and scheduler); the last one gets the loss."""
    num_stages = len(stages)
    cores: list[StageCore] = []
    for k, (stage, device) in enumerate(zip(stages, devices, strict=True)):
        params = [p for p in stage.parameters() if p.requires_grad]
        opt = stage_optimizer(optimizer, params, k)
        sched = scheduler(opt) if (scheduler is not None and opt is not None) else None
        core = StageCore(
            k, num_stages, stage, device, opt, sched, scheduler_interval,
            loss_fn if k == num_stages - 1 else None, recompute,
            grad_hook=_bind_grad_hook(grad_hook, k, params),
        )  # fmt: skip
        core.staleness = staleness[k]
        cores.append(core)
    return cores
