"""The downstream side of an :class:`~echopipe.dali.EchoPipeline`: DALI's queue of scheduled
iterations, the batches restored from a checkpoint, and where the pass stands.

:class:`DownstreamQueue` is given the built downstream DALI pipeline, its prefetch depth, and two
callables of the pipeline: ``fill`` (deterministic mode: fill the cache before an iteration) and
``check_upstream`` (raise the upstream's error, if any). It is the only holder of this state;
DALI's iterators and :meth:`EchoPipeline.next_batch` both draw through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .host_copy import host_dense, to_numpy

Batch = tuple[list[Any], np.ndarray]


class DownstreamQueue:
    """Scheduled downstream iterations, restored batches, and the pass's counters.

    Attributes:
        stash: batches restored from a checkpoint (numpy), handed out before new ones.
        handed: real copies handed out in this pass.
        batches: batches handed out in this pass (padding-only ones included).
        input_done: the pass's end was drawn (a batch without a real sample).
        exhausted: nothing more to hand out in this pass: its data ended and it handed out as
            many batches as every shard's pass (padding-only ones after the data, as DALI's
            reader pads a smaller shard's epoch to the largest one's batches).
        wait_s: seconds the consumer waited for downstream batches.
        copies_discarded: real copies of the pass a reset ended before they were handed out.
    """

    def __init__(
        self,
        downstream: Any,
        prefetch: int,
        deterministic: bool,
        fill: Callable[[], None],
        check_upstream: Callable[[], None],
        pass_batches: Callable[[], int | None] = lambda: None,
    ) -> None:
        self._downstream = downstream
        # DALI's first schedule_run() prefetches its whole queue only with a pipelined executor
        # (exec_pipelined=True, the default); without one, every schedule_run() runs one
        # iteration, and a synchronous one (exec_async=False) blocks in a run that has no
        # free output buffer, so the queue is kept (and refilled) one iteration deep there.
        self._prefetch = prefetch if getattr(downstream, "exec_pipelined", True) else 1
        # A synchronous executor runs an iteration inside schedule_run() and needs a free output
        # buffer for it, so next_batch() releases the batch it handed out before scheduling the
        # next iteration (at the next call) instead of right after taking it.
        self._sync = not getattr(downstream, "exec_async", True)
        self._refill_due = False
        self._deterministic = deterministic
        self._fill = fill
        self._check_upstream = check_upstream
        self._scheduled = 0
        self._dali_prefetched = False
        self._shared = False
        self.stash: list[Batch] = []
        self.handed = 0
        self.input_done = False
        self.exhausted = False
        self.wait_s = 0.0
        self.copies_discarded = 0
        # Batches every shard's pass hands out (None: as many as its data fills), read at the
        # pass's first batch (set_echo_factor between passes changes it).
        self._pass_batches = pass_batches
        self._limit: int | None = None
        self._limit_read = False
        self.batches = 0

    def next_batch(self) -> Batch:
        """Next batch: (pipeline outputs, info); StopIteration at the end of a finite pass."""
        if self.stash:
            return self._from_stash()
        if self.exhausted:
            raise StopIteration
        self._check_upstream()
        if self._deterministic:
            self._fill()
            t0 = time.perf_counter()
            self._downstream.schedule_run()
            self._scheduled += 1
        else:
            t0 = time.perf_counter()
            if self._refill_due:
                self._refill_due = False
                self._downstream.release_outputs()
                self._downstream.schedule_run()
                self._scheduled += 1
            self._schedule_free_running()
        if self._scheduled == 0:
            self.exhausted = True
            raise StopIteration
        try:
            outputs = list(self._downstream.outputs())
        except Exception:
            self._check_upstream()
            raise
        self._scheduled -= 1
        self.wait_s += time.perf_counter() - t0
        info = self._end_of_stream(outputs[-1])
        if info is None:
            raise StopIteration
        if self._sync and not self._deterministic:
            self._refill_due = True
        elif not self._deterministic:
            self._downstream.schedule_run()
            self._scheduled += 1
        self._count(info)
        return outputs[:-1], info

    def _count(self, info: np.ndarray) -> None:
        self._pass_limit()
        self.batches += 1
        self.handed += int(info[:, 0].sum())

    def _pass_limit(self) -> int | None:
        if not self._limit_read:
            self._limit, self._limit_read = self._pass_batches(), True
        return self._limit

    def _from_stash(self) -> Batch:
        outputs, info = self.stash.pop(0)
        self._count(info)
        return outputs, info

    def _owes_padding(self, ahead: int = 0) -> bool:
        """True while this pass has handed out (with ``ahead`` batches more) fewer batches than
        every shard's pass."""
        limit = self._pass_limit()
        return limit is not None and self.batches + ahead < limit

    def _schedule_free_running(self) -> None:
        if self._scheduled == 0 and not self.input_done:
            # DALI prefetches the whole queue on its first schedule_run() only.
            first = not self._dali_prefetched
            self._dali_prefetched = True
            for _ in range(1 if first else self._prefetch):
                self._downstream.schedule_run()
            self._scheduled = self._prefetch

    def _end_of_stream(self, info_list: Any) -> np.ndarray | None:
        """The batch's ``info`` as numpy, or None (and the pass marked exhausted) when it
        holds no real sample and the pass owes no more batches. Only such a batch ends the
        data: in batch mode the input's short last unit can make a batch short while whole
        units are still to come."""
        info = host_dense(info_list)
        if info[:, 0].any():
            return info
        self.input_done = True
        if self._owes_padding():
            return info
        self.exhausted = True
        return None

    # -- DALI's run API (what its iterators call) --

    def schedule_run(self) -> None:
        """Schedules iterations up to the prefetch depth (fills the cache first in
        deterministic mode)."""
        if self._dali_prefetched and self._scheduled >= self._prefetch:
            return  # batches restored from a checkpoint took the places of scheduled ones
        if self.exhausted:
            return  # the pass ended (a restored one may hold nothing more to draw)
        if self._deterministic:
            self._fill()
        if not self._dali_prefetched:
            self._schedule_one()
            return
        # An empty queue (after an epoch's reset drained it) is refilled to the full depth.
        for _ in range(self._prefetch if self._scheduled == 0 else 1):
            self._schedule_one()

    def _schedule_one(self) -> None:
        """One ``schedule_run`` of DALI's: its first prefetches the whole queue, later ones run
        one iteration."""
        self._downstream.schedule_run()
        if self._dali_prefetched:
            self._scheduled += 1
        else:
            self._dali_prefetched = True
            self._scheduled += self._prefetch

    def share_outputs(self) -> tuple[Any, ...]:
        """The next batch's outputs without ``info``; StopIteration at the end of a pass."""
        if self.stash:
            arrays, _ = self._from_stash()
            return tuple(_as_tensor_list(a) for a in arrays)
        if self.exhausted:
            raise StopIteration
        self._check_upstream()
        if self._scheduled == 0:
            self.schedule_run()
        try:
            outputs = self._downstream.share_outputs()
        except Exception:
            self._check_upstream()
            raise
        self._scheduled -= 1
        info = self._end_of_stream(outputs[-1])
        if info is None:
            self._downstream.release_outputs()
            raise StopIteration
        self._count(info)
        self._shared = True
        return tuple(outputs[:-1])

    def release_outputs(self) -> None:
        """Returns the buffers of the last :meth:`share_outputs` to DALI."""
        if self._shared:
            self._shared = False
            self._downstream.release_outputs()

    def empty(self) -> bool:
        """True when no batch is scheduled or restored and waiting to be taken."""
        return self._scheduled == 0 and not self.stash

    # -- passes and checkpoints --

    def take_prepared(self) -> None:
        """Moves the batches DALI already prepared into the stash (as numpy), for a checkpoint
        that must hold them; they are handed out first afterwards."""
        self.release_outputs()
        while self._scheduled > 0:
            outputs = list(self._downstream.outputs())
            self._scheduled -= 1
            info = host_dense(outputs[-1])
            if info[:, 0].any() or self._owes_padding(len(self.stash)):
                self.stash.append(([to_numpy(o) for o in outputs[:-1]], info))

    def stash_padding(self) -> None:
        """Runs downstream iterations into the stash while this pass owes padding-only batches
        nothing prepared yet, for a checkpoint taken once every copy was drawn: a restored
        source has drawn nothing, so it has no sample to pad with."""
        while self._owes_padding(len(self.stash)):
            self._downstream.release_outputs()  # a synchronous executor runs into a free buffer
            self._schedule_one()
            self.take_prepared()

    def stash_one(self) -> None:
        """Runs one more downstream iteration into the stash, for a checkpoint whose upstream
        iteration is blocked on a full cache: its draws free the space the sink waits for."""
        if self.input_done:
            return
        self._schedule_one()
        self.take_prepared()

    def drop_rest(self) -> int:
        """Draws the copies of this pass not handed out yet and drops them; returns how many.
        ``DROP`` ends every shard's epoch after the smallest shard's whole batches, before a
        larger shard's last copies; the upstream finishes its pass only once they are drawn."""
        self.release_outputs()
        dropped = sum(int(info[:, 0].sum()) for _, info in self.stash)
        self.stash.clear()
        self._refill_due = False
        while not self.input_done:
            self._check_upstream()
            if self._scheduled == 0:
                if self._deterministic:
                    self._fill()
                # A synchronous executor runs the iteration in schedule_run(), into a free buffer.
                self._downstream.release_outputs()
                self._schedule_one()
            info = host_dense(self._downstream.outputs()[-1])
            self._scheduled -= 1
            real = int(info[:, 0].sum())
            self.input_done = real == 0
            dropped += real
        return dropped

    def end_pass(self) -> None:
        """Clears the ended pass: the iterations scheduled after its end hold padding only
        (a real copy among them, or in the stash, is counted in :attr:`copies_discarded`)."""
        self.release_outputs()
        self.copies_discarded += sum(int(info[:, 0].sum()) for _, info in self.stash)
        while self._scheduled > 0:
            info = host_dense(self._downstream.outputs()[-1])
            self.copies_discarded += int(info[:, 0].sum())
            self._scheduled -= 1
        # outputs() holds its batch's buffers until the next call; the next pass's refill
        # needs them all: a synchronous executor (exec_async=False) would wait in it forever.
        self._downstream.release_outputs()
        self._refill_due = False
        self.stash.clear()
        self.input_done = False
        self.exhausted = False
        self.handed = self.batches = 0
        self._limit_read = False

    def restore(
        self, stash: list[Batch], input_done: bool, handed: int, wait_s: float, batches: int
    ) -> None:
        """Takes a checkpoint's batches and counters (before anything ran)."""
        self.stash = [(list(arrays), info) for arrays, info in stash]
        self.input_done = bool(input_done)
        self.handed = int(handed)
        self.wait_s = float(wait_s)
        self.batches = int(batches)


def _as_tensor_list(value: Any) -> Any:
    """A stashed numpy batch (dense array or list of samples) as a DALI CPU TensorList."""
    from nvidia.dali.backend import TensorListCPU

    if isinstance(value, np.ndarray):
        return TensorListCPU(np.ascontiguousarray(value))
    return TensorListCPU([np.ascontiguousarray(v) for v in value])
