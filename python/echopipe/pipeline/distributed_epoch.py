"""Epochs, accuracy and the automatic balance for :class:`DistributedStalePipeline`.

These give the distributed engine the same calls as :class:`StalePipeline` (``run_epoch``,
``accuracy``, ``balance="auto"``). They are collective: every rank calls them, and only stage 0
of each replica reads data. The number of steps of an epoch is agreed first (the smallest
``len(loader)`` over the stage-0 ranks, so data-parallel replicas stay in step), and every other
message follows the point-to-point order of the pipeline itself (see ``distributed.py``: no
tags, so each pair of ranks receives in the order it sends).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .balance import partition_balance
from .results import DEFAULT_OUTPUT_MAP, EpochResult, LossRecord, StepResult, unpack_batch

_NO_LIMIT = 2**62


def agreed_auto_balance(
    module: nn.Sequential, sample_input: torch.Tensor | None, num_stages: int | None, **kw: Any
) -> list[int]:
    """``balance="auto"`` on every rank: rank 0 chooses (``partition_balance``), all adopt it.

    Measured timings differ between ranks, so each rank choosing for itself could split the
    model differently and deadlock the pipeline; rank 0's choice is broadcast instead.
    """
    if sample_input is None or num_stages is None:
        raise ValueError(
            "balance='auto' needs sample_input (a representative batch) and num_stages"
        )
    choice: list[Any] = [None]
    if dist.get_rank() == 0:
        choice[0] = list(partition_balance(module, sample_input, num_stages, **kw))
    dist.broadcast_object_list(choice, src=0)
    return [int(v) for v in choice[0]]


class DistributedEpochApi:
    """Mixin: ``run_epoch`` and ``accuracy`` for :class:`DistributedStalePipeline`."""

    # Provided by DistributedStalePipeline.
    device: torch.device
    is_first: bool
    is_last: bool
    stage_index: int
    num_stages: int
    rank: int
    _base: int
    _prev: int | None
    _next: int | None
    _last_rank: int

    def _agree_steps(self, loader: Iterable[Any] | None, steps: int | None) -> int:
        if steps is not None:
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
                raise ValueError(f"steps must be an int >= 0, got {steps!r}")
            return steps
        mine = _NO_LIMIT
        if self.is_first:
            if loader is None or not hasattr(loader, "__len__"):
                raise TypeError(
                    "run_epoch on stage 0 needs a loader with len() (DALI's and echopipe's "
                    "iterators, torch DataLoader) or steps="
                )
            mine = len(loader)  # type: ignore[arg-type]
        on_gpu = self.device.type == "cuda" and "nccl" in str(dist.get_backend())
        count = torch.tensor([mine], dtype=torch.int64, device=self.device if on_gpu else "cpu")
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        return int(count.item())

    def run_epoch(
        self,
        loader: Iterable[Any] | None = None,
        *,
        steps: int | None = None,
        drain: bool = False,
        step_schedulers: bool = True,
        output_map: Sequence[str] = DEFAULT_OUTPUT_MAP,
    ) -> EpochResult:
        """Feed one epoch (collective), as :meth:`StalePipeline.run_epoch` does.

        Stage-0 ranks pass their loader (``(x, target)`` pairs or DALI-style dicts, see
        :func:`~echopipe.pipeline.results.unpack_batch`); the other ranks may pass ``None``.
        The epoch has ``steps`` minibatches, by default the smallest ``len(loader)`` over the
        stage-0 ranks (one ``all_reduce``). ``losses`` are non-empty on the last stage only.
        """
        start = time.perf_counter()
        count = self._agree_steps(loader, steps)
        batches = iter(loader) if (self.is_first and loader is not None) else None
        samples = 0
        losses: list[float] = []
        for step in range(count):
            x = target = None
            if batches is not None:
                try:
                    x, target = unpack_batch(next(batches), output_map)
                except StopIteration:
                    raise RuntimeError(
                        f"rank {self.rank}: the loader ended after {step} of the {count} steps "
                        "agreed for this epoch"
                    ) from None
                samples += int(x.shape[0])
            result: StepResult = self.train_step(x, target)  # type: ignore[attr-defined]
            losses.extend(result.losses)
        if step_schedulers and self._core.scheduler_interval == "epoch":  # type: ignore[attr-defined]
            self.step_schedulers()  # type: ignore[attr-defined]
        if drain:
            losses.extend(r.value for r in self.drain())  # type: ignore[attr-defined]
        return EpochResult(count, samples, losses, time.perf_counter() - start)

    def accuracy(
        self, x: torch.Tensor | None, target: torch.Tensor | None, batch_size: int = 512
    ) -> float:
        """Top-1 accuracy of an eval-mode forward (collective; drains first).

        Stage 0 passes ``x`` and ``target`` (others ``None``); every rank of the replica gets
        the same fraction in [0, 1], as :meth:`StalePipeline.accuracy` returns it.
        """
        from .distributed import TAG_EVAL, TAG_TARGET

        self.drain()  # type: ignore[attr-defined]
        send, recv = self._send, self._recv  # type: ignore[attr-defined]
        chunks: list[torch.Tensor] = []
        if self.is_first:
            if x is None or target is None:
                raise ValueError("stage 0 needs x and target in accuracy")
            chunks = list(torch.split(x, batch_size))
            target = target.reshape(-1)
            if not self.is_last:
                send(target, self._last_rank, TAG_TARGET)
        elif self.is_last:
            target = recv(self._base, TAG_TARGET)  # stage 0 sends it first
        # The chunk count travels down the pipeline ahead of the chunks.
        n = torch.tensor([len(chunks)], dtype=torch.int64)
        if not self.is_first:
            assert self._prev is not None
            n = recv(self._prev, TAG_EVAL)
        if not self.is_last:
            assert self._next is not None
            send(n, self._next, TAG_EVAL)
        outputs = [self.evaluate(chunks[i] if chunks else None) for i in range(int(n.item()))]  # type: ignore[attr-defined]
        result = torch.zeros(1, dtype=torch.float64)
        if self.is_last:
            assert target is not None
            done = [o for o in outputs if o is not None]
            if done:
                logits = torch.cat(done)
                result[0] = (logits.argmax(dim=1) == target.cpu().long()).double().mean()
            else:
                result[0] = math.nan
            for peer in range(self._base, self._last_rank):
                send(result, peer, TAG_EVAL)
        else:
            result = recv(self._last_rank, TAG_EVAL)
        self._reap_sends(wait_all=True)  # type: ignore[attr-defined]
        return float(result.cpu()[0])


__all__ = ["DistributedEpochApi", "LossRecord", "agreed_auto_balance"]
