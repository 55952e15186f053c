"""``echopipe train``: DALI input with data echoing feeding a stale-weight pipelined model.

One run goes like this:

1. The data: ``--data`` (an ImageNet-layout folder with ``train/`` and ``val/``) or, by default,
   the synthetic ImageNet-style JPEG set from :func:`echopipe.data.ensure_synthetic_imagenet`,
   generated once and cached.
2. The input: :func:`echopipe.dali.imagenet_train_pipeline` reads and decodes JPEGs (upstream),
   stores each sample in the native echo cache, and draws ``e`` copies of it downstream for
   augmentation; :class:`echopipe.dali.EchoIterator` hands out torch tensors and counts fresh
   versus echoed samples. Validation uses :func:`echopipe.dali.imagenet_val_pipeline`.
3. The model: a flat ``nn.Sequential`` from :func:`echopipe.models.build_model` split into
   stages by :class:`echopipe.pipeline.StalePipeline` (one thread per stage; GPUs when present,
   otherwise CPU stages), trained with PPL-SGD: every stage updates right after its own
   backward, with no flush between minibatches.
4. Under ``torchrun``, each process runs a replica of the whole pipeline on its own data shard,
   and each stage averages its gradients with the same stage of the other replicas before its
   update (one process group per stage, so stage threads never share a communicator).
5. Every epoch ends with a drain, validation, a metrics row, plots and a checkpoint.

Timing the echo factor (``--echo auto``): ``t_up`` is the upstream time per fresh batch
(reading, decoding and the simulated read delay, timed by the echo pipeline around each upstream
iteration and scaled to the downstream batch size:
:meth:`echopipe.dali.EchoPipeline.upstream_step_seconds`) and ``t_down`` is the trainer's own
time per step, without the time it spent waiting for data.
:class:`echopipe.adaptive.EchoController` sets ``e`` close to ``R = t_up / t_down``. A new factor
is applied every ``--echo-interval`` steps and at epoch ends (all replicas agree on rank 0's
choice there; the rest of the epoch is re-planned for the fresh samples it still owes) with
:meth:`echopipe.dali.EchoPipeline.set_echo_factor`: the running cache changes ``e`` in place, so
no input pipeline is rebuilt and no cached sample is dropped (``_TrainInput.set_factor``;
``input_builds`` in the metrics counts builds). The LR schedule follows epochs done
(``_EpochClock``), so its length does not depend on ``e``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from .adaptive import EchoController
from .train_io import CheckpointManager, write_metrics, write_plots

__all__ = [
    "DistContext",
    "TrainConfig",
    "TrainSummary",
    "default_devices",
    "format_summary",
    "train",
]

EchoInsert = Literal["after_decode", "after_augment"]
EchoMode = Literal["example", "batch"]


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Everything ``echopipe train`` needs; the CLI options map one to one onto these fields.

    ``None`` for ``data`` means the cached synthetic set; ``None`` for ``stages``/``devices``
    means: one stage per GPU when there are two or more, two stages on the only GPU when there is
    one, otherwise two CPU stages.
    """

    data: Path | None = None
    model: str = "resnet_small"
    image_size: int = 64
    epochs: int = 8
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup_epochs: float = 0.5
    workers: int = 1
    decode: Literal["cpu", "mixed"] = "cpu"
    seed: int = 0
    synthetic_classes: int = 10
    synthetic_per_class: int = 100
    echo: float | Literal["auto"] = 2.0
    echo_max: float = 4.0
    echo_interval: int = 50
    echo_insert: EchoInsert = "after_decode"
    echo_mode: EchoMode = "example"
    shuffle_buffer: int | None = None
    read_delay_ms: float = 0.0
    dist_timeout_s: float = 600.0
    stages: int | None = None
    balance: list[int] | Literal["auto"] | None = None
    devices: list[str] | None = None
    hybrid_switch: int | None = None
    amp: bool = False
    checkpoint_dir: Path | None = None  # None: <output folder>/checkpoints
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    resume: bool | Path = False
    output: Path = Path("echopipe-train/metrics.json")
    progress: bool = True

    def validate(self) -> None:
        """Raise ``ValueError``/``FileNotFoundError`` naming the first bad value."""
        if self.data is not None:
            if not Path(self.data).is_dir():
                what = "is not a folder" if Path(self.data).exists() else "does not exist"
                raise FileNotFoundError(f"--data {str(self.data)!r} {what}")
            if not (Path(self.data) / "train").is_dir():
                raise FileNotFoundError(
                    f"--data {str(self.data)!r} has no train/ folder (ImageNet layout expected: "
                    "train/<class>/*.JPEG and val/<class>/*.JPEG)"
                )
            if not (Path(self.data) / "val").is_dir():
                raise FileNotFoundError(f"--data {str(self.data)!r} has no val/ folder")
        from .models import MODEL_NAMES

        if self.model not in MODEL_NAMES:
            raise ValueError(f"--model {self.model!r} is unknown; choose from {list(MODEL_NAMES)}")
        for name in ("image_size", "epochs", "batch_size", "workers", "keep_checkpoints",
                     "echo_interval"):  # fmt: skip
            _positive_int(name, getattr(self, name))
        for name in ("synthetic_classes", "synthetic_per_class"):
            _positive_int(name, getattr(self, name), minimum=2 if "classes" in name else 1)
        if self.image_size < 16:
            raise ValueError(f"--image-size must be >= 16, got {self.image_size}")
        _finite("lr", self.lr, positive=True)
        _finite("momentum", self.momentum)
        _finite("weight_decay", self.weight_decay)
        _finite("warmup_epochs", self.warmup_epochs)
        _finite("read_delay_ms", self.read_delay_ms)
        _finite("dist_timeout_s", self.dist_timeout_s, positive=True)
        _finite("echo_max", self.echo_max)
        if self.echo_max < 1:
            raise ValueError(f"--echo-max must be >= 1, got {self.echo_max:g}")
        if self.echo != "auto":
            if not isinstance(self.echo, int | float) or not math.isfinite(self.echo):
                raise ValueError(f"--echo must be a number >= 1 or 'auto', got {self.echo!r}")
            if self.echo < 1:
                raise ValueError(f"--echo must be >= 1 (e < 1 would drop data), got {self.echo:g}")
        if self.echo_insert not in ("after_decode", "after_augment"):
            raise ValueError(f"--echo-insert {self.echo_insert!r} is not one of after_decode, "
                             "after_augment")  # fmt: skip
        if self.echo_mode not in ("example", "batch"):
            raise ValueError(f"--echo-mode {self.echo_mode!r} is not one of example, batch")
        if self.shuffle_buffer is not None:
            _positive_int("shuffle_buffer", self.shuffle_buffer, minimum=0)
        if self.stages is not None:
            _positive_int("stages", self.stages)
        if self.hybrid_switch is not None:
            _positive_int("hybrid_switch", self.hybrid_switch, minimum=0)
        _positive_int("checkpoint_every", self.checkpoint_every, minimum=0)
        if isinstance(self.balance, list):
            if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.balance):
                raise ValueError(f"--balance entries must be ints >= 1, got {self.balance}")
            if self.stages is not None and len(self.balance) != self.stages:
                raise ValueError(
                    f"--balance {self.balance} has {len(self.balance)} stages but --stages is "
                    f"{self.stages}"
                )
        elif self.balance not in (None, "auto"):
            raise ValueError(f"--balance must be a list of ints or 'auto', got {self.balance!r}")
        if self.devices is not None:
            from .pipeline import parse_devices

            parse_devices(list(self.devices), len(self.devices))
            if self.stages is not None and len(self.devices) not in (1, self.stages):
                raise ValueError(
                    f"--devices {','.join(self.devices)} gives {len(self.devices)} devices for "
                    f"{self.stages} stages; give one device, or one per stage"
                )
        if self.decode not in ("cpu", "mixed"):
            raise ValueError(f"--decode {self.decode!r} is not one of cpu, mixed")
        if self.decode == "mixed":
            if self.devices is not None and not any(d.startswith("cuda") for d in self.devices):
                raise ValueError(
                    f"--decode mixed decodes on a GPU, but --devices {','.join(self.devices)} "
                    "has none"
                )
            if self.devices is None and not torch.cuda.is_available():
                raise ValueError("--decode mixed decodes on a GPU, but torch sees no CUDA device")
        if isinstance(self.resume, Path) and not self.resume.is_file():
            raise FileNotFoundError(f"--resume checkpoint {str(self.resume)!r} does not exist")


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{flag} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{flag} must be >= {minimum}, got {value}")
    return value


