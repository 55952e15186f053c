"""PyTorch iterator over an :class:`~echopipe.dali.EchoPipeline`, in the style of DALI's own.

Yields ``[{"data": tensor, "label": tensor}]`` (one dict per pipeline, like
``DALIGenericIterator``), counts fresh versus echoed samples, and times the upstream (filling the
cache) and downstream (drawing + augmenting) parts of each step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from nvidia.dali.plugin.base_iterator import LastBatchPolicy

from .pipeline import EchoPipeline


@dataclass
class EchoIteratorStats:
    """Counters of an :class:`EchoIterator` since it was created (restored with its state)."""

    steps: int = 0
    samples: int = 0  #: samples handed out (after the last-batch policy)
    fresh: int = 0  #: of those, first copies of a sample (emission 0)
    echoed: int = 0  #: of those, repeated copies
    padded: int = 0  #: padding samples handed out (FILL policy at the end of a finite stream)
    dropped: int = 0  #: real samples not handed out (DROP / PARTIAL trimming)
    epochs: int = 0
    t_up: float = 0.0  #: seconds the consumer waited for the upstream (deterministic mode)
    t_down: float = 0.0  #: seconds the consumer waited for the downstream pipeline

    @property
    def echo_ratio(self) -> float:
        """Samples handed out per fresh sample (the realised echo factor)."""
        return self.samples / self.fresh if self.fresh else math.nan


def _to_torch(value: Any) -> torch.Tensor | list[torch.Tensor]:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, list):
        return [torch.from_numpy(np.asarray(v)) for v in value]
    if hasattr(value, "as_cpu"):  # GPU TensorList: DLPack keeps it on the device
        if value.is_dense_tensor():
            return torch.from_dlpack(value.as_tensor()).clone()
        value = value.as_cpu()
    if value.is_dense_tensor():
        # One copy out of DALI's buffer, which DALI may recycle after the next iteration.
        return torch.from_numpy(np.array(value.as_tensor()))
    return [torch.from_numpy(np.array(value.at(i))) for i in range(len(value))]


class EchoIterator:
    """Iterates an :class:`EchoPipeline` and returns PyTorch tensors.

    Args:
        pipeline: the echoing pipeline.
        output_map: one name per output of the pipeline function (in order).
        epoch_size: fresh samples per epoch; an epoch then has about ``epoch_size * e /
            batch_size`` steps. Default: the reader's shard size. Ignored for a finite stream
            (``epochs=N``), whose epoch ends where the stream ends.
        steps_per_epoch: steps per epoch (overrides ``epoch_size``).
        last_batch_policy: ``FILL`` returns the last batch full (padded with repeats of its own
            samples at the end of a finite stream), ``DROP`` drops an incomplete last batch,
            ``PARTIAL`` trims it to the samples that belong to the epoch.
        auto_reset: start the next epoch automatically after StopIteration.
    """

    def __init__(
        self,
        pipeline: EchoPipeline,
        output_map: Sequence[str],
        *,
        epoch_size: int | None = None,
        steps_per_epoch: int | None = None,
        last_batch_policy: LastBatchPolicy = LastBatchPolicy.FILL,
        auto_reset: bool = False,
    ) -> None:
        if not isinstance(pipeline, EchoPipeline):
            raise TypeError(f"pipeline must be an EchoPipeline, got {type(pipeline).__name__}")
        if isinstance(output_map, str) or len(set(output_map)) != len(output_map):
            raise ValueError(f"output_map must be a sequence of distinct names, got {output_map!r}")
        if not isinstance(last_batch_policy, LastBatchPolicy):
            raise TypeError(
                f"last_batch_policy must be a LastBatchPolicy, got {last_batch_policy!r}"
            )
        if epoch_size is not None and epoch_size < 1:
            raise ValueError(f"epoch_size must be >= 1, got {epoch_size}")
        if steps_per_epoch is not None and steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
        self.pipeline = pipeline
        self.output_map = list(output_map)
        self.last_batch_policy = last_batch_policy
        self.auto_reset = auto_reset
        self.stats = EchoIteratorStats()
        self._epoch_size = epoch_size
        self._steps_per_epoch = steps_per_epoch
        self._step_in_epoch = 0
        self._epoch_done = False

    # -- epoch geometry (endless streams) --

    @property
    def finite(self) -> bool:
        return self.pipeline.config.epochs is not None

    def _epoch_samples(self) -> int:
        """Samples an epoch of an endless stream hands out (before the last-batch policy)."""
        self.pipeline.start()  # the reader's epoch size is known once the pipelines are built
        cfg = self.pipeline.config
        if self._steps_per_epoch is not None:
            return self._steps_per_epoch * cfg.batch_size
        fresh = self._epoch_size or self.pipeline.shard_size
        if not fresh:
            raise ValueError(
                "the pipeline has no reader to take the epoch size from; pass epoch_size= or "
                "steps_per_epoch="
            )
        return max(1, round(fresh * cfg.echo_factor))

    def __len__(self) -> int:
        """Steps per epoch of an endless stream (a finite one ends where its data ends)."""
        b = self.pipeline.config.batch_size
        samples = self._epoch_samples()
        if self.last_batch_policy == LastBatchPolicy.DROP:
            return max(1, samples // b)
        return math.ceil(samples / b)

    # -- iteration --

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        return self

    def __next__(self) -> list[dict[str, torch.Tensor]]:
        if self._epoch_done:
            if not self.auto_reset:
                raise StopIteration
            self.reset()
        try:
            return self._next()
        except StopIteration:
            self._end_epoch()
            raise

    def _end_epoch(self) -> None:
        self._epoch_done = True
        self.stats.epochs += 1
        if self.auto_reset:
            self.reset()

    def _next(self) -> list[dict[str, torch.Tensor]]:
        pipe = self.pipeline
        b = pipe.config.batch_size
        if not self.finite and self._step_in_epoch >= len(self):
            raise StopIteration
        t_up0, t_down0 = pipe.t_up, pipe.t_down
        t0 = time.perf_counter()
        outputs, info = pipe.next_batch()
        if len(outputs) != len(self.output_map):
            raise ValueError(
                f"output_map has {len(self.output_map)} names but the pipeline returns "
                f"{len(outputs)} outputs"
            )
        wall = time.perf_counter() - t0
        self.stats.t_up += pipe.t_up - t_up0
        self.stats.t_down += max(pipe.t_down - t_down0, wall - (pipe.t_up - t_up0))
        valid = int(info[:, 0].sum())
        keep = b
        if self.finite:
            if valid < b and self.last_batch_policy == LastBatchPolicy.DROP:
                self.stats.dropped += valid
                raise StopIteration
            if valid < b and self.last_batch_policy == LastBatchPolicy.PARTIAL:
                keep = valid
        else:
            remaining = self._epoch_samples() - self._step_in_epoch * b
            if remaining < b and self.last_batch_policy == LastBatchPolicy.PARTIAL:
                keep = remaining
        emissions = info[:keep, 2]
        real = info[:keep, 0] == 1
        self.stats.fresh += int(np.count_nonzero(real & (emissions == 0)))
        self.stats.echoed += int(np.count_nonzero(real & (emissions > 0)))
        self.stats.padded += int(np.count_nonzero(~real))
        self.stats.dropped += int(np.count_nonzero(info[keep:, 0] == 1))
        self.stats.samples += keep
        self.stats.steps += 1
        self._step_in_epoch += 1
        batch = {}
        for name, value in zip(self.output_map, outputs, strict=True):
            tensor = _to_torch(value)
            batch[name] = tensor[:keep] if keep < b else tensor
        return [batch]

    def reset(self) -> None:
        """Starts the next epoch (for a finite stream: the next pass over the data)."""
        self._epoch_done = False
        self._step_in_epoch = 0
        if self.finite:
            self.pipeline.reset()

    # -- checkpointing --

    def state_dict(self) -> dict[str, Any]:
        """Pipeline echo state (:meth:`EchoPipeline.state_dict`) plus the iterator's position."""
        return {
            "pipeline": self.pipeline.state_dict(),
            "iterator": {
                "stats": dict(self.stats.__dict__),
                "step_in_epoch": self._step_in_epoch,
                "epoch_done": self._epoch_done,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output into a freshly created iterator."""
        self.pipeline.load_state_dict(state["pipeline"])
        it = state["iterator"]
        self.stats = EchoIteratorStats(**it["stats"])
        self._step_in_epoch = int(it["step_in_epoch"])
        self._epoch_done = bool(it["epoch_done"])

    # -- lifetime --

    def close(self) -> None:
        """Closes the pipeline (cache closed, upstream thread joined)."""
        self.pipeline.close()

    def __enter__(self) -> EchoIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
