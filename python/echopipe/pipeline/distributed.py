"""One pipeline stage per rank, over torch.distributed point-to-point (Gloo on CPU, NCCL on GPU).

Launch with ``torchrun --nproc_per_node=P``. With ``P = K * R`` ranks and ``K`` stages, rank
``r`` runs stage ``r % K`` of pipeline replica ``r // K``. Activations and targets go forward
with ``isend``/``recv``, gradients go backward; each message is a small header (rank count,
dtype, shape) followed by the data, so shapes may change between minibatches (a short last
batch). With ``R > 1`` replicas, each stage all-reduces (averages) its gradients within its
data-parallel group of ``R`` ranks right before its optimizer step.

Every rank executes the same fixed operation order as :class:`~echopipe.pipeline.StalePipeline`
(see ``schedule.py``), so results equal the single-process engine's. All ranks call
:meth:`DistributedStalePipeline.train_step` once per minibatch; only stage 0 of each replica
reads ``x`` and ``target`` (others may pass ``None``); stage 0 sends the target to the last
stage. Sends are asynchronous and reaped lazily; receives block. With ``timeout_s`` set, a
receive or a send that does not complete in time raises :class:`TimeoutError` naming the peer
rank and the message (on CPU tensors, i.e. Gloo; NCCL bounds its waits with the process group's
own ``timeout``, given to ``init_process_group``). A rank that raises exits non-zero and
torchrun then stops the others. :func:`~echopipe.pipeline.init_distributed` joins the group with
a backend that works on the node (Gloo where GPUs are fewer than local ranks, NCCL with
``device_id`` otherwise).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import atomic_save, load_file
from .dist_setup import check_gpus_per_rank
from .distributed_epoch import DistributedEpochApi, agreed_auto_balance
from .engine import CHECKPOINT_FORMAT, LossFn, OptimizerFactory, SchedulerFactory, stage_optimizer
from .partition import DeviceLike, parse_devices, split_sequential
from .results import LossRecord, StepResult
from .schedule import HybridSchedule, stage_staleness
from .stage import StageCore

__all__ = ["DistributedStalePipeline"]

# Message kinds, for error messages only. Every message goes with tag 0: NCCL ignores tags, so
# each pair of ranks must post its receives in the order the peer posts the sends, and using no
# tags on Gloo either makes the tests over Gloo check that order too.
#
# Messages down the pipeline (activations, targets, evaluation) and up it (gradients, results)
# travel in two process groups. NCCL runs a pair's sends and receives of one group in posting
# order on one stream, and a send of a large tensor waits for its receive: stage k sending
# activations down while stage k + 1 sends gradients up, each then receiving, would wait on each
# other (NCCL asks for such a send and receive to be grouped, but here the receive's size comes
# from a header the receiver must read first, so it cannot join the group). With one group per
# direction, each pair's stream carries one direction only: every send meets a receive posted
# in the same order, and no wait crosses another.
_TAG_ACT = 1
_TAG_GRAD = 2
TAG_TARGET = 3
TAG_EVAL = 4
_P2P_TAG = 0
_TAG_NAMES = {
    _TAG_ACT: "activations",
    _TAG_GRAD: "gradients",
    TAG_TARGET: "targets",
    TAG_EVAL: "evaluation activations",
}
_MAX_DIMS = 8
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


class DistributedStalePipeline(DistributedEpochApi):
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
        timeout_s: longest wait, in seconds, for one message to or from a neighbouring rank
            before :class:`TimeoutError` (``None``: wait as long as the process group allows).
            Applies to CPU tensors (Gloo); on NCCL the process group's timeout bounds waits.
        num_stages, sample_input, balance_cost, balance_cache: for ``balance="auto"``, as for
            :class:`~echopipe.pipeline.StalePipeline`.

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
    ) -> None:
        if timeout_s is not None and (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, int | float)
            or not math.isfinite(timeout_s)
            or timeout_s <= 0
        ):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
        self._timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistributedStalePipeline needs torch.distributed initialised "
                "(launch with torchrun and call torch.distributed.init_process_group)"
            )
        if isinstance(balance, str):
            if balance != "auto":
                raise ValueError(f"balance must be a list of ints or 'auto', got {balance!r}")
            balance = agreed_auto_balance(
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
        self.num_replicas = self.world_size // self.num_stages
        self.stage_index = self.rank % self.num_stages
        self.replica = self.rank // self.num_stages
        backend = str(dist.get_backend())
        if device is None:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            device = f"cuda:{local}" if backend == "nccl" else "cpu"
        (self.device,) = parse_devices([device], 1)
        if self.device.type == "cuda" and "nccl" in backend:
            check_gpus_per_rank()  # two ranks on one GPU: one clear line, not an NCCL error
        self.balance = [len(s) for s in stages]
        self.stage = stages[self.stage_index].to(self.device)
        self.stage.train()
        self.hybrid = hybrid
        self._pipelined = bool(pipelined) and not (
            hybrid is not None and hybrid.pipelined_steps == 0
        )
        self.recompute = bool(recompute)

        # Every rank must create every group, in the same order.
        everyone = list(range(self.world_size))
        self._down_group: Any = dist.new_group(everyone)
        self._up_group: Any = dist.new_group(everyone)
        self._dp_group: Any = None
        if self.num_replicas > 1:
            for k in range(self.num_stages):
                ranks = [rep * self.num_stages + k for rep in range(self.num_replicas)]
                group = dist.new_group(ranks)
                if k == self.stage_index:
                    self._dp_group = group

        params = [p for p in self.stage.parameters() if p.requires_grad]
        opt = stage_optimizer(optimizer, params)
        sched = scheduler(opt) if (scheduler is not None and opt is not None) else None
        last = self.stage_index == self.num_stages - 1
        self._core = StageCore(
            self.stage_index, self.num_stages, self.stage, self.device, opt, sched,
            scheduler_interval, loss_fn if last else None, self.recompute,
            grad_hook=self._all_reduce if self.num_replicas > 1 else None,
        )  # fmt: skip
        self._core.staleness = stage_staleness(self.num_stages, self._pipelined)[self.stage_index]
        self._base = self.replica * self.num_stages
        self._prev = self.rank - 1 if self.stage_index > 0 else None
        self._next = self.rank + 1 if not last else None
        self._last_rank = self._base + self.num_stages - 1
        self._pending_sends: deque[tuple[Any, tuple[torch.Tensor, torch.Tensor, int, int]]] = (
            deque()
        )
        self._inputs: deque[tuple[torch.Tensor, torch.Tensor]] = deque()
        self._losses: list[LossRecord] = []
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
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (the one that computes losses)."""
        return self.stage_index == self.num_stages - 1

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

    # Messaging -----------------------------------------------------------------------------
    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        if self.device.type == "cuda" and not tensor.is_cuda:
            tensor = tensor.to(self.device)
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"cannot send a tensor with {tensor.dim()} > {_MAX_DIMS} dims")
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"cannot send dtype {tensor.dtype}")
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
        header[0] = tensor.dim()
        header[1] = _DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        header = header.to(tensor.device)
        group = self._group_of(self.rank, dst)
        works = [
            dist.isend(header, dst, group=group, tag=_P2P_TAG),
            dist.isend(tensor, dst, group=group, tag=_P2P_TAG),
        ]
        for work in works:
            # The tensors stay referenced until the send completes.
            self._pending_sends.append((work, (header, tensor, dst, tag)))
        self._reap_sends()

    def _recv(self, src: int, tag: int) -> torch.Tensor:
        header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        group = self._group_of(src, self.rank)
        self._wait(dist.irecv(header, src, group=group, tag=_P2P_TAG), "receive", src, tag)
        values = header.tolist()
        ndim, dtype = int(values[0]), _DTYPES[int(values[1])]
        shape = [int(v) for v in values[2 : 2 + ndim]]
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        self._wait(dist.irecv(tensor, src, group=group, tag=_P2P_TAG), "receive", src, tag)
        return tensor

    def _group_of(self, sender: int, receiver: int) -> Any:
        """The group a message from ``sender`` to ``receiver`` travels in: down the pipeline
        (to a later stage) or up it."""
        return self._down_group if sender < receiver else self._up_group

    def _wait(self, work: Any, what: str, peer: int, tag: int) -> None:
        """Waits for one point-to-point operation, bounded by ``timeout_s`` on CPU (Gloo)."""
        if self._timeout is None or self.device.type != "cpu":
            work.wait()
            return
        try:
            work.wait(timeout=self._timeout)
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise
            message = _TAG_NAMES.get(tag, f"tag {tag}")
            role = f"stage {(peer - self._base) % self.num_stages}"
            raise TimeoutError(
                f"rank {self.rank} (stage {self.stage_index}) waited more than "
                f"{self._timeout.total_seconds():g} s to {what} {message} "
                f"{'from' if what == 'receive' else 'to'} rank {peer} ({role}); is that rank "
                "alive and calling the same methods in the same order?"
            ) from exc

    def _reap_sends(self, wait_all: bool = False) -> None:
        while self._pending_sends:
            work, (_, _, dst, tag) = self._pending_sends[0]
            if wait_all:
                self._wait(work, "send", dst, tag)
            elif not work.is_completed():
                return
            self._pending_sends.popleft()

    def _all_reduce(self, grads: list[torch.Tensor | None]) -> None:
        filled = [
            g if g is not None else torch.zeros_like(p)
            for g, p in zip(grads, self._core.params, strict=True)
        ]
        if not filled:
            return
        flat = torch.cat([g.reshape(-1) for g in filled])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._dp_group)
        flat.div_(self.num_replicas)
        offset = 0
        for i, g in enumerate(filled):
            n = g.numel()
            grads[i] = flat[offset : offset + n].view_as(g)
            offset += n

    # Schedule ------------------------------------------------------------------------------
    def _forward_one(self) -> None:
        core = self._core
        index = core.last_forward_index + 1
        target: torch.Tensor | None = None
        if self.is_first:
            x, tgt = self._inputs.popleft()
            x = x.to(self.device)
            if self.is_last:
                target = tgt.to(self.device)
            else:
                self._send(tgt, self._last_rank, TAG_TARGET)
        else:
            assert self._prev is not None
            if self.is_last:
                # Stage 0 sends the target before its activations; with two stages both go to
                # this rank, and without tags the receives must come in the same order.
                target = self._recv(self._base, TAG_TARGET)
            x = self._recv(self._prev, _TAG_ACT)
        out, loss = core.forward(index, x, target)
        if self.is_last:
            assert loss is not None
            self._losses.append(LossRecord(index, loss.detach()))
        else:
            assert self._next is not None
            self._send(out, self._next, _TAG_ACT)

    def _backward_one(self) -> None:
        core = self._core
        index = core.in_flight[0].index
        grad = None
        if not self.is_last:
            assert self._next is not None
            grad = self._recv(self._next, _TAG_GRAD)
        grad_in = core.backward(index, grad)
        if not self.is_first:
            assert self._prev is not None and grad_in is not None
            self._send(grad_in, self._prev, _TAG_GRAD)

    def _advance(self, drain: bool) -> None:
        core = self._core
        while True:
            can_forward = core.last_forward_index + 1 < self.steps_fed
            if len(core.in_flight) <= core.staleness:
                if can_forward:
                    self._forward_one()
                elif drain and core.in_flight:
                    self._backward_one()
                else:
                    return
            else:
                self._backward_one()

    # Public --------------------------------------------------------------------------------
    def train_step(
        self, x: torch.Tensor | None = None, target: torch.Tensor | None = None
    ) -> StepResult:
        """Feed one minibatch (collective: every rank calls it once per minibatch).

        Stage 0 needs ``x`` and ``target``; other ranks ignore them. Returns a
        :class:`StepResult` as :meth:`StalePipeline.train_step` does; its ``finished`` losses
        are those of the minibatches this rank finished during the call (only the last stage
        has any).
        """
        index = self.steps_fed
        if self.hybrid is not None and self._pipelined and not self.hybrid.pipelined_at(index):
            self.set_pipelined(False)
        if self.is_first:
            if x is None or target is None:
                raise ValueError("stage 0 needs x and target in train_step")
            self._inputs.append((x, target))
            self.samples_seen += int(x.shape[0])
        self.steps_fed += 1
        self._advance(drain=False)
        finished, self._losses = self._losses, []
        return StepResult(index, finished)

    def drain(self) -> list[LossRecord]:
        """Finish all in-flight minibatches on this rank (collective); returns finished losses."""
        self._advance(drain=True)
        self._reap_sends(wait_all=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        finished, self._losses = self._losses, []
        return finished

    def set_pipelined(self, pipelined: bool) -> None:
        """Drain, then switch between pipelined and synchronous mode (collective)."""
        self.drain()
        self._pipelined = bool(pipelined)
        self._core.staleness = stage_staleness(self.num_stages, self._pipelined)[self.stage_index]

    def step_schedulers(self) -> None:
        """Step this stage's scheduler after its update of the newest minibatch fed so far."""
        core = self._core
        if core.last_forward_index + 1 < self.steps_fed:
            # Not yet forwarded here: remember the minibatch index the step belongs after.
            core.pending_scheduler_steps.append(self.steps_fed - 1)
        else:
            core.schedule_scheduler_step()

    def evaluate(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """Eval-mode forward through the stages (collective; drains first).

        Stage 0 passes ``x``; the last stage returns the output on CPU, other ranks ``None``.
        """
        self.drain()
        was = self.stage.training
        self.stage.eval()
        try:
            with torch.no_grad():
                if self.is_first:
                    if x is None:
                        raise ValueError("stage 0 needs x in evaluate")
                    h = x.to(self.device)
                else:
                    assert self._prev is not None
                    h = self._recv(self._prev, TAG_EVAL)
                h = self.stage(h)
                if not self.is_last:
                    assert self._next is not None
                    self._send(h, self._next, TAG_EVAL)
                    self._reap_sends(wait_all=True)
                    return None
                return h.cpu()
        finally:
            self.stage.train(was)

    def state_dict(self) -> dict[str, Any]:
        """This rank's stage state (drains first)."""
        self.drain()
        return {
            "format": CHECKPOINT_FORMAT,
            "balance": list(self.balance),
            "stage_index": self.stage_index,
            "stage": self.stage.state_dict(),
            "optimizer": opt.state_dict() if (opt := self._core.optimizer) is not None else None,
            "scheduler": sch.state_dict() if (sch := self._core.scheduler) is not None else None,
            "updates_applied": self._core.updates_applied,
            "scheduler_steps": self._core.scheduler_steps,
            "steps_fed": self.steps_fed,
            "samples_seen": self.samples_seen,
            "pipelined": self._pipelined,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's stage from :meth:`state_dict` output."""
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError("not an echopipe pipeline checkpoint (missing or unknown 'format')")
        if list(state["balance"]) != self.balance or state["stage_index"] != self.stage_index:
            raise ValueError(
                f"checkpoint is stage {state['stage_index']} of balance {state['balance']!r}; "
                f"this rank runs stage {self.stage_index} of {self.balance!r}"
            )
        self.drain()
        self.stage.load_state_dict(state["stage"])
        if self._core.optimizer is not None and state["optimizer"] is not None:
            self._core.optimizer.load_state_dict(state["optimizer"])
        if self._core.scheduler is not None and state["scheduler"] is not None:
            self._core.scheduler.load_state_dict(state["scheduler"])
        core = self._core
        core.updates_applied = int(state["updates_applied"])
        core.scheduler_steps = int(state["scheduler_steps"])
        self.steps_fed = int(state["steps_fed"])
        self.samples_seen = int(state["samples_seen"])
        core.last_forward_index = core.last_backward_index = self.steps_fed - 1
        self._pipelined = bool(state["pipelined"])
        core.staleness = stage_staleness(self.num_stages, self._pipelined)[self.stage_index]

    def checkpoint_path(self, path: str | os.PathLike[str]) -> str:
        """The file this rank's stage uses for checkpoint ``path``: ``<path>.stage<k>``."""
        return f"{os.fspath(path)}.stage{self.stage_index}"

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Drain, then write one file per stage (replica 0 writes; collective barrier after)."""
        state = self.state_dict()
        if self.replica == 0:
            atomic_save(state, self.checkpoint_path(path))
        dist.barrier()

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load this rank's stage file written by :meth:`save_checkpoint`."""
        self.load_state_dict(load_file(self.checkpoint_path(path)))

    def close(self) -> None:
        """Wait for outstanding sends. The process group stays up (the caller owns it)."""
        with contextlib.suppress(Exception):
            self._reap_sends(wait_all=True)

    def __enter__(self) -> DistributedStalePipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
