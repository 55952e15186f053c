"""Data-parallel replicas under torchrun: process groups, gradient and buffer averaging.

Each process runs a replica of the whole pipeline on its own data shard. Every stage averages
its gradients with the same stage of the other replicas before its update, over a process group
of its own, so stage threads never share a communicator.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..pipeline.ranks import average_over_replicas
from .options import CollectiveError

__all__ = [
    "DistContext",
    "all_reduce_grads",
    "average_buffers",
    "collective",
    "default_devices",
    "fault_exit",
    "stage_devices",
]


def stage_devices(
    balance: Any, stages: Any, devices: Sequence[str] | None
) -> tuple[int, list[str]]:
    """The default stage count and one device per stage, from ``--balance``, ``--stages`` and
    ``--devices`` (``devices``; without it, the GPUs of :func:`default_devices`)."""
    wanted = (
        len(balance) if isinstance(balance, list) else (stages if isinstance(stages, int) else None)
    )
    count, found = default_devices(wanted)
    if devices is not None:
        found = list(devices)
        count = wanted or (len(found) if len(found) > 1 else count)
    return count, [found[i % len(found)] for i in range(count)]


def default_devices(stages: int | None) -> tuple[int, list[str]]:
    """``(stages, devices)`` for this process when ``--devices`` is not given.

    GPUs are shared out among the processes of this machine (``LOCAL_WORLD_SIZE`` under
    torchrun); a process with two or more GPUs puts one stage on each, a process with one GPU
    puts ``stages`` (default 2) stages on it, and without GPUs there are ``stages`` (default 2)
    CPU stages.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        k = stages or 2
        return k, ["cpu"] * k
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    per = max(1, gpus // local_world)
    mine = [(local * per + i) % gpus for i in range(per)]
    k = stages or (per if per >= 2 else 2)
    return k, [f"cuda:{mine[i % len(mine)]}" for i in range(k)]


_LAUNCH_ENV = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class DistContext:
    """This process's place among the data-parallel replicas (``world_size == 1`` alone)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    timeout_s: float = 600.0
    stage_groups: list[Any] = field(default_factory=list)
    probe_group: Any = None  # Gloo, short timeout: to find a rank that stopped answering

    @property
    def enabled(self) -> bool:
        """True under torchrun with more than one process."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes metrics, plots and the summary."""
        return self.rank == 0

    @classmethod
    def from_env(cls, timeout_s: float = 600.0) -> DistContext:
        """Join the process group that ``torchrun`` describes in the environment, if any.

        NCCL when every local rank has a GPU of its own (the rule of
        :func:`echopipe.pipeline.dist_setup.check_gpus_per_rank`), Gloo otherwise: ranks sharing
        a GPU would fail inside NCCL's first collective. A collective that waits longer than
        ``timeout_s`` for another rank fails (and torchrun stops the job) instead of hanging.
        """
        try:
            world = int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            raise CollectiveError(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number of processes; launch "
                "with torchrun, or unset WORLD_SIZE for one process"
            ) from None
        if world <= 1:
            return cls()
        try:
            return cls._join(world, timeout_s)
        except (ValueError, KeyError, RuntimeError) as exc:  # DistStoreError, DistNetworkError
            where = ", ".join(f"{k}={os.environ[k]}" for k in _LAUNCH_ENV if k in os.environ)
            text = str(exc).strip().splitlines()  # torch's own: a line, or a paragraph
            reason = text[0][:300].rstrip(".") if text else type(exc).__name__
            if isinstance(exc, KeyError):  # dist_setup.attempt_store's environment
                reason = f"{exc.args[0]} is not set"
            raise CollectiveError(
                f"cannot join the other processes of the job ({where}): {reason}; launch with "
                "torchrun (every rank, same --master-port), or unset WORLD_SIZE for one process"
            ) from exc

    @classmethod
    def _join(cls, world: int, timeout_s: float) -> DistContext:
        import torch.distributed as dist

        from ..pipeline.dist_setup import attempt_store, check_gpus_per_rank

        backend = "gloo"
        if torch.cuda.is_available():
            try:
                check_gpus_per_rank()
                backend = "nccl"
            except ValueError:
                pass
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if not dist.is_initialized():
            timeout = datetime.timedelta(seconds=timeout_s)
            if backend == "nccl":
                # This process's first GPU in default_devices' sharing of the machine's GPUs,
                # bound at once (device_id) so NCCL does not guess it at the first collective.
                device = torch.device(default_devices(None)[1][0])
                torch.cuda.set_device(device)
                # Gradients and BatchNorm buffers (CUDA tensors) go over NCCL; the small
                # control messages (epoch lengths, counters, rank 0's echo factor: CPU tensors
                # and objects) over Gloo, which a pure NCCL group would reject.
                dist.init_process_group(
                    backend="cpu:gloo,cuda:nccl", timeout=timeout, device_id=device,
                    **attempt_store(timeout),
                )  # fmt: skip
            else:
                dist.init_process_group(backend="gloo", timeout=timeout, **attempt_store(timeout))
        ctx = cls(dist.get_rank(), dist.get_world_size(), local, backend, timeout_s)
        # At once: the data check's exchanges come before the stage groups, and a rank killed
        # during them is named only with the probe (silent_ranks).
        ctx.make_probe_group()
        return ctx

    def make_stage_groups(self, num_stages: int) -> None:
        """One process group per stage (every rank creates all of them, in the same order)."""
        if not self.enabled:
            return
        import torch.distributed as dist

        ranks = list(range(self.world_size))
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.stage_groups = [dist.new_group(ranks, timeout=timeout) for _ in range(num_stages)]
        self.make_probe_group()

    def make_probe_group(self) -> None:
        """The Gloo group of :meth:`silent_ranks` (every rank creates it, once)."""
        if not self.enabled or self.probe_group is not None:
            return
        import torch.distributed as dist

        # The ranks still running reach the probe within moments of each other (each timed out
        # on the same collective), so a short wait tells a silent rank from a late one.
        probe = datetime.timedelta(seconds=min(10.0, self.timeout_s))
        self.probe_group = dist.new_group(list(range(self.world_size)), timeout=probe,
                                          backend="gloo")  # fmt: skip

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Sum of ``values`` over ranks (identity when alone)."""
        if not self.enabled:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.float64)
        with collective("summing counters"):
            dist.all_reduce(t)
        return t.tolist()

    def all_reduce_min(self, value: int) -> int:
        """Minimum of ``value`` over ranks."""
        if not self.enabled:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        with collective("agreeing on a count"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        import torch.distributed as dist

        box = [obj]
        with collective("taking rank 0's choice"):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (``[obj]`` when alone)."""
        if not self.enabled:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        with collective("comparing the ranks' states"):
            dist.all_gather_object(out, obj)
        return out

    def silent_ranks(self) -> list[int]:
        """After a collective failed: the ranks that do not answer a token within the probe
        time (stopped, stuck or gone). Every rank still running sends one to each other rank
        and waits for theirs; ``[]`` when unknown."""
        if not self.enabled or self.probe_group is None:
            return []
        import torch.distributed as dist

        others = [r for r in range(self.world_size) if r != self.rank]
        waits = {}
        for r in others:
            try:
                dist.isend(torch.ones(1), dst=r, group=self.probe_group)
                box = torch.zeros(1)
                waits[r] = dist.irecv(box, src=r, group=self.probe_group)
            except (dist.DistError, RuntimeError):
                waits[r] = None
        silent = []
        for r, work in waits.items():
            try:
                if work is None or not work.wait():
                    silent.append(r)
            except (dist.DistError, RuntimeError):  # the wait timed out or the peer is gone
                silent.append(r)
        return silent

    def close(self) -> None:
        """Leave the process group (only if this module joined it)."""
        if self.enabled:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """A collective with the other ranks: its failure (Gloo and NCCL raise ``RuntimeError``,
    ``DistError`` among them) becomes a :class:`~.options.CollectiveError` saying what it
    was doing, so the trainer can tell it from any other error."""
    try:
        yield
    except RuntimeError as exc:
        raise CollectiveError(f"a collective with the other ranks failed ({what}): {exc}") from exc


def all_reduce_grads(
    ctx: DistContext,
) -> Callable[[int, list[nn.Parameter], list[torch.Tensor | None]], None] | None:
    """``StalePipeline`` grad hook that averages each stage's gradients over the replicas.

    The pipeline calls it in stage ``k``'s worker thread after each backward, right before the
    stage's optimizer step; stage ``k`` uses its own process group, so stage threads never share
    a communicator.
    """
    if not ctx.enabled:
        return None

    def hook(stage: int, params: list[nn.Parameter], grads: list[torch.Tensor | None]) -> None:
        with collective(f"averaging stage {stage}'s gradients"):
            average_over_replicas(grads, params, ctx.stage_groups[stage], ctx.world_size)

    return hook


def average_buffers(model: nn.Module, ctx: DistContext) -> None:
    """Average BatchNorm running statistics over the replicas (each saw only its shard)."""
    if not ctx.enabled:
        return
    import torch.distributed as dist

    for buf in model.buffers():
        if buf.is_floating_point():
            with collective("averaging BatchNorm statistics"):
                dist.all_reduce(buf)
            buf.div_(ctx.world_size)


def fault_exit(rank: int, step: int) -> None:
    """Fault injection for the restart tests: ``ECHOPIPE_FAULT_EXIT=RANK:STEP`` ends rank RANK
    at once (``os._exit``, as a killed process would) after step STEP, and
    ``RANK:STEP:stop`` stops it (SIGSTOP, a hung rank); on the first attempt of a torchrun job
    only (``TORCHELASTIC_RESTART_COUNT`` 0), so a restarted job runs through."""
    spec = os.environ.get("ECHOPIPE_FAULT_EXIT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    at_rank, at_step, *how = spec.split(":")
    if at_rank.isdigit() and at_step.isdigit() and (int(at_rank), int(at_step)) == (rank, step):
        if how == ["stop"]:
            import signal

            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            os._exit(17)
