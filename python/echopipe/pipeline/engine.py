"""Thread-per-stage engine for stale-weight pipelined backprop (PPL-SGD) in one process.

Each stage runs in its own worker thread with its own compute stream and copy stream (CUDA),
or as a plain thread with its share of the intra-op CPU threads. Stages talk through queues:
activations flow forward with the targets, gradients flow backward. Every blocking wait has a
short timeout and checks a stop flag, so an exception in any stage stops all workers and is
raised to the caller at its next call (or while it is blocked in one) within a fraction of a
second.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from .checkpoint import atomic_save, load_file
from .partition import (
    DeviceLike,
    check_stale_share,
    parse_devices,
    partition_balance,
    split_sequential,
)
from .results import DEFAULT_OUTPUT_MAP, EpochResult, LossRecord, StepResult, unpack_batch
from .schedule import HybridSchedule, stage_staleness
from .stage import StageCore
from .stream import (
    BusyTimer,
    DeviceStream,
    KeepAlive,
    StreamEvent,
    caller_event,
    synchronize_devices,
    transfer,
)

__all__ = [
    "EpochResult",
    "LossRecord",
    "PipelineError",
    "StalePipeline",
    "StepResult",
]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
StageGradHook = Callable[[int, list[nn.Parameter], list[torch.Tensor | None]], None]
"""``hook(stage, params, grads)``: sees (and may replace entries of) a stage's gradients."""

_POLL_S = 0.02
CHECKPOINT_FORMAT = 1


class PipelineError(RuntimeError):
    """An exception raised inside a pipeline stage; ``stage`` names which one."""

    def __init__(self, stage: int, message: str) -> None:
        super().__init__(message)
        self.stage = stage


# Messages between the caller and the stage workers ------------------------------------------
@dataclass
class _Batch:
    index: int
    x: torch.Tensor
    target: torch.Tensor | None
    ready: StreamEvent  # x is ready: the caller's stream for stage 0, else the sender's compute
    target_ready: StreamEvent  # the target is ready (the caller's stream)


@dataclass
class _Grad:
    index: int
    grad: torch.Tensor | None
    ready: StreamEvent


@dataclass
class _Drain:
    staleness: list[int]


class _SchedulerStep:
    pass


class _Stopped(Exception):
    pass


def _bind_grad_hook(
    hook: StageGradHook | None, stage: int, params: list[nn.Parameter]
) -> Callable[[list[torch.Tensor | None]], None] | None:
    if hook is None:
        return None

    def bound(grads: list[torch.Tensor | None]) -> None:
        hook(stage, params, grads)

    return bound


