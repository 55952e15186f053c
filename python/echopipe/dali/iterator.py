"""PyTorch iterator over an :class:`~echopipe.dali.EchoPipeline`, in the style of DALI's own.

Yields ``[{"data": tensor, "label": tensor}]`` (one dict per pipeline, like
``DALIGenericIterator``), counts fresh versus echoed samples, and reports the upstream's time per
step (``t_up``) next to the time the consumer waits for the downstream (``t_down``).
Tensors come from :func:`~.torch_copy.to_torch` (one copy out of DALI's buffers).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from nvidia.dali.plugin.base_iterator import LastBatchPolicy

from .iterator_stats import EchoIteratorStats
from .iterator_warnings import warn_continued_epoch, warn_if_evaluating
from .pipeline import EchoPipeline
from .torch_copy import arrays_as_tensors, tensors_as_arrays, to_torch


class EchoIterator:
    """Iterates an :class:`EchoPipeline` and returns PyTorch tensors.

    Args:
        pipeline: the echoing pipeline.
        output_map: one name per output of the pipeline function (in order); the default is
            ``DALIClassificationIterator``'s.
        epoch_size: fresh samples per epoch; an epoch then has about ``epoch_size * e /
            batch_size`` steps. Default: the reader's shard size. A finite stream
            (``epochs=N``, the default with a padded reader) ends its epochs with the data, so
            it refuses this, ``steps_per_epoch`` and ``size`` (as :meth:`set_epoch_size` does).
        steps_per_epoch: steps per epoch (overrides ``epoch_size``).
        last_batch_policy: ``FILL`` returns the last batch full (at the end of a finite stream,
            padded with repeats of its own samples; a smaller shard's padding-only batches
            repeat the first sample the pipeline drew), ``DROP`` drops an incomplete last batch,
            ``PARTIAL`` trims it to the samples that belong to the epoch.
        auto_reset: start the next epoch automatically after StopIteration (also ``"yes"`` /
            ``"no"``, as DALI's iterators take it).
        reader_name: as in DALI's iterators: the epoch is the named reader's shard size times
            the echo factor (the default epoch already is; the name is checked against the
            pipeline's reader).
        prepare_first_batch: as in DALI's iterators: start both pipelines now, so the first
            batch is being prepared before the first ``next()``.
        size: as in DALI's iterators: samples handed out per epoch of an endless stream.
        fill_last_batch: DALI's older spelling: True is ``FILL``, False ``PARTIAL``.
        dynamic_shape, last_batch_padded: accepted for DALI compatibility, without effect
            (outputs of any shape are converted; the echo source marks its own padding).

    The same arguments as DALI's ``DALIGenericIterator`` and ``DALIClassificationIterator``
    are accepted (also a list holding one pipeline), and ``size`` / ``_size`` read as theirs do,
    so switching from either is a change of the class name; DALI's iterators also work on an
    :class:`EchoPipeline` directly (without echo statistics).
    """

    def __init__(
        self,
        pipeline: EchoPipeline | Sequence[EchoPipeline],
        output_map: Sequence[str] = ("data", "label"),
        *,
        epoch_size: int | None = None,
        steps_per_epoch: int | None = None,
        last_batch_policy: LastBatchPolicy = LastBatchPolicy.FILL,
        auto_reset: bool | str = False,
        reader_name: str | None = None,
        prepare_first_batch: bool = False,
        size: int = -1,
        fill_last_batch: bool | None = None,
        dynamic_shape: bool = False,
        last_batch_padded: bool = False,
    ) -> None:
        if isinstance(pipeline, list | tuple) and len(pipeline) == 1:
            pipeline = pipeline[0]  # DALI's iterators take a list of pipelines
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
        if auto_reset not in (True, False, None, "yes", "no"):
            raise ValueError(f"auto_reset must be a bool, 'yes' or 'no', got {auto_reset!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size == 0:
            raise ValueError(f"size must be an int > 0 (samples per epoch) or -1, got {size!r}")
        if size > 0 and (reader_name is not None or epoch_size or steps_per_epoch):
            raise ValueError("give size, reader_name, epoch_size or steps_per_epoch, not several")
        if fill_last_batch is not None:  # DALI's older spelling of the policy
            last_batch_policy = LastBatchPolicy.FILL if fill_last_batch else LastBatchPolicy.PARTIAL
        del dynamic_shape, last_batch_padded  # no effect here; see the class notes
        self.pipeline = pipeline
        self.output_map = list(output_map)
        self.last_batch_policy = last_batch_policy
        self.auto_reset = auto_reset in (True, "yes")
        lengths = {"size": size, "epoch_size": epoch_size, "steps_per_epoch": steps_per_epoch}
        for name, value in lengths.items():
            if value not in (None, -1):
                self._refuse_if_finite(f"{name}={value}")
        if reader_name is not None:
            # Names an unknown reader. The upstream's own metadata: what the pipeline reports to
            # DALI's iterators (and the cases it refuses them) is for their epoch counting.
            pipeline.build()
            pipeline.upstream.reader_meta(reader_name)
        if prepare_first_batch:
            pipeline.start()
        self.stats = EchoIteratorStats()
        self._epoch_size = epoch_size
        self._steps_per_epoch = steps_per_epoch
        self._size_arg = size if size > 0 else None
        self._step_in_epoch = 0
        self._epoch_done = False
        # len() at this epoch's first step (see _took_its_steps); None before it.
        self._epoch_steps: int | None = None
        # Every len() told (a loop stopping at an old one, after a set_echo_factor, is warned).
        self._lens_told: set[int] = set()

    # -- epoch geometry (endless streams) --

    @property
    def finite(self) -> bool:
        """True for a finite stream (``epochs=N``), whose epochs end where the data ends."""
        return self.pipeline.finite

    @property
    def shard_size(self) -> int:
        """Fresh samples per epoch of the pipeline's reader shard (builds the DALI pipelines)."""
        return self.pipeline.shard_size

    @property
    def steps_per_epoch(self) -> int:
        """Steps of an epoch of an endless stream (same as ``len(self)``)."""
        return len(self)

    @steps_per_epoch.setter
    def steps_per_epoch(self, steps: int) -> None:
        self.set_epoch_size(steps_per_epoch=steps)

    def set_epoch_size(
        self, epoch_size: int | None = None, *, steps_per_epoch: int | None = None
    ) -> None:
        """Changes the length of the following epochs of an endless stream.

        Give either ``epoch_size`` (fresh samples per epoch; the steps follow from the echo
        factor) or ``steps_per_epoch`` (e.g. the minimum over data-parallel replicas, so all run
        the same number of steps); with neither, the epoch goes back to the reader's shard size.
        The current epoch ends as soon as its step count reaches the new length.

        Raises:
            ValueError: both given, a value below 1, or a finite stream (its epochs end with
                the data).
        """
        if epoch_size is not None and steps_per_epoch is not None:
            raise ValueError(
                f"give epoch_size ({epoch_size}) or steps_per_epoch ({steps_per_epoch}), not both"
            )
        for name, value in (("epoch_size", epoch_size), ("steps_per_epoch", steps_per_epoch)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1
            ):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self._refuse_if_finite(f"set_epoch_size({epoch_size=}, {steps_per_epoch=})")
        self._size_arg = None
        self._epoch_size = None if epoch_size is None else int(epoch_size)
        self._steps_per_epoch = None if steps_per_epoch is None else int(steps_per_epoch)

    def _refuse_if_finite(self, what: str) -> None:
        if self.finite:
            raise ValueError(
                f"{what}: a finite stream (epochs={self.pipeline.config.epochs}) ends its epochs "
                "with the data, so their length cannot be set; create the pipeline with "
                "epochs=None for epochs of a set length"
            )

    def _epoch_samples(self) -> int:
        """Samples an epoch of an endless stream hands out (before the last-batch policy)."""
        cfg = self.pipeline.config
        if self._steps_per_epoch is not None:
            return self._steps_per_epoch * cfg.batch_size
        if self._size_arg is not None:
            return self._size_arg
        if self.finite:  # (its length cannot be set) every shard's: the ranks take equal steps
            return self.pipeline.pass_copies(self.last_batch_policy)
        fresh = self._epoch_size or self.pipeline.shard_size
        if not fresh:
            raise ValueError(
                "the pipeline has no reader to take the epoch size from; pass epoch_size= or "
                "steps_per_epoch="
            )
        return max(1, round(fresh * cfg.echo.factor))

    @property
    def size(self) -> int:
        """Samples an epoch hands out, before the last-batch policy (DALI's iterators' ``size``:
        the reader's shard size, here times the echo factor; of an epoch-aligned stream
        :meth:`EchoPipeline.pass_copies`, the same on every shard)."""
        return self._epoch_samples()

    @property
    def _size(self) -> int:
        """:attr:`size` under DALI's private name, which DALI's ResNet-50 example reads for its
        steps per epoch (``math.ceil(loader._size / batch_size)``)."""
        return self._epoch_samples()

    def __len__(self) -> int:
        """Steps per epoch: of an endless stream, and of an epoch-aligned one the steps of every
        epoch, the same on every shard of the reader (the largest shard's batches; for ``DROP``
        the smallest shard's whole batches)."""
        steps = self._steps()
        self._lens_told.add(steps)
        return steps

    def _steps(self) -> int:
        b = self.pipeline.config.batch_size
        span = self.pipeline.pass_span() if self.finite else None
        if span is not None and self.last_batch_policy != LastBatchPolicy.DROP:
            return span.batches(b)  # (batch mode counts a pass's batches in units)
        if span is not None and span.least_full is not None:
            return span.least_full
        samples = self._epoch_samples()
        if self.last_batch_policy == LastBatchPolicy.DROP:
            # An endless stream's epoch takes at least one batch; a finite one whole batches.
            return samples // b if self.finite else max(1, samples // b)
        return math.ceil(samples / b)

    # -- iteration --

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        # As DALI's iterators do, iter() after a finished epoch starts the next (auto_reset or
        # not). A loop that stops after len() steps (Lightning's) never draws the end that
        # would finish it, so the epoch is also over once it has taken len() steps.
        if not self._epoch_done and self._took_its_steps():
            while self.finite:  # the pass's rest: DROP's short batches, DALI's padding
                try:
                    self.stats.dropped += int(self.pipeline.next_batch()[1][:, 0].sum())
                except StopIteration:
                    break
            self._end_epoch()
        if self._epoch_done:
            self.reset()
        elif self._step_in_epoch in self._lens_told - {0}:  # (not a break after next())
            warn_continued_epoch(self._step_in_epoch, self._epoch_steps or len(self))
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

    def _took_its_steps(self) -> bool:
        """True once this epoch took its len() steps: of a finite stream, the len() it had at
        its first step (a set_echo_factor since then, between two epochs of Lightning's loop,
        sets the next epoch's length, not this one's)."""
        steps = self._epoch_steps if self.finite and self._epoch_steps is not None else len(self)
        return 0 < steps <= self._step_in_epoch

    def _end_epoch(self) -> None:
        # auto_reset resets at the next next(), not here: a set_echo_factor between the epochs
        # then reaches the whole next epoch (the next pass would fill the cache at the old e).
        self._epoch_done = True
        self.stats.epochs += 1

    def _next(self) -> list[dict[str, torch.Tensor]]:
        pipe = self.pipeline
        b = pipe.config.batch_size
        if self._step_in_epoch == 0 and len(self) == 0:  # as DALI's iterators refuse it
            raise ValueError(
                f"last_batch_policy=DROP drops every batch: an epoch of the smallest shard has "
                f"{self._epoch_samples()} copies, fewer than batch_size={b}; use PARTIAL or "
                "FILL, a smaller batch, or fewer shards"
            )
        if self._step_in_epoch == 0:
            warn_if_evaluating(pipe.echo_factor)
        drop = self.last_batch_policy == LastBatchPolicy.DROP
        if (not self.finite or drop) and self._step_in_epoch >= len(self):
            if self.finite:  # the copies past the smallest shard's whole batches
                self.stats.dropped += self.pipeline.drop_rest()
            raise StopIteration
        outputs, info = self._timed_next_batch()
        valid = int(info[:, 0].sum())
        # A finite stream's tail may hold more than one short batch (batch mode: the input's
        # short last unit); DROP drops each of them.
        while self.finite and valid < b and self.last_batch_policy == LastBatchPolicy.DROP:
            self.stats.dropped += valid
            outputs, info = self._timed_next_batch()
            valid = int(info[:, 0].sum())
        keep = b
        if self.finite:
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
        if self._step_in_epoch == 1:  # the pass began at this draw, at the factor of now
            self._epoch_steps = len(self)
        batch = {}
        for name, value in zip(self.output_map, outputs, strict=True):
            tensor = to_torch(value)
            batch[name] = tensor[:keep] if keep < b else tensor
        return [batch]

    def _timed_next_batch(self) -> tuple[list[Any], np.ndarray]:
        pipe = self.pipeline
        wait_up0, wait_down0 = pipe.upstream_wait_s, pipe.downstream_wait_s
        t0 = time.perf_counter()
        outputs, info = pipe.next_batch()
        if len(outputs) != len(self.output_map):
            raise ValueError(
                f"output_map has {len(self.output_map)} names but the pipeline returns "
                f"{len(outputs)} outputs"
            )
        wall = time.perf_counter() - t0
        # Deterministic mode fills the cache in this thread; that time is upstream work.
        waited_up = pipe.upstream_wait_s - wait_up0
        self.stats.t_down += max(pipe.downstream_wait_s - wait_down0, wall - waited_up)
        self.stats.upstream_batches, self.stats.upstream_time_s = pipe.upstream_time()
        self.stats.t_up = pipe.upstream_step_seconds()
        return outputs, info

    def reset(self) -> None:
        """Starts the next epoch (for a finite stream: the next pass over the data, whole).

        After an epoch's last step, the copies ``DROP`` left of the pass are dropped (counted in
        ``stats.dropped``); inside an epoch, the rest of its pass is (counted in the pipeline's
        ``copies_discarded``): the upstream reads the rest of its reader epoch, so the next
        epoch holds every sample of the shard e times. (DALI's iterators ignore a reset inside
        an epoch, with a warning.)"""
        complete = self._epoch_done or self._took_its_steps()
        self._epoch_done, self._step_in_epoch, self._epoch_steps = False, 0, None
        if self.finite and complete:
            self.stats.dropped += self.pipeline.finish_pass()
        elif self.finite:
            self.pipeline.reset(drop_rest=True)

    # -- checkpointing --

    def state_dict(self) -> dict[str, Any]:
        """Pipeline echo state (:meth:`EchoPipeline.state_dict`, its arrays as tensors, so
        ``torch.load(weights_only=True)`` reads it) plus the iterator's position."""
        return {
            "pipeline": arrays_as_tensors(self.pipeline.state_dict()),
            "iterator": {
                "stats": dict(self.stats.__dict__),
                "step_in_epoch": self._step_in_epoch,
                "epoch_done": self._epoch_done,
                # A set_echo_factor after the epoch's last step (an epoch-end callback) must
                # not turn the restored, finished epoch into one still short of its new len().
                "epoch_steps": self._epoch_steps,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output into a freshly created iterator."""
        self.pipeline.load_state_dict(tensors_as_arrays(state["pipeline"]))
        it = state["iterator"]
        self.stats = EchoIteratorStats(**it["stats"])
        self._step_in_epoch = int(it["step_in_epoch"])
        self._epoch_done = bool(it["epoch_done"])
        steps = it.get("epoch_steps")  # (absent from states saved before it was kept)
        self._epoch_steps = None if steps is None else int(steps)
        self._lens_told.clear()  # its first iter() goes on with the saved epoch, rightly

    # -- lifetime --

    def close(self) -> None:
        """Closes the pipeline (cache closed, upstream thread joined)."""
        self.pipeline.close()

    def __enter__(self) -> EchoIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
