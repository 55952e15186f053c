"""Stale-weight pipelined backprop (PPL-SGD, Zhang & Abdelrahman 2019) for ``nn.Sequential``.

* :class:`StalePipeline`: one process, one worker thread per stage, CUDA streams or CPU threads.
* :class:`DistributedStalePipeline`: one stage per rank over torch.distributed point-to-point
  (Gloo on CPU, NCCL on GPU), launched with torchrun; optional data parallelism across
  pipeline replicas.
* :func:`balance_by_time`, :func:`balance_by_cost`: a balance (a list of ints) from timing
  each layer or from a FLOPs-and-bytes model; :func:`partition_balance` is ``balance="auto"``.
* :class:`HybridSchedule`: pipelined for the first steps, synchronous afterwards.

See ``docs/pipeline.md`` for the schedule, the staleness of each stage and the weight rules.
"""

from __future__ import annotations

from .balance import (
    LayerProfile,
    balance_by_cost,
    balance_by_time,
    partition_balance,
    profile_layers,
)
from .build import StageGradHook
from .dist_setup import check_gpus_per_rank, init_distributed
from .distributed import DistributedStalePipeline
from .engine import StalePipeline
from .partition import parse_devices, split_sequential, stale_share, validate_balance
from .results import EpochResult, LossRecord, StepResult, unpack_batch
from .schedule import HybridSchedule, stage_staleness
from .worker import PipelineError

__all__ = [
    "DistributedStalePipeline",
    "EpochResult",
    "HybridSchedule",
    "LayerProfile",
    "LossRecord",
    "PipelineError",
    "StageGradHook",
    "StalePipeline",
    "StepResult",
    "balance_by_cost",
    "balance_by_time",
    "check_gpus_per_rank",
    "init_distributed",
    "parse_devices",
    "partition_balance",
    "profile_layers",
    "split_sequential",
    "stage_staleness",
    "stale_share",
    "unpack_batch",
    "validate_balance",
]
