"""Where a rank sits in a distributed pipeline, and what it shares with the other replicas.

With ``P = K * R`` ranks and ``K`` stages, rank ``r`` runs stage ``r % K`` of pipeline replica
``r // K`` (:class:`StageTopology`). With ``R > 1`` replicas, each stage averages its gradients
within its data-parallel group of ``R`` ranks right before its optimizer step
(:class:`ReplicaAverage`), and then calls the caller's ``grad_hook`` (:func:`rank_core`).
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .build import LossFn, OptimizerFactory, SchedulerFactory, StageGradHook, stage_optimizer
from .dist_setup import check_gpus_per_rank
from .partition import DeviceLike, parse_devices
from .stage import StageCore

__all__ = [
    "ReplicaAverage",
    "StageTopology",
    "average_over_replicas",
    "data_parallel_group",
    "rank_core",
    "rank_device",
]


@dataclass(frozen=True)
class StageTopology:
    """Where one rank sits: its stage, its replica and its neighbours.

    ``prev``/``next`` are the ranks of the neighbouring stages in the same replica (``None`` at
    the ends); ``base`` is the replica's stage-0 rank and ``last_rank`` its last stage's.
    """

    rank: int
    num_stages: int
    num_replicas: int
    stage_index: int
    replica: int
    base: int
    prev: int | None
    next: int | None
    last_rank: int

    @classmethod
    def of(cls, rank: int, world_size: int, num_stages: int) -> StageTopology:
        """Rank ``rank`` of ``world_size`` in a pipeline of ``num_stages`` stages (which must
        divide the world size)."""
        if world_size % num_stages != 0:
            raise ValueError(
                f"world size {world_size} is not a multiple of the {num_stages} stages"
            )
        stage_index = rank % num_stages
        base = (rank // num_stages) * num_stages
        return cls(
            rank=rank,
            num_stages=num_stages,
            num_replicas=world_size // num_stages,
            stage_index=stage_index,
            replica=rank // num_stages,
            base=base,
            prev=rank - 1 if stage_index > 0 else None,
            next=rank + 1 if stage_index < num_stages - 1 else None,
            last_rank=base + num_stages - 1,
        )

    @property
    def is_first(self) -> bool:
        """Whether this rank runs stage 0 (the one that reads the data)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (the one that computes losses)."""
        return self.stage_index == self.num_stages - 1


def data_parallel_group(topology: StageTopology) -> Any:
    """The process group of this rank's stage across the replicas (``None`` with one replica).

    Every rank must create every group, in the same order, so every rank calls this.
    """
    mine: Any = None
    if topology.num_replicas > 1:
        for k in range(topology.num_stages):
            ranks = [rep * topology.num_stages + k for rep in range(topology.num_replicas)]
            group = dist.new_group(ranks)
            if k == topology.stage_index:
                mine = group
    return mine


def rank_device(device: DeviceLike | None) -> torch.device:
    """This rank's device: ``device``, else ``cuda:LOCAL_RANK`` on NCCL and CPU otherwise."""
    backend = str(dist.get_backend())
    if device is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local}" if backend == "nccl" else "cpu"
    (parsed,) = parse_devices([device], 1)
    if parsed.type == "cuda" and "nccl" in backend:
        check_gpus_per_rank()  # two ranks on one GPU: one clear line, not an NCCL error
    return parsed


