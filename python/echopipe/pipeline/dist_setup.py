"""Joining the torchrun process group with a backend that can work on this node.

NCCL needs a GPU of its own per rank: with fewer visible GPUs than local ranks, two ranks land
on one GPU and NCCL rejects the duplicate device deep inside its first collective. The check
here turns that into one clear line before anything is sent, and ``backend="auto"`` uses Gloo
instead, which has no such limit.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Literal

import torch
import torch.distributed as dist

__all__ = ["attempt_store", "check_gpus_per_rank", "init_distributed"]


def _local_ranks() -> tuple[int, int]:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(local + 1)))
    return local, local_world


def check_gpus_per_rank(gpus: int | None = None) -> None:
    """ValueError unless every local rank of this node has a GPU of its own (NCCL's rule).

    ``gpus`` defaults to ``torch.cuda.device_count()``; the local ranks come from torchrun's
    ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``.
    """
    gpus = torch.cuda.device_count() if gpus is None else int(gpus)
    local, local_world = _local_ranks()
    if gpus < local_world or local >= gpus:
        raise ValueError(
            f"NCCL needs one GPU per rank, but this node runs {local_world} local ranks and sees "
            f"{gpus} GPU(s) (rank {local} would share one); start at most {gpus} processes per "
            "node, or use the Gloo backend (backend='gloo' or 'auto')"
        )


def init_distributed(
    backend: Literal["auto", "nccl", "gloo"] = "auto", *, timeout_s: float = 600.0
) -> tuple[str, torch.device]:
    """Joins the process group torchrun describes; returns ``(backend, this rank's device)``.

    ``"auto"`` takes NCCL when every local rank has its own GPU and Gloo otherwise (also on a
    node with fewer GPUs than ranks); ``"nccl"`` checks that rule first
    (:func:`check_gpus_per_rank`). With NCCL the rank's GPU is made current and passed to
    ``init_process_group`` as ``device_id``, so NCCL binds its communicator to that GPU at once.
    A no-op (returning the current backend) when the group is already initialised.
    """
    if backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"backend must be 'auto', 'nccl' or 'gloo', got {backend!r}")
    local, local_world = _local_ranks()
    if backend == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        backend = "nccl" if gpus >= local_world and gpus > local else "gloo"
    if backend == "nccl":
        check_gpus_per_rank()
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return dist.get_backend(), device
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        dist.init_process_group("nccl", timeout=timeout, device_id=device, **attempt_store(timeout))
    else:
        dist.init_process_group("gloo", timeout=timeout, **attempt_store(timeout))
    return backend, device


def attempt_store(timeout: datetime.timedelta) -> dict[str, Any]:
    """Under a restarted torchrun job: the job's store under a prefix of this attempt.

    torchrun's agent keeps one store over restarts, and the process groups' keys (each rank's
    address) are named alike in every attempt, so a rank of the restarted job could read the
    address of a rank of the killed one and fail to connect. ``{}`` (the usual ``env://``
    rendezvous) outside an agent-store torchrun job.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timeout,
    )  # fmt: skip
    return {
        "store": dist.PrefixStore(f"echopipe/attempt{attempt}", client),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }
