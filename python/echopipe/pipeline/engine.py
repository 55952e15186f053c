"""Thread-per-stage engine for stale-weight pipelined backprop (PPL-SGD) in one process.

:class:`StalePipeline` is the caller's side: it builds the stages (``build.py``), feeds them
minibatches, drains, switches mode and evaluates. It holds its parts and passes them what they
need: a :class:`~echopipe.pipeline.worker.StageWorkers` runs the stage threads and their
schedule loop, ``state.py`` turns stages, cores and counters into checkpoints and back, and
the balance is a list of ints (``balance.py`` chooses one for ``balance="auto"``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from .build import (
    LossFn,
    OptimizerFactory,
    SchedulerFactory,
    StageGradHook,
    build_cores,
    check_arguments,
    resolve_balance,
)
from .checkpoint import atomic_save, load_file
from .modes import FedModes, eval_mode
from .partition import DeviceLike, parse_devices, split_sequential
from .results import (
    DEFAULT_OUTPUT_MAP,
    EpochResult,
    LossRecord,
    StepResult,
    as_class_target,
    as_logits,
    check_minibatch,
    checked_batch_size,
    concat_outputs,
    output_to_cpu,
    unpack_batch,
)
from .schedule import HybridSchedule, stage_staleness
from .stage import caller_autocast, refuse_metric_schedulers
from .state import Progress, check_pipeline_state, pipeline_state, restore_pipeline
from .stream import caller_event, synchronize_devices
from .worker import Batch, SchedulerStep, StageWorkers, divide_threads

__all__ = ["StalePipeline"]


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
            are moved to the stage devices and shared (not copied) by the stages, and train in
            the mode they are in (a BatchNorm frozen with ``.eval()`` stays frozen).
        balance: children per stage (torchgpipe convention), for instance from
            :func:`~echopipe.pipeline.balance_by_time` or
            :func:`~echopipe.pipeline.balance_by_cost`; ``"auto"`` to have
            :func:`~echopipe.pipeline.partition_balance` choose with ``sample_input``; or
            ``None`` for a single stage.
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
            The parameters' ``.grad`` already hold the gradients, so
            ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` clips this stage's in place.
            Typical use: average the gradients over data-parallel replicas of the pipeline
            (``all_reduce`` on a process group per stage). Runs for every update, in the
            stage's fixed operation order.
        max_stale_share: bound on the share of trainable parameters in the stale stages (all
            but the last): ``balance="auto"`` picks the fastest split within it, an explicit
            balance above it raises ``ValueError`` (see ``partition.stale_share``).
        balance_cost, balance_cache: make ``balance="auto"`` repeatable: ``"model"`` estimates
            each layer from FLOPs and bytes instead of timing it; a cache path stores the
            choice and reuses it (``partition_balance``'s ``cost`` and ``cache``).
        clock: host seconds for :meth:`step_seconds` on CPU stages (``time.perf_counter``);
            CUDA stages are timed by events on their streams.
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
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        check_arguments(
            module, optimizer, loss_fn, grad_hook, scheduler_interval, hybrid, recompute,
            max_prefetch,
        )  # fmt: skip
        balance = resolve_balance(
            module, balance, devices, num_stages, sample_input, max_stale_share, balance_cost,
            balance_cache,
        )  # fmt: skip
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

        self._cores = build_cores(
            self.stages, self.devices, optimizer, scheduler, scheduler_interval, loss_fn,
            self.recompute, grad_hook, stage_staleness(self.num_stages, self._pipelined),
        )  # fmt: skip
        self.steps_fed = 0
        self.samples_seen = 0
        self._idle = True  # no minibatch in flight (after construction or a drain)
        self._fed_modes = FedModes()  # read at the first minibatch after each drain
        self._workers = StageWorkers(
            self._cores, self.devices, divide_threads(self.devices, intra_op_threads),
            max_prefetch, clock,
        )  # fmt: skip

    def step_seconds(self) -> float | None:
        """Busy seconds per minibatch of the slowest stage (forward plus backward and update),
        from the work completed since the previous call; ``None`` until every stage has done
        both once. This is the pipeline's pace with an instant input (``t_down``): queue waits
        are not counted, and on CUDA it is the streams' time, not the kernel launches'."""
        return self._workers.step_seconds()

    def staleness(self) -> list[int]:
        """Per stage: how many of the newest updates its forward misses in steady state,
        ``2(K-1-k)`` for stage ``k`` of ``K`` in pipelined mode, ``0`` in synchronous mode."""
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

    # Caller side ----------------------------------------------------------------------------
    def train_step(self, x: torch.Tensor, target: torch.Tensor) -> StepResult:
        """Feed one minibatch; returns the losses of minibatches that finished meanwhile.

        Blocks only while the pipeline is full (``max_prefetch`` minibatches queued). Raises
        :class:`PipelineError` if any stage failed. The stages run this minibatch's forward
        (and loss) under the ``torch.autocast`` regions the caller has entered around the call.
        """
        self._workers.check()
        check_minibatch(x, target)
        index = self.steps_fed
        if self.hybrid is not None and self._pipelined and not self.hybrid.pipelined_at(index):
            self.set_pipelined(False)
        batch = Batch(
            index, x, target, caller_event(x), caller_event(target), caller_autocast(),
            self._fed_modes.of(self.stages), x._version, target._version,
        )  # fmt: skip
        self._workers.put(batch)
        self._idle = False
        self.steps_fed += 1
        self.samples_seen += int(x.shape[0]) if x.dim() > 0 else 1
        return StepResult(index, self._workers.collect())

    def step_schedulers(self, metrics: float | None = None) -> None:
        """Step every stage's LR scheduler once, right after its update of the newest minibatch.

        The request travels through the pipeline in order, so each stage applies it at the
        same point of its own operation sequence regardless of thread timing. With ``metrics``
        (``ReduceLROnPlateau``, which steps on a validation figure) the pipeline drains and each
        scheduler steps on it in the caller's thread.
        """
        self._workers.check()
        if metrics is not None:
            self._drain_to(self.staleness())
            for core in self._cores:
                core.step_scheduler(metrics)
            return
        refuse_metric_schedulers(core.scheduler for core in self._cores)
        self._workers.put(SchedulerStep())
        self._idle = False  # a checkpoint or evaluation drains first, so the step is in it

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
        if epoch_step := step_schedulers and self._cores[0].scheduler_interval == "epoch":
            refuse_metric_schedulers(c.scheduler for c in self._cores)  # before the epoch
        start = time.perf_counter()
        steps = samples = 0
        losses: list[float] = []
        for batch in loader:
            x, target = unpack_batch(batch, output_map)
            result = self.train_step(x, target)
            losses.extend(result.losses)
            steps += 1
            samples += int(x.shape[0])
        if epoch_step:
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
        return self._workers.collect()

    def _drain_to(self, staleness: list[int]) -> None:
        self._workers.drain_to(staleness)
        self._idle = True
        self._fed_modes.forget()

    def set_pipelined(self, pipelined: bool) -> None:
        """Switch between pipelined and synchronous mode after draining in-flight work."""
        self._drain_to(stage_staleness(self.num_stages, pipelined))
        self._pipelined = bool(pipelined)

    def evaluate(self, x: torch.Tensor, batch_size: int | None = None) -> Any:
        """Eval-mode forward of ``x`` through all stages (drains first); logits on CPU.

        Normalisation layers use their running statistics. The pipeline stays usable. A
        model whose last stage returns a tuple, list or dict of tensors gets the same
        structure back, each tensor on the CPU and concatenated over the chunks.
        """
        if not self._idle:  # the losses it finishes stay for the next train_step or drain
            self._drain_to(self.staleness())
        self._workers.check()
        outputs: list[torch.Tensor] = []
        chunks = [x] if batch_size is None else list(torch.split(x, checked_batch_size(batch_size)))
        with torch.no_grad(), eval_mode(self.stages):
            for chunk in chunks:
                h = chunk
                for stage, device in zip(self.stages, self.devices, strict=True):
                    h = stage(h.to(device))
                outputs.append(output_to_cpu(h))
        return concat_outputs(outputs) if outputs else torch.empty(0)

    def accuracy(self, x: torch.Tensor, target: torch.Tensor, batch_size: int = 512) -> float:
        """Top-1 accuracy (fraction in [0, 1]) of :meth:`evaluate` on ``x`` against ``target``."""
        logits = as_logits(self.evaluate(x, batch_size))
        hits = logits.argmax(dim=1) == as_class_target(target.cpu())  # (N, 1) labels too
        return float(hits.double().mean().item())

    # Checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: weights, optimizers, schedulers, counters, mode.

        Drains first (the checkpoint policy): no minibatch is in flight in a checkpoint, so
        resuming continues exactly as an uninterrupted run that drained at the same step.
        """
        if not self._idle:  # the losses it finishes stay for the next train_step or drain
            self._drain_to(self.staleness())
        self._workers.check()
        progress = Progress(self.steps_fed, self.samples_seen, self._pipelined)
        return pipeline_state(self.balance, self.stages, self._cores, progress, self.recompute)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the balance must match this pipeline's."""
        check_pipeline_state(state, self.balance)
        if not self._idle:
            self.drain()
        self._workers.check()
        progress = restore_pipeline(state, self.stages, self._cores, self.devices)
        self.steps_fed = progress.steps_fed
        self.samples_seen = progress.samples_seen
        if progress.pipelined != self._pipelined:
            self.set_pipelined(progress.pipelined)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Drain, then write :meth:`state_dict` to ``path`` atomically (tmp file + os.replace)."""
        atomic_save(self.state_dict(), path)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load a file written by :meth:`save_checkpoint` (``FileNotFoundError`` names it)."""
        self.load_state_dict(load_file(path))

    # Lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop and join all workers; in-flight minibatches are dropped (drain first to keep
        them). Idempotent."""
        if not self._workers.closed:
            self._workers.shutdown()

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
