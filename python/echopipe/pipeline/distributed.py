"""One pipeline stage per rank, over torch.distributed point-to-point (Gloo on CPU, NCCL on GPU).

Launch with ``torchrun --nproc_per_node=P``. With ``P = K * R`` ranks and ``K`` stages, rank
``r`` runs stage ``r % K`` of pipeline replica ``r // K`` (``ranks.py``). Activations and
targets go forward, gradients go backward, as tensors of any shape (``p2p.py``); with ``R > 1``
replicas each stage averages its gradients over its replicas before its optimizer step.

Every rank executes the same fixed operation order as :class:`~echopipe.pipeline.StalePipeline`
(see ``schedule.py``), so results equal the single-process engine's. All ranks call
:meth:`DistributedStalePipeline.train_step` once per minibatch; only stage 0 of each replica
reads ``x`` and ``target`` (others may pass ``None``); stage 0 sends the target to the last
stage; they belong to the pipeline until stage 0 has run that minibatch's backward
(``rank_schedule.py``). With ``timeout_s`` set, a message that does not arrive in time raises
:class:`TimeoutError` naming the peer rank, as does a rank missing from what the ranks agree
on (``distributed_epoch.py``) (on Gloo; NCCL bounds its waits with the process group's own
``timeout``, given to ``init_process_group``). A rank that raises exits non-zero and
torchrun then stops the others. :func:`~echopipe.pipeline.init_distributed` joins the group with
a backend that works on the node (Gloo where GPUs are fewer than local ranks, NCCL with
``device_id`` otherwise).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from . import distributed_epoch as agree
from .build import LossFn, OptimizerFactory, SchedulerFactory, StageGradHook, check_arguments
from .checkpoint import atomic_save, load_file
from .p2p import PeerLink, link_timeout
from .partition import DeviceLike, split_sequential
from .rank_schedule import RankSchedule
from .ranks import StageTopology, rank_core, rank_device
from .results import DEFAULT_OUTPUT_MAP, EpochResult, LossRecord, StepResult, checked_batch_size
from .schedule import HybridSchedule, stage_staleness
from .stage import refuse_metric_schedulers
from .state import Progress, check_rank_state, rank_state, restore_rank

__all__ = ["DistributedStalePipeline"]


class DistributedStalePipeline:
    """Stale-weight pipeline with one stage per rank (see the module docstring).

    ``torch.distributed`` must be initialised. Every rank builds the same full model (same
    seed) and passes the same ``balance``; each keeps only its stage. The schedule, staleness,
    weight rules and BatchNorm behaviour are those of :class:`~echopipe.pipeline.StalePipeline`.

    Args:
        module: the full ``nn.Sequential`` (identical on every rank).
        balance: children per stage; ``len(balance)`` must divide the world size. ``"auto"``:
            rank 0 profiles ``sample_input`` and chooses ``num_stages`` stages
            (``partition_balance``), and every rank adopts that choice.
        optimizer, scheduler, scheduler_interval, loss_fn, recompute, pipelined, hybrid: as for
            :class:`~echopipe.pipeline.StalePipeline`.
        device: this rank's device; default ``cuda:LOCAL_RANK`` on NCCL, else CPU.
        timeout_s: longest wait, in seconds, for a message to or from a neighbouring rank,
            for the replicas' gradient average or for what the ranks agree on (an epoch's step
            count, ``step_schedulers``' metric, ``save_checkpoint``'s outcome) before
            :class:`TimeoutError` (``None``: as long as the process group allows). On CPU
            (Gloo); on NCCL the group's timeout bounds it.
        num_stages, sample_input, balance_cost, balance_cache: for ``balance="auto"``, as for
            :class:`~echopipe.pipeline.StalePipeline`.
        grad_hook: ``hook(stage, params, grads)`` before this rank's optimizer step, as for
            :class:`~echopipe.pipeline.StalePipeline` (``clip_grad_norm_`` on ``params``), run
            after the replicas' average: every replica's hook sees the same gradients.

    The calls and results are those of :class:`~echopipe.pipeline.StalePipeline`
    (``train_step`` returns a :class:`StepResult`, ``drain`` a list of :class:`LossRecord`,
    ``run_epoch``, ``accuracy``, ``steps_applied``, ``updates_per_stage``, ``optimizers``,
    ``schedulers``), except that they are collective and per-stage lists hold ``None`` for
    the stages other ranks run.
    """

    def __init__(
        self,
        module: nn.Sequential,
        *,
        balance: Sequence[int] | Literal["auto"],
        optimizer: OptimizerFactory,
        loss_fn: LossFn,
        scheduler: SchedulerFactory | None = None,
        scheduler_interval: Literal["epoch", "step"] = "epoch",
        recompute: bool = False,
        pipelined: bool = True,
        hybrid: HybridSchedule | None = None,
        device: DeviceLike | None = None,
        timeout_s: float | None = None,
        num_stages: int | None = None,
        sample_input: torch.Tensor | None = None,
        balance_cost: Literal["time", "model"] = "time",
        balance_cache: str | os.PathLike[str] | None = None,
        grad_hook: StageGradHook | None = None,
    ) -> None:
        check_arguments(
            module, optimizer, loss_fn, grad_hook, scheduler_interval, hybrid, recompute
        )
        timeout = link_timeout(timeout_s)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistributedStalePipeline needs torch.distributed initialised "
                "(launch with torchrun and call torch.distributed.init_process_group)"
            )
        if isinstance(balance, str):
            if balance != "auto":
                raise ValueError(f"balance must be a list of ints or 'auto', got {balance!r}")
            balance = agree.agreed_auto_balance(
                module, sample_input, num_stages, cost=balance_cost, cache=balance_cache
            )
        stages = split_sequential(module, balance)
        self.num_stages = len(stages)
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        if self.world_size % self.num_stages != 0:
            raise ValueError(
                f"world size {self.world_size} is not a multiple of the {self.num_stages} stages "
                f"in balance {list(balance)!r}"
            )
        self.topology = StageTopology.of(self.rank, self.world_size, self.num_stages)
        self.num_replicas = self.topology.num_replicas
        self.stage_index = self.topology.stage_index
        self.replica = self.topology.replica
        self.device = rank_device(device)
        self.balance = [len(s) for s in stages]
        self.stage = stages[self.stage_index].to(self.device)
        self.hybrid = hybrid
        self._pipelined = bool(pipelined) and not (
            hybrid is not None and hybrid.pipelined_steps == 0
        )
        self.recompute = bool(recompute)
        self._core = rank_core(
            self.topology, self.stage, self.device, optimizer, scheduler, scheduler_interval,
            loss_fn, self.recompute, grad_hook, timeout,
        )  # fmt: skip
        self._core.staleness = stage_staleness(self.num_stages, self._pipelined)[self.stage_index]
        self._link = PeerLink(self.topology, self.device, timeout)
        self._schedule = RankSchedule(self.topology, self._core, self._link, self.device)
        self.steps_fed = 0
        self.samples_seen = 0

    # Properties ----------------------------------------------------------------------------
    def staleness(self) -> list[int]:
        """Staleness ``D_k`` of every stage (``2(K-1-k)`` pipelined, 0 synchronous)."""
        return stage_staleness(self.num_stages, self._pipelined)

    @property
    def pipelined(self) -> bool:
        """Whether the pipeline currently runs in pipelined mode."""
        return self._pipelined

    @property
    def steps_applied(self) -> int:
        """Minibatches whose update this rank's stage has applied (every stage has, after a
        drain); the same name as :attr:`StalePipeline.steps_applied`."""
        return self._core.updates_applied

    @property
    def updates_per_stage(self) -> list[int | None]:
        """Updates applied per stage, as in :class:`StalePipeline`; ``None`` for the stages
        that other ranks run."""
        return self._per_stage(self._core.updates_applied)

    @property
    def is_first(self) -> bool:
        """Whether this rank runs stage 0 (the one that reads the data)."""
        return self.topology.is_first

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (the one that computes losses)."""
        return self.topology.is_last

    @property
    def optimizers(self) -> list[torch.optim.Optimizer | None]:
        """Per-stage optimizers, as in :class:`StalePipeline`: this rank's at
        ``stage_index``, ``None`` for the stages other ranks run."""
        return self._per_stage(self._core.optimizer)

    @property
    def schedulers(self) -> list[torch.optim.lr_scheduler.LRScheduler | None]:
        """Per-stage LR schedulers (``None`` for the stages other ranks run)."""
        return self._per_stage(self._core.scheduler)

    def _per_stage(self, mine: Any) -> list[Any]:
        return [mine if k == self.stage_index else None for k in range(self.num_stages)]

    # Public --------------------------------------------------------------------------------
    def train_step(
        self, x: torch.Tensor | None = None, target: torch.Tensor | None = None
    ) -> StepResult:
        """Feed one minibatch (collective: every rank calls it once per minibatch).

        Stage 0 needs ``x`` and ``target``; other ranks ignore them. Stage 0 reads both until
        it has run this minibatch's backward: one changed in place before then (a refilled
        buffer) raises :class:`PipelineError` from the call that runs it. Returns a
        :class:`StepResult` as :meth:`StalePipeline.train_step` does; its ``finished`` losses
        are those of the minibatches this rank finished during the call (only the last stage
        has any).
        """
        if self.is_first:  # checked before any message, as StalePipeline checks them
            if x is None or target is None:
                raise ValueError("stage 0 needs x and target in train_step")
            if not isinstance(x, torch.Tensor) or not isinstance(target, torch.Tensor):
                raise TypeError(
                    f"train_step needs tensors (x, target), got {type(x).__name__}, "
                    f"{type(target).__name__}"
                )
        index = self.steps_fed
        if self.hybrid is not None and self._pipelined and not self.hybrid.pipelined_at(index):
            self.set_pipelined(False)
        if self.is_first:
            assert x is not None and target is not None
            self._schedule.inputs.append((x, target))
            self.samples_seen += int(x.shape[0]) if x.dim() > 0 else 1
        self.steps_fed += 1
        self._schedule.advance(self.steps_fed, drain=False)
        return StepResult(index, self._schedule.take_losses())

    def drain(self) -> list[LossRecord]:
        """Finish all in-flight minibatches on this rank (collective); returns finished losses."""
        self._schedule.advance(self.steps_fed, drain=True)
        self._link.reap_sends(wait_all=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self._schedule.take_losses()

    def set_pipelined(self, pipelined: bool) -> None:
        """Drain, then switch between pipelined and synchronous mode (collective)."""
        self.drain()
        self._pipelined = bool(pipelined)
        self._core.staleness = stage_staleness(self.num_stages, self._pipelined)[self.stage_index]

    def step_schedulers(self, metrics: float | None = None) -> None:
        """Step this stage's scheduler after its update of the newest minibatch fed so far.

        Collective (one ``all_reduce``, bounded by ``timeout_s`` on CPU). With ``metrics``
        (``ReduceLROnPlateau``) the pipeline drains and every stage's scheduler steps on the
        last stage's value (the mean over the replicas; ranks of other stages may pass
        ``None``), see ``agreed_metric``.
        """
        core = self._core
        value = agree.agreed_metric(metrics, self.is_last, self._link)
        if value is not None:
            self.drain()
            core.step_scheduler(value)
            return
        refuse_metric_schedulers([core.scheduler])
        if core.last_forward_index + 1 < self.steps_fed:
            # Not yet forwarded here: remember the minibatch index the step belongs after.
            core.pending_scheduler_steps.append(self.steps_fed - 1)
        else:
            core.schedule_scheduler_step()

    def evaluate(self, x: torch.Tensor | None, batch_size: int | None = None) -> Any:
        """Eval-mode forward through the stages (collective; drains first), in chunks of
        ``batch_size`` rows of stage 0's ``x`` (``None``: one chunk), as
        :meth:`StalePipeline.evaluate` runs it.

        Stage 0 passes ``x``; the last stage returns the output on CPU (several heads: the same
        tuple, list or dict, each tensor concatenated over the chunks), other ranks ``None``.
        """
        size = None if batch_size is None else checked_batch_size(batch_size)
        self.drain()
        return agree.pipeline_evaluate(self.topology, self._link, self.stage, self.device, x, size)

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
        if epoch_step := step_schedulers and self._core.scheduler_interval == "epoch":
            refuse_metric_schedulers([self._core.scheduler])  # before the epoch, not after it
        start = time.perf_counter()
        count = agree.agree_steps(loader, steps, self.is_first, self._link)
        batches = loader if self.is_first else None
        samples, losses = agree.feed_steps(self.train_step, batches, count, output_map, self.rank)
        if epoch_step:
            self.step_schedulers()
        if drain:
            losses.extend(r.value for r in self.drain())
        return EpochResult(count, samples, losses, time.perf_counter() - start)

    def accuracy(
        self, x: torch.Tensor | None, target: torch.Tensor | None, batch_size: int = 512
    ) -> float:
        """Top-1 accuracy of :meth:`evaluate` (collective; drains first).

        Stage 0 passes ``x`` and ``target`` (others ``None``); every rank of the replica gets
        the same fraction in [0, 1], as :meth:`StalePipeline.accuracy` returns it.
        """
        checked_batch_size(batch_size)
        self.drain()
        topology, link = self.topology, self._link
        return agree.pipeline_accuracy(topology, link, self.evaluate, x, target, batch_size)

    # Checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's stage state (drains first)."""
        self.drain()
        progress = Progress(self.steps_fed, self.samples_seen, self._pipelined)
        return rank_state(self.balance, self.stage_index, self.stage, self._core, progress)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's stage from :meth:`state_dict` output."""
        check_rank_state(state, self.balance, self.stage_index)
        self.drain()
        progress = restore_rank(state, self.stage, self._core)
        self.steps_fed = progress.steps_fed
        self.samples_seen = progress.samples_seen
        self._pipelined = progress.pipelined
        self._core.staleness = stage_staleness(self.num_stages, self._pipelined)[self.stage_index]

    def checkpoint_path(self, path: str | os.PathLike[str]) -> str:
        """The file this rank's stage uses for checkpoint ``path``: ``<path>.stage<k>``."""
        return f"{os.fspath(path)}.stage{self.stage_index}"

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Drain, then write one file per stage (replica 0 writes; collective, bounded by
        ``timeout_s`` on CPU: when one rank's write fails, it raises its error and every other
        rank an ``OSError``)."""
        state, file = self.state_dict(), self.checkpoint_path(path)
        write = (lambda: atomic_save(state, file)) if self.replica == 0 else None
        agree.agreed_save(write, self._link)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load this rank's stage file written by :meth:`save_checkpoint`."""
        self.load_state_dict(load_file(self.checkpoint_path(path)))

    def close(self) -> None:
        """Wait for outstanding sends. The process group stays up (the caller owns it)."""
        with contextlib.suppress(Exception):
            self._link.reap_sends(wait_all=True)

    def __enter__(self) -> DistributedStalePipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