def _finite(name: str, value: object, positive: bool = False) -> float:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{flag} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{flag} must be {'> 0' if positive else '>= 0'}, got {value:g}")
    return float(value)


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


# --------------------------------------------------------------------------------------------
# torch.distributed (torchrun)
# --------------------------------------------------------------------------------------------


@dataclass
class DistContext:
    """This process's place among the data-parallel replicas (``world_size == 1`` alone)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    timeout_s: float = 600.0
    stage_groups: list[Any] = field(default_factory=list)

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

        NCCL when this process has a GPU, Gloo otherwise. A collective that waits longer than
        ``timeout_s`` for another rank fails (and torchrun stops the job) instead of hanging.
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if backend == "nccl":
            # This process's first GPU in default_devices' sharing of the machine's GPUs.
            torch.cuda.set_device(torch.device(default_devices(None)[1][0]))
        if not dist.is_initialized():
            # Gradients and BatchNorm buffers (CUDA tensors) go over NCCL; the small control
            # messages (epoch lengths, counters, rank 0's echo factor, CPU tensors and objects)
            # over Gloo, which a pure NCCL group would reject, and which keeps them off the GPU
            # while the stage threads run their own NCCL all-reduces.
            spec = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
            dist.init_process_group(backend=spec, timeout=datetime.timedelta(seconds=timeout_s))
        return cls(dist.get_rank(), dist.get_world_size(), local, backend, timeout_s)

    def make_stage_groups(self, num_stages: int) -> None:
        """One process group per stage (every rank creates all of them, in the same order)."""
        if not self.enabled:
            return
        import torch.distributed as dist

        ranks = list(range(self.world_size))
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.stage_groups = [dist.new_group(ranks, timeout=timeout) for _ in range(num_stages)]

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Sum of ``values`` over ranks (identity when alone)."""
        if not self.enabled:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def all_reduce_min(self, value: int) -> int:
        """Minimum of ``value`` over ranks."""
        if not self.enabled:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        """Leave the process group (only if this module joined it)."""
        if self.enabled:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _all_reduce_grads(
    ctx: DistContext,
) -> Callable[[int, list[nn.Parameter], list[torch.Tensor | None]], None] | None:
    """``StalePipeline`` grad hook that averages each stage's gradients over the replicas.

    The pipeline calls it in stage ``k``'s worker thread after each backward, right before the
    stage's optimizer step; stage ``k`` uses its own process group, so stage threads never share
    a communicator. One flat buffer per update; a parameter without a gradient contributes zeros
    (every replica must send the same buffer).
    """
    if not ctx.enabled:
        return None
    import torch.distributed as dist

    world = float(ctx.world_size)

    def hook(stage: int, params: list[nn.Parameter], grads: list[torch.Tensor | None]) -> None:
        if not params:
            return
        filled = [
            g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params, strict=True)
        ]
        flat = torch.cat([g.reshape(-1) for g in filled])
        dist.all_reduce(flat, group=ctx.stage_groups[stage])
        flat.div_(world)
        offset = 0
        for i, g in enumerate(filled):
            n = g.numel()
            grads[i] = flat[offset : offset + n].view_as(g)
            offset += n

    return hook


