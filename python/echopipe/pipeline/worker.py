"""The stage worker threads of :class:`~echopipe.pipeline.engine.StalePipeline`.

:class:`StageWorkers` is given everything it runs (the stage cores, their devices, thread
counts, a clock) and owns only the threads, the queues between them and the first error.

Each stage runs in its own worker thread with its own compute stream and copy stream (CUDA),
or as a plain thread with its share of the intra-op CPU threads. Stages talk through queues:
activations flow forward with the targets, gradients flow backward. Every blocking wait has a
short timeout and checks a stop flag, so an exception in any stage stops all workers and is
raised to the caller at its next call (or while it is blocked in one) within a fraction of a
second.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .modes import ModeSnapshot
from .results import LossRecord, refilled
from .stage import AutocastState, StageCore
from .stream import BusyTimer, DeviceStream, KeepAlive, StreamEvent, transfer

__all__ = ["Batch", "Drain", "PipelineError", "SchedulerStep", "StageWorkers", "divide_threads"]

POLL_S = 0.02


class PipelineError(RuntimeError):
    """An exception raised inside a pipeline stage; ``stage`` names which one."""

    def __init__(self, stage: int, message: str) -> None:
        super().__init__(message)
        self.stage = stage


# Messages between the caller and the stage workers ------------------------------------------
@dataclass
class Batch:
    index: int
    x: torch.Tensor
    target: torch.Tensor | None
    ready: StreamEvent  # x is ready: the caller's stream for stage 0, else the sender's compute
    target_ready: StreamEvent  # the target is ready (the caller's stream)
    autocast: AutocastState = ()  # the caller's autocast regions around train_step
    modes: ModeSnapshot = ()  # the stages' module modes when the caller fed it
    x_version: int | None = None  # the caller's x's version counter at train_step (stage 0)
    target_version: int | None = None  # the caller's target's, carried to the last stage


@dataclass
class _Grad:
    index: int
    grad: torch.Tensor | None
    ready: StreamEvent


@dataclass
class Drain:
    staleness: list[int]
    serial: int  # which drain_to() call: a stage's done-token names it


class SchedulerStep:
    pass


def _check_unchanged(stage: int, msg: Batch, last: bool) -> None:
    error = refilled(
        (("input", msg.x if stage == 0 else None, msg.x_version),
         ("target", msg.target if last else None, msg.target_version)),
        msg.index, f"stage {stage} read it", "later",
    )  # fmt: skip
    if error is not None:
        raise RuntimeError(error)


class _Stopped(Exception):
    pass


def divide_threads(
    devices: Sequence[torch.device], intra_op_threads: int | Sequence[int] | None
) -> list[int]:
    """Intra-op CPU threads of each stage worker (``intra_op_threads`` checked): by default the
    caller's ``torch.get_num_threads()`` divided among the CPU stages."""
    num_stages = len(devices)
    if intra_op_threads is None:
        cpu_stages = sum(1 for d in devices if d.type == "cpu")
        share = max(1, torch.get_num_threads() // max(1, cpu_stages))
        return [share if d.type == "cpu" else 1 for d in devices]
    if isinstance(intra_op_threads, int):
        values = [intra_op_threads] * num_stages
    else:
        values = list(intra_op_threads)
        if len(values) != num_stages:
            raise ValueError(f"intra_op_threads needs {num_stages} entries, got {values!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"intra_op_threads entries must be ints >= 1, got {values!r}")
    return values


# Every StageWorkers not shut down. Their threads are daemons (a forgotten pipeline must not
# keep the process alive), and a daemon thread still in torch code when the interpreter
# finalizes is ended inside it and aborts the process: interpreter exit stops them first, from
# atexit, which runs after Python joined the non-daemon threads (one may still be training).
_RUNNING: weakref.WeakSet[StageWorkers] = weakref.WeakSet()


def _stop_running() -> None:
    for workers in list(_RUNNING):
        workers.shutdown()


atexit.register(_stop_running)


class StageWorkers:
    """One worker thread per stage, the queues between them, and the first error any raised.

    Args:
        cores: one :class:`StageCore` per stage (its module, optimizer and schedule state).
        devices: the device of each stage.
        threads_per_stage: intra-op CPU threads of each worker (see :func:`divide_threads`).
        max_prefetch: minibatches the caller may queue ahead of stage 0.
        clock: host seconds for the busy time of CPU stages (:meth:`step_seconds`); CUDA
            stages are timed by events on their compute stream.

    The threads start in the constructor. The caller feeds stage 0 with :meth:`put`, reads
    finished losses with :meth:`collect` and waits for a drain with :meth:`drain_to`; each of
    these raises the first stage's :class:`PipelineError` once one has failed.
    """

    def __init__(
        self,
        cores: Sequence[StageCore],
        devices: Sequence[torch.device],
        threads_per_stage: Sequence[int],
        max_prefetch: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.num_stages = len(cores)
        self._cores = list(cores)
        self._devices = list(devices)
        self._threads_per_stage = list(threads_per_stage)
        self._clock = clock
        # Per stage: timers of its forwards and backwards (set by its thread), and the latest
        # mean seconds of each (None until one completed).
        self._busy: list[tuple[BusyTimer, BusyTimer] | None] = [None] * self.num_stages
        self._busy_means: list[list[float | None]] = [[None, None] for _ in self._cores]
        self._fwd_queues: list[queue.Queue[Any]] = [
            queue.Queue(maxsize=max(1, max_prefetch)) if k == 0 else queue.Queue()
            for k in range(self.num_stages)
        ]
        self._bwd_queues: list[queue.Queue[Any]] = [queue.Queue() for _ in range(self.num_stages)]
        self._drained: queue.Queue[int] = queue.Queue()  # the serial of each stage's drain
        self._drains = 0
        self._losses: queue.Queue[LossRecord] = queue.Queue()
        self._stop = threading.Event()
        self._error: PipelineError | None = None
        self._error_lock = threading.Lock()
        self.closed = False
        started = threading.Barrier(self.num_stages + 1)
        caller_threads = torch.get_num_threads()
        self.threads = [
            threading.Thread(
                target=self._worker,
                args=(k, started),
                name=f"echopipe-stage-{k}",
                daemon=True,
            )
            for k in range(self.num_stages)
        ]
        for t in self.threads:
            t.start()
        _RUNNING.add(self)
        try:
            started.wait(timeout=60)
        except threading.BrokenBarrierError:  # a stage failed to start (or none in 60 s)
            torch.set_num_threads(caller_threads)
            self.shutdown()
            if self._error is not None:
                raise self._error from None
            raise RuntimeError("the pipeline's stage threads did not start within 60 s") from None
        # torch.set_num_threads acts per OS thread for OpenMP/MKL, but the value that
        # torch.get_num_threads() reports is global; restore the caller's view.
        torch.set_num_threads(caller_threads)

    # Caller side ----------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the first stage failure (stopping every worker), or if closed."""
        if self._error is not None:
            self.shutdown()
            # A fresh exception per call: the kept one would hold, in its traceback, the frames
            # (and tensors) of every call it was raised through, for the pipeline's lifetime.
            raise PipelineError(self._error.stage, str(self._error)) from self._error.__cause__
        if self.closed:
            raise RuntimeError("the pipeline is closed")

    def put(self, item: Batch | Drain | SchedulerStep) -> None:
        """Queue ``item`` for stage 0, waiting while the queue is full."""
        while True:
            self.check()
            try:
                self._fwd_queues[0].put(item, timeout=POLL_S)
                return
            except queue.Full:
                continue

    def collect(self) -> list[LossRecord]:
        """The losses the last stage finished since the previous call."""
        out: list[LossRecord] = []
        while True:
            try:
                out.append(self._losses.get_nowait())
            except queue.Empty:
                return out

    def drain_to(self, staleness: list[int]) -> None:
        """Finish every in-flight minibatch, then give each stage its new staleness."""
        self.check()
        self._drains += 1
        serial = self._drains
        self.put(Drain(list(staleness), serial))
        done = 0
        while done < self.num_stages:
            self.check()
            try:
                # Tokens of an earlier drain whose wait was interrupted (Ctrl-C) do not count.
                if self._drained.get(timeout=POLL_S) == serial:
                    done += 1
            except queue.Empty:
                continue

    def step_seconds(self) -> float | None:
        """Busy seconds per minibatch of the slowest stage, from the work completed since the
        previous call; ``None`` until every stage has done a forward and a backward."""
        for timers, means in zip(self._busy, self._busy_means, strict=True):
            for j, timer in enumerate(timers or ()):
                seconds, spans = timer.take()
                if spans:
                    means[j] = seconds / spans
        totals = [None if None in m else m[0] + m[1] for m in self._busy_means]  # type: ignore[operator]
        return None if None in totals else max(totals)  # type: ignore[type-var]

    def shutdown(self) -> None:
        """Stop and join every worker (in-flight minibatches are dropped)."""
        self._stop.set()
        current = threading.current_thread()
        for t in self.threads:
            if t is not current:
                t.join(timeout=10)
        if not any(t.is_alive() for t in self.threads):
            # The dropped minibatches' inputs, activations and graphs would otherwise live as
            # long as the pipeline object (a failed one kept for its error, in a notebook).
            for core in self._cores:
                core.in_flight.clear()
            for q in (*self._fwd_queues, *self._bwd_queues):
                with contextlib.suppress(queue.Empty):
                    while True:
                        q.get_nowait()
        self.closed = True

    # Worker side ----------------------------------------------------------------------------
    def _get(self, q: queue.Queue[Any]) -> Any:
        while True:
            if self._stop.is_set():
                raise _Stopped
            try:
                return q.get(timeout=POLL_S)
            except queue.Empty:
                continue

    def _worker(self, k: int, started: threading.Barrier) -> None:
        core = self._cores[k]
        device = self._devices[k]
        try:
            if device.type == "cpu":
                # ATen initialises a thread's OpenMP pool from the process-wide count on the
                # thread's first parallel op; trigger that now so our per-thread count sticks.
                torch.get_num_threads()
                torch.set_num_threads(self._threads_per_stage[k])
            compute = DeviceStream(device)
            copy = DeviceStream(device)
            self._busy[k] = (BusyTimer(compute, self._clock), BusyTimer(compute, self._clock))
        except BaseException as exc:  # stream creation failure: the constructor raises it
            self._fail(k, exc)
            started.abort()
            return
        try:
            started.wait()
        except threading.BrokenBarrierError:  # another stage failed to start
            return
        try:
            with compute.use():
                self._stage_loop(k, core, compute, copy)
        except _Stopped:
            return
        except BaseException as exc:
            self._fail(k, exc)

    def _stage_loop(
        self, k: int, core: StageCore, compute: DeviceStream, copy: DeviceStream
    ) -> None:
        last = k == self.num_stages - 1
        draining: Drain | None = None
        held = KeepAlive()
        while True:
            if draining is None and len(core.in_flight) <= core.staleness:
                msg = self._get(self._fwd_queues[k])
                if isinstance(msg, Drain | SchedulerStep):
                    if not last:
                        self._fwd_queues[k + 1].put(msg)
                    if isinstance(msg, Drain):
                        draining = msg
                    else:
                        core.schedule_scheduler_step()
                    continue
                _check_unchanged(k, msg, last)
                x = transfer(msg.x, msg.ready, copy, compute, held)
                target = msg.target
                if last and target is not None:
                    target = transfer(target, msg.target_ready, copy, compute, held)
                with self._busy[k][0].span():
                    out, loss = core.forward(msg.index, x, target, msg.autocast, msg.modes)
                if last:
                    assert loss is not None
                    self._losses.put(LossRecord(msg.index, loss, compute.record()))
                else:
                    self._fwd_queues[k + 1].put(
                        Batch(
                            msg.index,
                            out,
                            msg.target,
                            compute.record(),
                            msg.target_ready,
                            msg.autocast,
                            msg.modes,
                            target_version=msg.target_version,
                        )
                    )
            elif core.in_flight:
                index = core.in_flight[0].index
                grad = None
                if not last:
                    gmsg = self._get(self._bwd_queues[k])
                    if gmsg.index != index:
                        raise RuntimeError(
                            f"stage {k}: got gradient of minibatch {gmsg.index}, expected {index}"
                        )
                    if gmsg.grad is not None:
                        grad = transfer(gmsg.grad, gmsg.ready, copy, compute, held)
                with self._busy[k][1].span():
                    grad_in = core.backward(index, grad)
                if k > 0:
                    self._bwd_queues[k - 1].put(_Grad(index, grad_in, compute.record()))
            else:
                assert draining is not None
                compute.synchronize()
                copy.synchronize()
                held.release_done()  # else the last sources stay until the next transfer
                core.staleness = draining.staleness[k]
                self._drained.put(draining.serial)
                draining = None

    def _fail(self, k: int, exc: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                error = PipelineError(k, f"pipeline stage {k} failed: {detail}")
                error.__cause__ = exc
                self._error = error
        self._stop.set()