class ReplicaAverage:
    """A stage's gradient hook averaging its gradients over the data-parallel replicas.

    Args:
        params: the stage's trainable parameters (a missing gradient counts as zeros).
        group: the process group of this stage's ranks across the replicas.
        timeout: longest wait for the average on CPU (Gloo), or ``None``.
        topology: this rank's place, for the names in its errors.
        num_replicas: the size of ``group``.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: Any,
        num_replicas: int,
        timeout: datetime.timedelta | None = None,
        topology: StageTopology | None = None,
    ) -> None:
        self.params = list(params)
        self.group = group
        self.num_replicas = num_replicas
        self.timeout = timeout
        self.topology = topology

    def __call__(self, grads: list[torch.Tensor | None]) -> None:
        """Replace ``grads`` in place by their averages over the replicas (one all-reduce)."""
        average_over_replicas(
            grads, self.params, self.group, self.num_replicas, self.timeout, self.topology
        )


def average_over_replicas(
    grads: list[torch.Tensor | None],
    params: Sequence[nn.Parameter],
    group: Any,
    num_replicas: int,
    timeout: datetime.timedelta | None = None,
    topology: StageTopology | None = None,
) -> None:
    """Replace ``grads`` in place by their averages over the ``num_replicas`` ranks of ``group``.

    One all-reduce of one flat buffer; a missing gradient of a trainable parameter counts as
    zeros, since every replica must send a buffer of the same layout. A parameter frozen since
    (``requires_grad_(False)`` on every replica) keeps no gradient, so the optimizer skips it:
    zeros would still move it by momentum and weight decay.
    """
    filled = {
        i: g if g is not None else torch.zeros_like(p)
        for i, (g, p) in enumerate(zip(grads, params, strict=True))
        if p.requires_grad
    }
    if not filled:
        return
    flat = torch.cat([g.reshape(-1) for g in filled.values()])
    work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
    if topology is None or flat.device.type != "cpu":
        work.wait()
    else:
        wait_for_replicas(work, timeout, topology)
    flat.div_(num_replicas)
    offset = 0
    for i, g in filled.items():
        n = g.numel()
        grads[i] = flat[offset : offset + n].view_as(g)
        offset += n


def wait_for_replicas(
    work: Any, timeout: datetime.timedelta | None, topology: StageTopology
) -> None:
    """Waits for the replicas' gradient average on CPU (Gloo), bounded by ``timeout``.

    A replica that failed and stays up would otherwise hold the others for the process
    group's timeout (30 minutes by default), and one that died gives Gloo's words about a
    socket: a :class:`TimeoutError` or :class:`ConnectionError` names the ranks instead.
    """
    k, replicas = topology.num_stages, topology.num_replicas
    who = f"rank {topology.rank} (stage {topology.stage_index}, replica {topology.replica})"
    peers = [rep * k + topology.stage_index for rep in range(replicas)]
    started = time.monotonic()
    try:
        work.wait() if timeout is None else work.wait(timeout=timeout)
    except RuntimeError as exc:
        # Gloo raises a plain RuntimeError for a timeout as for any other failure.
        if timeout is not None and time.monotonic() - started >= timeout.total_seconds():
            raise TimeoutError(
                f"{who} waited more than {timeout.total_seconds():g} s for the gradient "
                f"average of stage {topology.stage_index}'s replicas (ranks {peers}); is every "
                "one of them alive and calling the same methods in the same order?"
            ) from exc
        raise ConnectionError(
            f"{who} failed to average gradients with stage {topology.stage_index}'s replicas "
            f"(ranks {peers}): one of them has probably failed or exited (see its own error)"
        ) from exc


def rank_grad_hook(
    params: list[nn.Parameter],
    average: ReplicaAverage | None,
    user: StageGradHook | None,
    stage: int,
) -> Callable[[list[torch.Tensor | None]], None] | None:
    """The hook a rank's stage runs before its optimizer step: the replica average, then the
    caller's ``hook(stage, params, grads)``.

    The caller's hook sees the averaged gradients, in ``grads`` and in the parameters' ``.grad``
    (which ``clip_grad_norm_`` reads), as a hook after DDP's all-reduce does: every replica then
    clips the same gradient and the replicas stay equal. Clipping before the average would give
    each replica its own clip.
    """
    if user is None:
        return average

    def hook(grads: list[torch.Tensor | None]) -> None:
        if average is not None:
            average(grads)
            for p, g in zip(params, grads, strict=True):
                p.grad = g
        user(stage, params, grads)

    return hook


def rank_core(
    topology: StageTopology,
    stage: nn.Module,
    device: torch.device,
    optimizer: OptimizerFactory,
    scheduler: SchedulerFactory | None,
    scheduler_interval: str,
    loss_fn: LossFn,
    recompute: bool,
    grad_hook: StageGradHook | None,
    timeout: datetime.timedelta | None = None,
) -> StageCore:
    """The stage core of one rank: its optimizer (and scheduler) over the stage's trainable
    parameters, the loss on the last stage, the replica average and ``grad_hook`` before each
    update, waiting at most ``timeout`` for the average on CPU. (``data_parallel_group`` is
    collective: every rank builds its core.)"""
    group = data_parallel_group(topology)
    params = [p for p in stage.parameters() if p.requires_grad]
    opt = stage_optimizer(optimizer, params, topology.stage_index)
    sched = scheduler(opt) if (scheduler is not None and opt is not None) else None
    average = ReplicaAverage(params, group, topology.num_replicas, timeout, topology)
    hook = rank_grad_hook(
        params, average if topology.num_replicas > 1 else None, grad_hook, topology.stage_index
    )
    return StageCore(
        topology.stage_index, topology.num_stages, stage, device, opt, sched, scheduler_interval,
        loss_fn if topology.is_last else None, recompute, grad_hook=hook,
    )  # fmt: skip