# --------------------------------------------------------------------------------------------
# Model pieces
# --------------------------------------------------------------------------------------------


class _Autocast(nn.Module):
    """Runs the wrapped block under ``torch.autocast`` in bfloat16 (``--amp``).

    Autocast state is per thread, and every pipeline stage runs in its own thread, so the
    wrapper enters it inside each block's forward rather than around the training loop.
    bfloat16 keeps float32's exponent range, so no loss scaling is needed per stage.
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The block's own device: with --devices cpu,cuda:0 each stage autocasts its own way.
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            out = self.block(x)
        return out.float() if out.is_floating_point() else out


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


class _StageClock:
    """Downstream seconds per step: ``3 x`` the slowest stage's mean training forward time.

    ``train_step`` returns as soon as the minibatch is queued, so the caller cannot see how long
    the stages compute; forward hooks on each stage module (they run in the stage's thread)
    time its forward, and backward is taken as twice the forward, the usual ratio for conv
    nets. The slowest stage sets the pipeline's pace. On a GPU the forward only queues kernels,
    so it is timed with CUDA events on the stage's stream, read once they have completed.
    """

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        self.seconds = [0.0] * len(stages)
        self.calls = [0] * len(stages)
        self._starts: dict[tuple[int, int], Any] = {}
        # Per stage: (start, end) CUDA events not read yet. Appended by the stage's thread,
        # drained by the training loop (deque appends and pops are atomic).
        self._pending: list[collections.deque[tuple[Any, Any]]] = [
            collections.deque() for _ in stages
        ]
        import threading

        self._ident = threading.get_ident
        for k, stage in enumerate(stages):
            stage.register_forward_pre_hook(self._pre(k))
            stage.register_forward_hook(self._post(k))

    @staticmethod
    def _on_gpu(args: Any) -> bool:
        return bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_cuda

    def _pre(self, k: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if not module.training:
                return
            if self._on_gpu(args):
                start = torch.cuda.Event(enable_timing=True)
                start.record()  # on the stage thread's current stream
                self._starts[(k, self._ident())] = start
            else:
                self._starts[(k, self._ident())] = time.perf_counter()

        return hook

    def _post(self, k: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            t0 = self._starts.pop((k, self._ident()), None)
            if isinstance(t0, torch.cuda.Event):
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._pending[k].append((t0, end))
            elif t0 is not None:
                self.seconds[k] += time.perf_counter() - t0
                self.calls[k] += 1

        return hook

    def step_seconds(self) -> float | None:
        """Estimated seconds per training step, or ``None`` before every stage ran once."""
        for k, pending in enumerate(self._pending):
            while pending and pending[0][1].query():
                start, end = pending.popleft()
                self.seconds[k] += start.elapsed_time(end) / 1000.0
                self.calls[k] += 1
        if min(self.calls) == 0:
            return None
        return 3.0 * max(s / c for s, c in zip(self.seconds, self.calls, strict=True))


class _TrainInput:
    """The echoing DALI training input of one replica.

    A new echo factor takes effect through :meth:`set_factor` (at a decision step), which
    changes the running cache's ``e`` in place (no rebuild).
    """

    def __init__(self, cfg: TrainConfig, data_dir: Path, ctx: DistContext, device_id: int | None):
        self.cfg = cfg
        self.data_dir = data_dir
        self.ctx = ctx
        self.device_id = device_id
        self.iterator: Any = None
        self.pipe: Any = None
        self.factor = 0.0
        self.builds = 0
        # Counters of earlier pipelines (rebuilds and resumed runs), added to the live one's.
        self.base = {"fresh": 0, "echoed": 0, "samples": 0, "up_s": 0.0, "up_iters": 0}

    def build(self, factor: float, steps_per_epoch: int | None, state: Any = None) -> None:
        from .dali import EchoIterator, imagenet_train_pipeline

        self.close()
        cfg = self.cfg
        self.pipe = imagenet_train_pipeline(
            self.data_dir,
            batch_size=cfg.batch_size,
            image_size=cfg.image_size,
            echo_factor=factor,
            echo_insert=cfg.echo_insert,
            echo_mode=cfg.echo_mode,
            shuffle_buffer=cfg.shuffle_buffer,
            read_delay_ms=cfg.read_delay_ms,
            shard_id=self.ctx.rank,
            num_shards=self.ctx.world_size,
            # The same seed on resume: DALI's checkpoint restores the reader's position in the
            # file order that this seed permutes, so the resumed epoch goes on where it stopped.
            seed=cfg.seed + 104729 * self.ctx.rank,
            decode_device=cfg.decode,
            device_id=self.device_id,
            num_threads=cfg.workers,
            enable_checkpointing=True,
        )
        self.iterator = EchoIterator(self.pipe, ["data", "label"], steps_per_epoch=steps_per_epoch)
        if state is not None:
            self.iterator.load_state_dict(state)
        self.factor = factor
        self.builds += 1

    def set_factor(self, factor: float) -> None:
        """Use echo factor ``factor`` for fresh samples cached from now on.

        The running cache changes ``e`` in place: samples already cached keep their tickets, so
        nothing is dropped or rebuilt. Called at a step where all replicas agree on the factor;
        the caller re-plans the epoch's length.
        """
        self.pipe.set_echo_factor(factor)
        self.factor = factor

    def natural_steps(self) -> int:
        """Steps of one epoch for this shard at the current factor (resets a fixed length)."""
        self.iterator.set_epoch_size()  # back to the reader's shard size
        return self.iterator.steps_per_epoch

    def set_steps(self, steps: int) -> None:
        """Fix the epoch length (all replicas must run the same number of steps)."""
        self.iterator.steps_per_epoch = steps

    def counters(self) -> dict[str, float]:
        s = self.iterator.stats if self.iterator is not None else None
        batches, seconds = self.pipe.upstream_time() if self.pipe is not None else (0, 0.0)
        return {
            "fresh": self.base["fresh"] + (s.fresh if s else 0),
            "echoed": self.base["echoed"] + (s.echoed if s else 0),
            "samples": self.base["samples"] + (s.samples if s else 0),
            "up_s": self.base["up_s"] + seconds,
            "up_iters": self.base["up_iters"] + batches,
        }

    def upstream_step_seconds(self) -> float | None:
        """``t_up`` of the live pipeline: upstream seconds per downstream batch of fresh
        samples (mean since it was built; restored with a checkpoint), or ``None`` before any."""
        t_up = self.pipe.upstream_step_seconds()
        return None if math.isnan(t_up) else t_up

    def state_dict(self) -> dict[str, Any]:
        return self.iterator.state_dict()

    def close(self) -> None:
        """Close the live pipeline; its counters are kept in ``base``."""
        if self.iterator is not None:
            self.base = self.counters()  # type: ignore[assignment]
            with contextlib.suppress(Exception):
                self.iterator.close()
        self.iterator = self.pipe = None


def _evaluate(pipeline: Any, cfg: TrainConfig, data_dir: Path, ctx: DistContext,
              device_id: int | None, val_iter: list[Any]) -> tuple[float, float, int]:  # fmt: skip
    """``(top1, mean loss, images)`` over this rank's validation shard, summed over ranks."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    from .dali import imagenet_val_pipeline

    if not val_iter:
        pipe = imagenet_val_pipeline(
            data_dir,
            batch_size=min(cfg.batch_size * 4, 256),
            image_size=cfg.image_size,
            decode_device=cfg.decode,
            shard_id=ctx.rank,
            num_shards=ctx.world_size,
            num_threads=cfg.workers,
            device_id=device_id,
        )
        pipe.build()
        val_iter.append(
            DALIGenericIterator(
                [pipe],
                ["data", "label"],
                reader_name=pipe.reader_name,
                last_batch_policy=LastBatchPolicy.PARTIAL,
                auto_reset=True,
            )
        )
    correct = 0.0
    loss_sum = 0.0
    count = 0
    for batch in val_iter[0]:
        x = batch[0]["data"]
        y = batch[0]["label"].reshape(-1).long()
        logits = pipeline.evaluate(x).float()
        correct += float((logits.argmax(1) == y.cpu()).sum())
        loss_sum += float(nn.functional.cross_entropy(logits, y.cpu(), reduction="sum"))
        count += int(y.numel())
    correct, loss_sum, total = ctx.all_reduce_sum([correct, loss_sum, float(count)])
    return correct / max(total, 1.0), loss_sum / max(total, 1.0), int(total)


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------


@dataclass
class TrainSummary:
    """What a finished run reports (also the ``summary`` block of the metrics JSON)."""

    top1: float
    best_top1: float
    epochs: int
    steps: int
    images_per_s: float
    fresh_samples: int
    echoed_samples: int
    t_up_ms: float
    t_down_ms: float
    ratio: float
    echo_factor: float
    echo_factors_used: list[float]
    staleness: list[int]
    balance: list[int]
    devices: list[str]
    world_size: int
    checkpoints_written: int
    wall_s: float
    metrics_path: str | None
    plots: list[str]

    def as_dict(self) -> dict[str, Any]:
        """The summary as plain JSON-able values."""
        return dataclasses.asdict(self)


def format_summary(s: TrainSummary) -> str:
    """The human-readable summary block printed at the end of ``echopipe train``."""
    total = s.fresh_samples + s.echoed_samples
    used = ", ".join(f"{e:g}" for e in s.echo_factors_used)
    lines = [
        "echopipe train: summary",
        f"  top-1 (val)         {100 * s.top1:.1f} %  (best {100 * s.best_top1:.1f} %)",
        f"  images/s (train)    {s.images_per_s:.0f}  ({s.steps} steps, {s.epochs} epochs, "
        f"{s.wall_s:.1f} s, {s.world_size} replica(s))",
        f"  samples             {total} = {s.fresh_samples} fresh + {s.echoed_samples} echoed "
        f"(realised echo {total / s.fresh_samples if s.fresh_samples else float('nan'):.2f}x)",
        f"  t_up / t_down       {s.t_up_ms:.1f} ms / {s.t_down_ms:.1f} ms per step  "
        f"(R = {s.ratio:.2f})",
        f"  echo factor         {s.echo_factor:g}  (used: {used})",
        f"  stages              balance {s.balance} on {', '.join(s.devices)}; staleness per "
        f"stage {s.staleness}",
        f"  checkpoints written {s.checkpoints_written}",
    ]
    if s.metrics_path:
        lines.append(f"  metrics             {s.metrics_path}")
    for p in s.plots:
        lines.append(f"  plot                {p}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


class _EpochClock:
    """Epochs of training done after a given number of steps, for the LR schedule.

    With ``--echo auto`` the steps per epoch change with the echo factor, also within an epoch,
    so a schedule counted in steps would end early or late. The training loop starts a segment
    whenever the epoch length is (re)planned: from step ``first`` on, each step adds ``rate``
    epochs. Stage threads read it while the loop appends to it.
    """

    def __init__(self, segments: list[tuple[int, float, float]] | None = None) -> None:
        self.segments: list[tuple[int, float, float]] = list(segments or [])

    def plan(self, step: int, epochs_done: float, steps_left: int, epoch_end: float) -> None:
        """From ``step`` on, ``steps_left`` steps take the run from ``epochs_done`` to
        ``epoch_end`` epochs."""
        rate = max(epoch_end - epochs_done, 0.0) / max(steps_left, 1)
        self.segments.append((step, epochs_done, rate))

    def epochs_at(self, step: int) -> float:
        """Epochs done once ``step`` steps have run (0 before the first planned segment)."""
        # reversed() reads the length once, and list appends are atomic: no copy is needed
        # while the training loop plans a new segment.
        for first, done, rate in reversed(self.segments):
            if step >= first:
                return done + (step - first) * rate
        return 0.0


def _lr_factor(epochs_next: float, epochs_now: float, warmup_epochs: float, epochs: int) -> float:
    """Linear warm-up over ``warmup_epochs``, then cosine decay to 2 % at ``epochs``.

    ``epochs_next`` is the progress once the coming update is applied (warm-up never starts at
    zero), ``epochs_now`` the progress before it.
    """
    if warmup_epochs > 0 and epochs_next <= warmup_epochs:
        return epochs_next / warmup_epochs
    span = max(epochs - warmup_epochs, 1e-9)
    progress = min(1.0, max(0.0, (epochs_now - warmup_epochs) / span))
    return 0.02 + 0.98 * 0.5 * (1.0 + math.cos(math.pi * progress))


class _Progress:
    """tqdm bars for epochs and steps (rank 0 only; silent when disabled)."""

    def __init__(self, enabled: bool, epochs: int, start_epoch: int) -> None:
        self.enabled = enabled
        self.epoch_bar: Any = None
        self.step_bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._tqdm = tqdm
            self.epoch_bar = tqdm(
                total=epochs, initial=start_epoch, desc="epochs", unit="ep", position=0,
                dynamic_ncols=True, file=sys.stderr,
            )  # fmt: skip

    def start_epoch(self, epoch: int, steps: int, done: int) -> None:
        if self.enabled:
            self.step_bar = self._tqdm(
                total=steps, initial=done, desc=f"epoch {epoch + 1}", unit="step", position=1,
                leave=False, dynamic_ncols=True, file=sys.stderr,
            )  # fmt: skip

    def step(self, images_per_s: float, echo_ratio: float, loss: float | None, e: float) -> None:
        if self.enabled and self.step_bar is not None:
            post = {"img/s": f"{images_per_s:.0f}", "echo": f"{echo_ratio:.2f}x", "e": f"{e:g}"}
            if loss is not None:
                post["loss"] = f"{loss:.3f}"
            self.step_bar.set_postfix(post, refresh=False)
            self.step_bar.update(1)

    def set_total(self, steps: int) -> None:
        """The epoch was re-planned (``--echo auto`` changed e within it)."""
        if self.enabled and self.step_bar is not None:
            self.step_bar.total = steps
            self.step_bar.refresh()

    def end_epoch(self, top1: float) -> None:
        if self.enabled:
            if self.step_bar is not None:
                self.step_bar.close()
            self.epoch_bar.set_postfix({"val top-1": f"{100 * top1:.1f}%"})
            self.epoch_bar.update(1)

    def close(self) -> None:
        if self.enabled:
            if self.step_bar is not None:
                self.step_bar.close()
            self.epoch_bar.close()


def train(cfg: TrainConfig, *, log: Callable[[str], None] | None = None) -> TrainSummary:
    """Run ``echopipe train`` with ``cfg`` and return its summary.

    Writes the metrics JSON and plots (rank 0) and checkpoints (every rank, into its own
    folder when there are several). Raises ``ValueError``/``FileNotFoundError`` for bad settings
    before anything heavy starts.
    """
    cfg.validate()
    ctx = DistContext.from_env(cfg.dist_timeout_s)
    try:
        return _train(cfg, ctx, log or (lambda m: print(m, file=sys.stderr, flush=True)))
    finally:
        ctx.close()


def _train(cfg: TrainConfig, ctx: DistContext, log: Callable[[str], None]) -> TrainSummary:
    from .models import build_model
    from .pipeline import StalePipeline

    wall0 = time.perf_counter()
    say = log if ctx.is_main else (lambda m: None)

    # ---- data ---------------------------------------------------------------------------
    if cfg.data is None:
        from .data import ensure_synthetic_imagenet

        t0 = time.perf_counter()
        data_dir = ensure_synthetic_imagenet(
            classes=cfg.synthetic_classes, per_class=cfg.synthetic_per_class
        )
        say(f"data: synthetic set {data_dir} ({time.perf_counter() - t0:.1f} s)")
    else:
        data_dir = Path(cfg.data)
    classes = sorted(p.name for p in (data_dir / "train").iterdir() if p.is_dir())
    if len(classes) < 2:
        raise ValueError(f"--data {str(data_dir)!r}: train/ has {len(classes)} class folder(s)")

    # ---- checkpoints to resume from -------------------------------------------------------
    implicit = cfg.checkpoint_dir is None
    ckpt_root = Path(cfg.output).parent / "checkpoints" if implicit else Path(cfg.checkpoint_dir)
    ckpt_dir = ckpt_root / f"rank{ctx.rank}" if ctx.enabled else ckpt_root
    manager = CheckpointManager(ckpt_dir, keep=cfg.keep_checkpoints)
    state: dict[str, Any] | None = None
    if not cfg.resume and manager.list():
        # Never delete another run's files: the user says whether to continue it.
        flag = "--output" if implicit else "--checkpoint-dir"
        where = Path(cfg.output).parent if implicit else ckpt_root
        raise FileExistsError(
            f"{flag} {str(where)!r} holds checkpoints of an earlier run ({ckpt_dir}): pass "
            f"--resume to continue it, or choose another {flag}"
        )
    if cfg.resume:
        path = cfg.resume if isinstance(cfg.resume, Path) else None
        if path is None:
            # Only this run folder's own checkpoints, and only one that passes its checks.
            path = manager.latest()
            if path is None:
                raise FileNotFoundError(f"--resume: no checkpoint in {str(ckpt_dir)!r}")
        state = CheckpointManager.load(path)
        say(f"resume: {path} (step {state['global_step']}, epoch {state['epoch']})")

    # ---- model and pipeline ---------------------------------------------------------------
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)
    stages, devices = default_devices(cfg.stages)
    if cfg.devices is not None:
        devices = list(cfg.devices) * (stages if len(cfg.devices) == 1 else 1)
        stages = len(devices)
    if isinstance(cfg.balance, list):
        stages = len(cfg.balance)
        if len(devices) != stages:
            devices = [devices[i % len(devices)] for i in range(stages)]
    model = build_model(cfg.model, num_classes=len(classes))
    if stages > len(model):
        raise ValueError(f"--stages {stages}: {cfg.model} has only {len(model)} blocks")
    if cfg.amp:
        model = nn.Sequential(*[_Autocast(b) for b in model])
    if state is not None:
        balance: list[int] | Literal["auto"] = list(state["pipeline"]["balance"])
    elif isinstance(cfg.balance, list):
        balance = list(cfg.balance)
    else:
        balance = "auto"
    if balance == "auto":
        from .pipeline import partition_balance

        sample = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size)
        balance = partition_balance(model, sample, stages, devices)
        # Timing-based: every replica must use rank 0's choice.
        balance = ctx.broadcast_object(balance)
    ctx.make_stage_groups(stages)
    # DALI runs on the first GPU among the stages' devices (stage 0's, when it has one).
    device_id = next((torch.device(d).index or 0 for d in devices if d.startswith("cuda")), None)

    base_optimizer = _sgd_factory(cfg)

    # ---- input ----------------------------------------------------------------------------
    controller: EchoController | None = None
    if cfg.echo == "auto":
        controller = EchoController(1.0, e_max=cfg.echo_max)
        if state is not None:
            controller.load_state_dict(state["controller"])
    factor = float(state["echo_factor"]) if state is not None else (
        controller.factor if controller is not None else float(cfg.echo))  # fmt: skip
    data = _TrainInput(cfg, data_dir, ctx, device_id)
    if state is not None:
        data.builds = int(state["input_builds"])
        data.base = dict(state["input_counters"])
    data.build(factor, None, state["input"] if state is not None else None)
    links = data.pipe.folder_index.links_skipped
    if links:
        first, why = links[0]
        say(f"data: {len(links)} symbolic link(s) left out of train/ (e.g. {first}: {why})")
    steps_per_epoch = (
        int(state["steps_per_epoch"]) if state is not None
        else ctx.all_reduce_min(data.natural_steps())
    )  # fmt: skip
    data.set_steps(steps_per_epoch)
    # The LR follows epochs of training done, not steps: their number per epoch moves with e.
    # ``epoch_fresh``: fresh samples this epoch has taken so far (batch / e per step), to
    # re-plan its remaining steps when --echo auto changes e within it. (A checkpoint from
    # before DALI's checkpoints were kept was already refused by data.build above.)
    if state is not None:
        clock = _EpochClock(state["epoch_clock"])
        epoch_fresh = float(state["epoch_fresh"])
    else:
        clock = _EpochClock()
        clock.plan(0, 0.0, steps_per_epoch, 1.0)
        epoch_fresh = 0.0

    def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        def factor(updates: int) -> float:
            return _lr_factor(
                clock.epochs_at(updates + 1), clock.epochs_at(updates), cfg.warmup_epochs,
                cfg.epochs,
            )  # fmt: skip

        return torch.optim.lr_scheduler.LambdaLR(opt, factor)

    pipeline = StalePipeline(
        model,
        optimizer=base_optimizer,
        grad_hook=_all_reduce_grads(ctx),
        scheduler=scheduler,
        scheduler_interval="step",
        loss_fn=nn.CrossEntropyLoss(),
        balance=balance,
        devices=devices,
    )
    stage_clock = _StageClock(pipeline.stages)
    rows: list[dict[str, Any]] = []
    epoch = 0
    global_step = 0
    step_in_epoch = 0
    checkpoints_before = 0
    wall_before = 0.0
    train_time = 0.0
    samples_trained = 0
    step_time_total = 0.0
    step_count_timed = 0
    factors_used: list[float] = [factor]
    if state is not None:
        pipeline.load_state_dict(state["pipeline"])
        _set_rng_state(state["rng"])
        rows = list(state["rows"])
        epoch = int(state["epoch"])
        global_step = int(state["global_step"])
        step_in_epoch = int(state["step_in_epoch"])
        checkpoints_before = int(state["checkpoints_written"])
        wall_before = float(state["wall_s"])
        train_time = float(state["train_time"])
        samples_trained = int(state["samples_trained"])
        step_time_total = float(state["step_time_total"])
        step_count_timed = int(state["step_count_timed"])
        factors_used = list(state["factors_used"])

    say(
        f"train: {cfg.model} on {len(classes)} classes, {stages} stage(s) balance {balance} "
        f"on {', '.join(devices)}, staleness {pipeline.staleness()}, {ctx.world_size} "
        f"replica(s); echo {cfg.echo if cfg.echo == 'auto' else f'{factor:g}'} "
        f"({cfg.echo_insert}, {cfg.echo_mode}); {steps_per_epoch} steps/epoch of "
        f"{cfg.batch_size}"
    )

    def save_checkpoint() -> None:
        # state_dict() drains the pipeline first: no minibatch is in flight in a checkpoint.
        payload = {
            "kind": "echopipe-train",
            "config": {k: str(v) for k, v in dataclasses.asdict(cfg).items()},
            "pipeline": pipeline.state_dict(),
            "input": data.state_dict(),
            "input_builds": data.builds,
            "input_counters": data.base,
            "echo_factor": data.factor,
            "controller": controller.state_dict() if controller is not None else None,
            "rng": _rng_state(),
            "rows": rows,
            "epoch": epoch,
            "global_step": global_step,
            "step_in_epoch": step_in_epoch,
            "steps_per_epoch": steps_per_epoch,
            "checkpoints_written": checkpoints_before + manager.written + 1,
            "wall_s": wall_before + time.perf_counter() - wall0,
            "train_time": train_time,
            "samples_trained": samples_trained,
            "step_time_total": step_time_total,
            "step_count_timed": step_count_timed,
            "factors_used": factors_used,
            "world_size": ctx.world_size,
            "epoch_clock": list(clock.segments),
            "epoch_fresh": epoch_fresh,
        }
        manager.save(payload, global_step)

    if state is not None and state["world_size"] != ctx.world_size:
        raise ValueError(
            f"--resume: the checkpoint was written by {state['world_size']} replica(s), this "
            f"run has {ctx.world_size}"
        )

    progress = _Progress(cfg.progress and ctx.is_main, cfg.epochs, epoch)
    val_iter: list[Any] = []
    output = Path(cfg.output)
    plots: list[str] = []
    last_loss: float | None = None
    try:
        while epoch < cfg.epochs:
            if cfg.hybrid_switch is not None and epoch >= cfg.hybrid_switch and pipeline.pipelined:
                pipeline.set_pipelined(False)
                say(f"hybrid: synchronous from epoch {epoch + 1} (staleness now 0)")
            progress.start_epoch(epoch, steps_per_epoch, step_in_epoch)
            if step_in_epoch == 0 and clock.segments[-1][0] != global_step:
                clock.plan(global_step, float(epoch), steps_per_epoch, float(epoch + 1))
            epoch_t0 = time.perf_counter()
            epoch_samples = 0
            losses: list[float] = []
            fresh0 = data.counters()
            it = data.iterator
            while step_in_epoch < steps_per_epoch:
                batch = next(it)[0]
                x, y = batch["data"], batch["label"].reshape(-1).long()
                result = pipeline.train_step(x, y)
                losses.extend(result.losses)
                global_step += 1
                step_in_epoch += 1
                epoch_fresh += cfg.batch_size / data.factor
                epoch_samples += int(x.shape[0])
                busy = stage_clock.step_seconds()
                if busy is not None:
                    step_time_total += busy
                    step_count_timed += 1
                if losses:
                    last_loss = losses[-1]
                if controller is not None and busy is not None:
                    t_up = data.upstream_step_seconds()
                    if t_up is not None:
                        controller.observe(t_up, busy, global_step)
                if (
                    controller is not None
                    and global_step % cfg.echo_interval == 0
                    and step_in_epoch < steps_per_epoch
                ):
                    # Every replica reaches this step: rank 0's decision is broadcast, and the
                    # rest of the epoch is re-planned for the fresh samples it still owes.
                    wanted = ctx.broadcast_object(controller.factor)
                    if wanted != data.factor:
                        fresh_left = max(data.iterator.shard_size - epoch_fresh, 0.0)
                        left = max(1, math.ceil(fresh_left * wanted / cfg.batch_size))
                        left = ctx.all_reduce_min(left)
                        data.set_factor(wanted)
                        steps_per_epoch = step_in_epoch + left
                        data.set_steps(steps_per_epoch)
                        clock.plan(global_step, clock.epochs_at(global_step), left,
                                   float(epoch + 1))  # fmt: skip
                        progress.set_total(steps_per_epoch)
                        factors_used.append(wanted)
                        say(
                            f"echo: factor {wanted:g} from step {global_step} (epoch "
                            f"{epoch + 1}, {left} steps left in it; R = {controller.ratio:.2f})"
                        )
                if cfg.checkpoint_every and (
                    global_step % cfg.checkpoint_every == 0 and step_in_epoch < steps_per_epoch
                ):
                    save_checkpoint()
                elapsed = time.perf_counter() - epoch_t0
                c = data.counters()
                total = c["samples"] - fresh0["samples"]
                fresh = c["fresh"] - fresh0["fresh"]
                progress.step(
                    epoch_samples / max(elapsed, 1e-9),
                    total / fresh if fresh else float("nan"),
                    last_loss,
                    data.factor,
                )
            pipeline.drain()
            _average_buffers(model, ctx)
            epoch_time = time.perf_counter() - epoch_t0
            train_time += epoch_time
            samples_trained += epoch_samples
            top1, val_loss, val_n = _evaluate(pipeline, cfg, data_dir, ctx, device_id, val_iter)
            epoch += 1
            step_in_epoch = 0
            epoch_fresh = 0.0
            c = data.counters()
            fresh_all, echoed_all, up_s, up_n = ctx.all_reduce_sum(
                [c["fresh"], c["echoed"], c["up_s"], c["up_iters"]]
            )
            t_down = step_time_total / max(step_count_timed, 1)
            t_up = up_s / up_n if up_n else math.nan
            lr = pipeline.optimizers[0].param_groups[0]["lr"] if pipeline.optimizers[0] else 0.0
            row = {
                "epoch": epoch,
                "step": global_step,
                "wall_s": wall_before + time.perf_counter() - wall0,
                "train_loss": float(np.mean(losses)) if losses else None,
                "val_top1": top1,
                "val_loss": val_loss,
                "val_images": val_n,
                "fresh_samples": int(fresh_all),
                "echoed_samples": int(echoed_all),
                "images_per_s": ctx.world_size * epoch_samples / max(epoch_time, 1e-9),
                "echo_factor": data.factor,
                "input_builds": data.builds,
                "echo_ratio": (fresh_all + echoed_all) / fresh_all if fresh_all else None,
                "t_up_ms": 1000 * t_up,
                "t_down_ms": 1000 * t_down,
                "R": t_up / t_down if t_down > 0 else None,
                "pipelined": pipeline.pipelined,
                "lr": lr,
            }
            rows.append(row)
            progress.end_epoch(top1)
            if not cfg.progress:
                loss_text = "n/a" if row["train_loss"] is None else f"{row['train_loss']:.3f}"
                say(
                    f"epoch {epoch}/{cfg.epochs}: val top-1 {100 * top1:.1f} %, loss "
                    f"{loss_text}, {row['images_per_s']:.0f} img/s, e={data.factor:g}"
                )
            # At the epoch end the next epoch's length follows from the factor; the running cache
            # adopts a new one in place.
            if controller is not None and epoch < cfg.epochs:
                wanted = ctx.broadcast_object(controller.factor)
                if wanted != data.factor:
                    data.set_factor(wanted)
                    factors_used.append(wanted)
                    ratio = controller.ratio
                    say(f"echo: factor {wanted:g} from epoch {epoch + 1} (R = {ratio:.2f})")
                # Also when e stayed: the epoch that ends may have been re-planned within.
                steps_per_epoch = ctx.all_reduce_min(data.natural_steps())
                data.set_steps(steps_per_epoch)
            data.iterator.reset()
            save_checkpoint()
            if ctx.is_main:
                plots = [str(p) for p in write_plots(rows, output.with_suffix(""))]
                write_metrics(output, {"config": _config_json(cfg), "epochs": rows})
    finally:
        progress.close()
        pipeline.close()
        data.close()

    c = data.counters()
    fresh_all, echoed_all, up_s, up_n = ctx.all_reduce_sum(
        [c["fresh"], c["echoed"], c["up_s"], c["up_iters"]]
    )
    t_down = step_time_total / max(step_count_timed, 1)
    t_up = up_s / up_n if up_n else math.nan
    summary = TrainSummary(
        top1=rows[-1]["val_top1"] if rows else math.nan,
        best_top1=max((r["val_top1"] for r in rows), default=math.nan),
        epochs=epoch,
        steps=global_step,
        images_per_s=ctx.world_size * samples_trained / max(train_time, 1e-9),
        fresh_samples=int(fresh_all),
        echoed_samples=int(echoed_all),
        t_up_ms=1000 * t_up,
        t_down_ms=1000 * t_down,
        ratio=t_up / t_down if t_down > 0 else math.nan,
        echo_factor=data.factor,
        echo_factors_used=factors_used,
        staleness=_stale_list(cfg, stages),
        balance=list(pipeline.balance),
        devices=[str(d) for d in pipeline.devices],
        world_size=ctx.world_size,
        checkpoints_written=checkpoints_before + manager.written,
        wall_s=wall_before + time.perf_counter() - wall0,
        metrics_path=str(output) if ctx.is_main else None,
        plots=plots,
    )
    if ctx.is_main:
        history = [dataclasses.asdict(h) for h in controller.history] if controller else []
        write_metrics(
            output,
            {
                "config": _config_json(cfg),
                "epochs": rows,
                "echo_history": history,
                "summary": summary.as_dict(),
            },
        )
    return summary


def _stale_list(cfg: TrainConfig, stages: int) -> list[int]:
    from .pipeline import stage_staleness

    # The staleness of the pipelined phase, also after a hybrid switch ended it; a run that was
    # never pipelined (--hybrid-switch 0) had none.
    return stage_staleness(stages, cfg.hybrid_switch != 0)


def _average_buffers(model: nn.Module, ctx: DistContext) -> None:
    """Average BatchNorm running statistics over the replicas (each saw only its shard)."""
    if not ctx.enabled:
        return
    import torch.distributed as dist

    for buf in model.buffers():
        if buf.is_floating_point():
            dist.all_reduce(buf)
            buf.div_(ctx.world_size)


def _sgd_factory(cfg: TrainConfig) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        decay = [p for p in params if p.ndim > 1]
        no_decay = [p for p in params if p.ndim <= 1]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=True)

    return make


def _config_json(cfg: TrainConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in dataclasses.asdict(cfg).items():
        out[k] = str(v) if isinstance(v, Path) else v
    return out