def _stage_optimizer(
    factory: OptimizerFactory, params: list[nn.Parameter]
) -> torch.optim.Optimizer | None:
    if not params:
        return None
    optimizer = factory(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer factory must return a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    return optimizer


class StalePipeline:
    """Stale-weight pipelined training (PPL-SGD) of an ``nn.Sequential`` over several devices.

    All stages work at once on different minibatches. With ``K`` stages, stage ``k`` runs the
    forward of the newest minibatch it has and the backward of an older one; right after each
    backward it updates its own weights with its own optimizer. There is no weight stashing and
    no flush between minibatches.

    **Staleness.** Stage ``k``'s forward of minibatch ``m`` sees the weights after
    ``max(s, m - D_k)`` updates, where ``D_k = 2(K-1-k)`` (see :meth:`staleness`) and ``s`` is the
    first minibatch after the most recent drain (0 at the start). Sequential SGD would use the
    weights after ``m`` updates, so stage ``k`` misses the newest ``D_k`` updates in steady
    state; the last stage is never stale.

    **Weights in backward** (``recompute=False``, the default): backward uses the activations
    saved by forward and, wherever an op saved a weight tensor itself (conv, linear, batch-norm
    scale), the live weight at backward time, which is the weight after ``m`` updates, the
    same one sequential SGD would use. Ops that saved a tensor computed from a weight use the
    forward-time value. ``recompute=True`` keeps only the stage input and reruns the forward
    at backward time with the live weights, so the gradient is exactly that of the current
    weights at the stored input (one extra forward per stage). Stages with ``D_k = 0`` never
    recompute because nothing changes between their forward and backward.

    **BatchNorm.** Training-mode batch statistics are those of the minibatch in the stage's
    forward; running statistics are updated once per minibatch, in forward order. The
    recompute pass uses copies of the buffers and leaves the running statistics untouched.

    Args:
        module: the model, an ``nn.Sequential`` whose children are whole blocks. Its children
            are moved to the stage devices and shared (not copied) by the stages.
        balance: children per stage (torchgpipe convention), ``"auto"`` to profile with
            ``sample_input``, or ``None`` for a single stage.
        devices: one device per stage (``"cpu"``, ``"cuda:1"``, ``1``); CPU when omitted.
        optimizer: factory ``params -> Optimizer``, called once per stage with its parameters.
        scheduler: optional factory ``optimizer -> LRScheduler``, one per stage.
        scheduler_interval: ``"epoch"`` (stepped by :meth:`run_epoch` / :meth:`step_schedulers`,
            right after each stage's update of the epoch's last minibatch) or ``"step"`` (after
            every update of that stage).
        loss_fn: ``loss_fn(output, target) -> scalar``.
        recompute: choose the recompute rule for backward (see above).
        pipelined: start in pipelined (``True``) or synchronous (``False``) mode.
        hybrid: switch from pipelined to synchronous at a given step.
        num_stages: with ``balance="auto"``: how many stages (default: ``len(devices)``).
        sample_input: a representative batch for ``balance="auto"``.
        intra_op_threads: CPU threads per stage worker (an int for all, or one per stage).
            Default: the caller's ``torch.get_num_threads()`` divided among the CPU stages.
        max_prefetch: minibatches the caller may queue ahead of stage 0.
        grad_hook: optional ``hook(stage, params, grads)``, called in stage ``stage``'s worker
            thread after each backward and before that stage's optimizer step, with the stage's
            trainable parameters and their gradients (``None`` where a parameter got none).
            It may replace entries of ``grads`` (same shapes); the optimizer then sees those.
            Typical use: average the gradients over data-parallel replicas of the pipeline
            (``all_reduce`` on a process group per stage). Runs for every update, in the
            stage's fixed operation order.
        max_stale_share: bound on the share of trainable parameters in the stale stages (all
            but the last): ``balance="auto"`` picks the fastest split within it, an explicit
            balance above it raises ``ValueError`` (see ``partition.stale_share``).
        balance_cost, balance_cache: make ``balance="auto"`` repeatable: ``"model"`` estimates
            each layer from FLOPs and bytes instead of timing it; a cache path stores the
            choice and reuses it (``partition_balance``'s ``cost`` and ``cache``).
    """

    def __init__(
        self,
        module: nn.Sequential,
        *,
        optimizer: OptimizerFactory,
        loss_fn: LossFn,
        balance: Sequence[int] | Literal["auto"] | None = None,
        devices: Sequence[DeviceLike] | None = None,
        scheduler: SchedulerFactory | None = None,
        scheduler_interval: Literal["epoch", "step"] = "epoch",
        recompute: bool = False,
        pipelined: bool = True,
        hybrid: HybridSchedule | None = None,
        num_stages: int | None = None,
        sample_input: torch.Tensor | None = None,
        intra_op_threads: int | Sequence[int] | None = None,
        max_prefetch: int = 2,
        grad_hook: StageGradHook | None = None,
        max_stale_share: float | None = None,
        balance_cost: Literal["time", "model"] = "time",
        balance_cache: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(module, nn.Sequential):
            raise TypeError(
                f"StalePipeline needs an nn.Sequential (one child per block), got "
                f"{type(module).__name__}"
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
        self.module = module
        self.stages = split_sequential(module, balance)
        self.balance = [len(s) for s in self.stages]
        self.num_stages = len(self.stages)
        self.devices = parse_devices(devices, self.num_stages)
        self.loss_fn = loss_fn
        self.recompute = bool(recompute)
        self.hybrid = hybrid
        self._pipelined = bool(pipelined)
        if hybrid is not None and hybrid.pipelined_steps == 0:
            self._pipelined = False
        for stage, device in zip(self.stages, self.devices, strict=True):
            stage.to(device)
        synchronize_devices(self.devices)
        module.train()

        self._cores: list[StageCore] = []
        staleness = stage_staleness(self.num_stages, self._pipelined)
        for k, (stage, device) in enumerate(zip(self.stages, self.devices, strict=True)):
            params = [p for p in stage.parameters() if p.requires_grad]
            opt = _stage_optimizer(optimizer, params)
            sched = scheduler(opt) if (scheduler is not None and opt is not None) else None
            core = StageCore(
                k, self.num_stages, stage, device, opt, sched, scheduler_interval,
                loss_fn if k == self.num_stages - 1 else None, self.recompute,
                grad_hook=_bind_grad_hook(grad_hook, k, params),
            )  # fmt: skip
            core.staleness = staleness[k]
            self._cores.append(core)

        self._threads_per_stage = self._divide_threads(intra_op_threads)
        # Per stage: timers of its forwards and backwards (set by its thread), and the latest
        # mean seconds of each (None until one completed).
        self._busy: list[tuple[BusyTimer, BusyTimer] | None] = [None] * self.num_stages
        self._busy_means: list[list[float | None]] = [[None, None] for _ in self._cores]
        self.steps_fed = 0
        self.samples_seen = 0
        self._fwd_queues: list[queue.Queue[Any]] = [
            queue.Queue(maxsize=max(1, max_prefetch)) if k == 0 else queue.Queue()
            for k in range(self.num_stages)
        ]
        self._bwd_queues: list[queue.Queue[Any]] = [queue.Queue() for _ in range(self.num_stages)]
        self._drained: queue.Queue[int] = queue.Queue()
        self._losses: queue.Queue[LossRecord] = queue.Queue()
        self._stop = threading.Event()
        self._error: PipelineError | None = None
        self._error_lock = threading.Lock()
        self._closed = False
        self._idle = True  # no minibatch in flight (after construction or a drain)
        started = threading.Barrier(self.num_stages + 1)
        caller_threads = torch.get_num_threads()
        self._threads = [
            threading.Thread(
                target=self._worker,
                args=(k, started),
                name=f"echopipe-stage-{k}",
                daemon=True,
            )
            for k in range(self.num_stages)
        ]
        for t in self._threads:
            t.start()
        started.wait(timeout=60)
        # torch.set_num_threads acts per OS thread for OpenMP/MKL, but the value that
        # torch.get_num_threads() reports is global; restore the caller's view.
        torch.set_num_threads(caller_threads)

    # ---------------------------------------------------------------------------------------
    def _divide_threads(self, intra_op_threads: int | Sequence[int] | None) -> list[int]:
        if intra_op_threads is None:
            cpu_stages = sum(1 for d in self.devices if d.type == "cpu")
            share = max(1, torch.get_num_threads() // max(1, cpu_stages))
            return [share if d.type == "cpu" else 1 for d in self.devices]
        if isinstance(intra_op_threads, int):
            values = [intra_op_threads] * self.num_stages
        else:
            values = list(intra_op_threads)
            if len(values) != self.num_stages:
                raise ValueError(
                    f"intra_op_threads needs {self.num_stages} entries, got {values!r}"
                )
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"intra_op_threads entries must be ints >= 1, got {values!r}")
        return values

    def step_seconds(self) -> float | None:
        """Busy seconds per minibatch of the slowest stage (forward plus backward and update),
        from the work completed since the previous call; ``None`` until every stage has done
        both once. This is the pipeline's pace with an instant input (``t_down``): queue waits
        are not counted, and on CUDA it is the streams' time, not the kernel launches'."""
        for timers, means in zip(self._busy, self._busy_means, strict=True):
            for j, timer in enumerate(timers or ()):
                seconds, spans = timer.take()
                if spans:
                    means[j] = seconds / spans
        totals = [None if None in m else m[0] + m[1] for m in self._busy_means]  # type: ignore[operator]
        return None if None in totals else max(totals)  # type: ignore[type-var]

    def staleness(self) -> list[int]:
        """Per stage: how many of the newest updates its forward misses in steady state.

        ``2(K-1-k)`` for stage ``k`` of ``K`` in pipelined mode, ``0`` in synchronous mode.
        """
        return stage_staleness(self.num_stages, self._pipelined)

    @property
    def pipelined(self) -> bool:
        """Whether the pipeline currently runs in pipelined (stale-weight) mode."""
        return self._pipelined

    @property
    def steps_applied(self) -> int:
        """Minibatches whose update has been applied by every stage."""
        return min(core.updates_applied for core in self._cores)

    @property
    def updates_per_stage(self) -> list[int]:
        """Updates applied so far by each stage."""
        return [core.updates_applied for core in self._cores]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer | None]:
        """The per-stage optimizers (``None`` for stages without trainable weights)."""
        return [core.optimizer for core in self._cores]

    @property
    def schedulers(self) -> list[torch.optim.lr_scheduler.LRScheduler | None]:
        """The per-stage LR schedulers."""
        return [core.scheduler for core in self._cores]

    # Worker ---------------------------------------------------------------------------------
    def _get(self, q: queue.Queue[Any]) -> Any:
        while True:
            if self._stop.is_set():
                raise _Stopped
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                continue

    def _worker(self, k: int, started: threading.Barrier) -> None:
        core = self._cores[k]
        device = self.devices[k]
        try:
            if device.type == "cpu":
                # ATen initialises a thread's OpenMP pool from the process-wide count on the
                # thread's first parallel op; trigger that now so our per-thread count sticks.
                torch.get_num_threads()
                torch.set_num_threads(self._threads_per_stage[k])
            compute = DeviceStream(device)
            copy = DeviceStream(device)
            self._busy[k] = (BusyTimer(compute), BusyTimer(compute))
        except BaseException as exc:  # pragma: no cover - stream creation failure
            self._fail(k, exc)
            started.abort()
            return
        started.wait()
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
        draining: _Drain | None = None
        held = KeepAlive()
        while True:
            if draining is None and len(core.in_flight) <= core.staleness:
                msg = self._get(self._fwd_queues[k])
                if isinstance(msg, _Drain | _SchedulerStep):
                    if not last:
                        self._fwd_queues[k + 1].put(msg)
                    if isinstance(msg, _Drain):
                        draining = msg
                    else:
                        core.schedule_scheduler_step()
                    continue
                x = transfer(msg.x, msg.ready, copy, compute, held)
                target = msg.target
                if last and target is not None:
                    target = transfer(target, msg.target_ready, copy, compute, held)
                with self._busy[k][0].span():
                    out, loss = core.forward(msg.index, x, target)
                if last:
                    assert loss is not None
                    self._losses.put(LossRecord(msg.index, loss, compute.record()))
                else:
                    self._fwd_queues[k + 1].put(
                        _Batch(msg.index, out, msg.target, compute.record(), msg.target_ready)
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
                core.staleness = draining.staleness[k]
                draining = None
                self._drained.put(k)

    def _fail(self, k: int, exc: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                error = PipelineError(k, f"pipeline stage {k} failed: {detail}")
                error.__cause__ = exc
                self._error = error
        self._stop.set()

    # Caller side ----------------------------------------------------------------------------
    def _check(self) -> None:
        if self._error is not None:
            self._shutdown()
            raise self._error
        if self._closed:
            raise RuntimeError("the pipeline is closed")

    def _put(self, q: queue.Queue[Any], item: Any) -> None:
        while True:
            self._check()
            try:
                q.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def _collect(self) -> list[LossRecord]:
        out: list[LossRecord] = []
        while True:
            try:
                out.append(self._losses.get_nowait())
            except queue.Empty:
                return out

    def train_step(self, x: torch.Tensor, target: torch.Tensor) -> StepResult:
        """Feed one minibatch; returns the losses of minibatches that finished meanwhile.

        Blocks only while the pipeline is full (``max_prefetch`` minibatches queued). Raises
        :class:`PipelineError` if any stage failed.
        """
        self._check()
        if not isinstance(x, torch.Tensor) or not isinstance(target, torch.Tensor):
            raise TypeError(
                f"train_step needs tensors (x, target), got {type(x).__name__}, "
                f"{type(target).__name__}"
            )
        index = self.steps_fed
        if self.hybrid is not None and self._pipelined and not self.hybrid.pipelined_at(index):
            self.set_pipelined(False)
        batch = _Batch(index, x, target, caller_event(x), caller_event(target))
        self._put(self._fwd_queues[0], batch)
        self._idle = False
        self.steps_fed += 1
        self.samples_seen += int(x.shape[0]) if x.dim() > 0 else 1
        return StepResult(index, self._collect())

    def step_schedulers(self) -> None:
        """Step every stage's LR scheduler once, right after its update of the newest minibatch.

        The request travels through the pipeline in order, so each stage applies it at the
        same point of its own operation sequence regardless of thread timing.
        """
        self._check()
        self._put(self._fwd_queues[0], _SchedulerStep())

    def run_epoch(
        self,
        loader: Iterable[Any],
        *,
        drain: bool = False,
        step_schedulers: bool = True,
        output_map: Sequence[str] = DEFAULT_OUTPUT_MAP,
    ) -> EpochResult:
        """Feed every batch of ``loader``; no flush at the end unless ``drain``.

        Batches are ``(x, target)`` pairs or DALI-style dicts (``[{"data": x, "label": y}]``
        from ``DALIGenericIterator``, ``DALIClassificationIterator`` or ``EchoIterator``), whose
        keys ``output_map`` names; ``(N, 1)`` integer labels become ``(N,)`` int64 (see
        :func:`~echopipe.pipeline.results.unpack_batch`). With ``scheduler_interval="epoch"``
        and ``step_schedulers``, each stage's scheduler steps once after its update of the
        epoch's last minibatch.
        """
        start = time.perf_counter()
        steps = samples = 0
        losses: list[float] = []
        for batch in loader:
            x, target = unpack_batch(batch, output_map)
            result = self.train_step(x, target)
            losses.extend(result.losses)
            steps += 1
            samples += int(x.shape[0])
        if step_schedulers and self._cores[0].scheduler_interval == "epoch":
            self.step_schedulers()
        if drain:
            losses.extend(r.value for r in self.drain())
        return EpochResult(steps, samples, losses, time.perf_counter() - start)

    def drain(self) -> list[LossRecord]:
        """Finish every in-flight minibatch (forward, backward, update) and wait for it.

        Afterwards no minibatch is in flight, all stage streams are synchronised and the
        weights are those after ``steps_fed`` updates. Returns the losses finished meanwhile.
        """
        self._drain_to(self.staleness())
        return self._collect()

    def _drain_to(self, staleness: list[int]) -> None:
        self._check()
        self._put(self._fwd_queues[0], _Drain(list(staleness)))
        done = 0
        while done < self.num_stages:
            self._check()
            try:
                self._drained.get(timeout=_POLL_S)
                done += 1
            except queue.Empty:
                continue
        self._idle = True

    def set_pipelined(self, pipelined: bool) -> None:
        """Switch between pipelined and synchronous mode after draining in-flight work."""
        self._drain_to(stage_staleness(self.num_stages, pipelined))
        self._pipelined = bool(pipelined)

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        was = [s.training for s in self.stages]
        for s in self.stages:
            s.eval()
        try:
            yield
        finally:
            for s, mode in zip(self.stages, was, strict=True):
                s.train(mode)

    def evaluate(self, x: torch.Tensor, batch_size: int | None = None) -> torch.Tensor:
        """Eval-mode forward of ``x`` through all stages (drains first); logits on CPU.

        Normalisation layers use their running statistics. The pipeline stays usable.
        """
        if not self._idle:
            self.drain()
        self._check()
        outputs: list[torch.Tensor] = []
        chunks = [x] if batch_size is None else list(torch.split(x, batch_size))
        with torch.no_grad(), self._eval_mode():
            for chunk in chunks:
                h = chunk
                for stage, device in zip(self.stages, self.devices, strict=True):
                    h = stage(h.to(device))
                outputs.append(h.cpu())
        return torch.cat(outputs) if outputs else torch.empty(0)

    def accuracy(self, x: torch.Tensor, target: torch.Tensor, batch_size: int = 512) -> float:
        """Top-1 accuracy (fraction in [0, 1]) of :meth:`evaluate` on ``x`` against ``target``."""
        logits = self.evaluate(x, batch_size)
        return float((logits.argmax(dim=1) == target.cpu()).double().mean().item())

    # Checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: weights, optimizers, schedulers, counters, mode.

        Drains first (the checkpoint policy): no minibatch is in flight in a checkpoint, so
        resuming continues exactly as an uninterrupted run that drained at the same step.
        """
        if not self._idle:
            self.drain()
        self._check()
        return {
            "format": CHECKPOINT_FORMAT,
            "balance": list(self.balance),
            "stages": [s.state_dict() for s in self.stages],
            "optimizers": [o.state_dict() if o is not None else None for o in self.optimizers],
            "schedulers": [s.state_dict() if s is not None else None for s in self.schedulers],
            "updates_per_stage": self.updates_per_stage,
            "scheduler_steps": [c.scheduler_steps for c in self._cores],
            "steps_fed": self.steps_fed,
            "samples_seen": self.samples_seen,
            "pipelined": self._pipelined,
            "recompute": self.recompute,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the balance must match this pipeline's."""
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError("not an echopipe pipeline checkpoint (missing or unknown 'format')")
        if list(state["balance"]) != self.balance:
            raise ValueError(
                f"checkpoint balance {state['balance']!r} does not match this pipeline's "
                f"{self.balance!r}"
            )
        if not self._idle:
            self.drain()
        self._check()
        for stage, sd in zip(self.stages, state["stages"], strict=True):
            stage.load_state_dict(sd)
        for core, osd, ssd, updates, ssteps in zip(
            self._cores,
            state["optimizers"],
            state["schedulers"],
            state["updates_per_stage"],
            state["scheduler_steps"],
            strict=True,
        ):
            if core.optimizer is not None and osd is not None:
                core.optimizer.load_state_dict(osd)
            if core.scheduler is not None and ssd is not None:
                core.scheduler.load_state_dict(ssd)
            core.updates_applied = int(updates)
            core.scheduler_steps = int(ssteps)
            core.last_forward_index = core.last_backward_index = int(state["steps_fed"]) - 1
        synchronize_devices(self.devices)
        self.steps_fed = int(state["steps_fed"])
        self.samples_seen = int(state["samples_seen"])
        if bool(state["pipelined"]) != self._pipelined:
            self.set_pipelined(bool(state["pipelined"]))

    def save_checkpoint(self, path: str | Any) -> None:
        """Drain, then write :meth:`state_dict` to ``path`` atomically (tmp file + os.replace)."""
        atomic_save(self.state_dict(), path)

    def load_checkpoint(self, path: str | Any) -> None:
        """Load a file written by :meth:`save_checkpoint` (``FileNotFoundError`` names it)."""
        self.load_state_dict(load_file(path))

    # Lifetime -------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        self._stop.set()
        current = threading.current_thread()
        for t in self._threads:
            if t is not current:
                t.join(timeout=10)
        self._closed = True

    def close(self) -> None:
        """Stop and join all workers; in-flight minibatches are dropped (drain first to keep
        them). Idempotent."""
        if not self._closed:
            self._shutdown()

    def __enter__(self) -> StalePipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return (
            f"StalePipeline(balance={self.balance}, devices={[str(d) for d in self.devices]}, "
            f"pipelined={self._pipelined}, staleness={self.staleness()}, "
            f"steps_fed={self.steps_fed}, steps_applied={self.steps_applied})"
        )
