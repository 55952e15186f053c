"""The run: ``prepare`` -> ``setup`` -> (``run_epoch`` -> ``end_epoch``)* -> ``finish``.

``prepare`` does everything cheap that can refuse the run: the run folder and its lock, the
checkpoint to resume and whether its options match, the data folder's classes and files.
``setup`` builds the input, the model and the pipeline and takes the ``auto`` decisions.
Counters live in one :class:`~.state.RunState`; the epoch loop is :mod:`.epoch`.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..echo.controller import EchoController
from .amp import AMP_DTYPES, Autocast, LossScaler, chain_hooks
from .checkpoints import RunCheckpoints
from .config import DataError, TrainConfig, UsageError
from .decide import choose_split
from .distributed import DistContext, all_reduce_grads, default_devices
from .epoch import EpochLoop
from .input import TrainInput
from .preflight import check_data, load_resume, lock_run_folder, run_folder
from .report import (
    Progress,
    TrainSummary,
    echo_verdict,
    summarize,
    write_config,
    write_run_files,
)
from .schedule import EpochClock, hybrid_switch_epoch, lr_factor, sgd_factory
from .state import RunState, get_rng_state, set_rng_state

__all__ = ["Trainer", "train"]


def train(cfg: TrainConfig, *, log: Callable[[str], None] | None = None) -> TrainSummary:
    """Run ``echopipe train`` with ``cfg`` and return its summary.

    Raises :class:`~.config.UsageError` for bad options and :class:`~.config.DataError` for
    bad data, each with one line naming the value or file, before any heavy work where it can.
    """
    cfg.validate()
    ctx = DistContext.from_env(cfg.dist_timeout_s)
    try:
        trainer = Trainer(cfg, ctx, log or (lambda m: print(m, file=sys.stderr, flush=True)))
        return trainer.run()
    finally:
        ctx.close()


class Trainer(EpochLoop):
    """One run of ``echopipe train`` (see the module notes for its phases)."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, log: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.say = log if ctx.is_main else (lambda m: None)
        self.wall0 = time.perf_counter()
        self.run_state = RunState(world_size=ctx.world_size)
        self.decisions: list[str] = []
        self.stopped: str | None = None
        self.saved: dict[str, Any] | None = None
        self.lock: Any = None
        self.losses: list[float] = []
        self.paused_s = 0.0
        self._val: list[Any] = []  # the validation iterator, built on first use
        self._open: list[Any] = []  # what close() must close, in order

    # ---- phases --------------------------------------------------------------------------

    def run(self) -> TrainSummary:
        """All phases; whatever was opened is closed, also on an error."""
        try:
            self.prepare()
            self.setup()
            while self.run_state.epoch < self.cfg.epochs and self.stopped is None:
                self.run_epoch()
                self.end_epoch()
        finally:
            for thing in reversed(self._open):
                thing.close()
            if self.lock is not None:
                self.lock.release()
        return self.finish()

    def prepare(self) -> None:
        """Run folder, lock, resume checks and the data folder: nothing heavy."""
        cfg = self.cfg
        self.out = run_folder(cfg, self.say)
        if self.ctx.is_main:
            self.lock = lock_run_folder(self.out)
        folder = self.out / "checkpoints"
        self.ckpts = RunCheckpoints(
            folder / f"rank{self.ctx.rank}" if self.ctx.enabled else folder, root=self.out
        )
        earlier = self.ckpts.existing()
        if not cfg.resume and earlier:
            raise UsageError(
                f"--output {str(self.out)!r} holds checkpoints of an earlier run "
                f"({earlier[0].name}): pass --resume to continue it, or choose another --output"
            )
        if cfg.resume:
            self.resume_path = cfg.resume if isinstance(cfg.resume, Path) else self.ckpts.last
            self.saved = load_resume(cfg, self.resume_path, self.ctx.world_size)
        self.data_dir, self.classes = check_data(cfg, self.say)
        if self.saved and self.saved["model"]["num_classes"] != len(self.classes):
            raise DataError(
                f"--resume {str(self.resume_path)!r}: the model has "
                f"{self.saved['model']['num_classes']} classes, --data has {len(self.classes)}"
            )

    def setup(self) -> None:
        """Seeds, devices, input, model, the ``auto`` decisions, the pipeline, the state."""
        cfg, ctx, saved = self.cfg, self.ctx, self.saved
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        random.seed(cfg.seed)
        if cfg.deterministic:
            was = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(True, warn_only=True)
            self._open.append(_Restore(lambda: torch.use_deterministic_algorithms(was)))
        stages, devices = self._devices()
        factor = self._build_input(devices)
        model = self._model()
        if saved:
            balance = list(saved["pipeline"]["balance"])
        else:
            sample = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size)
            balance = choose_split(cfg, model, sample, stages, devices, self.decisions)
            balance = ctx.broadcast_object(balance)  # timing-based: rank 0's choice for all
        devices = [devices[i % len(devices)] for i in range(len(balance))]
        ctx.make_stage_groups(len(balance))
        if saved:
            self.run_state = RunState.from_state_dict(saved["run"])
        else:
            self.run_state.steps_per_epoch = ctx.all_reduce_min(self.data.natural_steps())
            self.run_state.factors_used = [factor]
        st = self.run_state
        self.data.set_steps(st.steps_per_epoch)
        self.clock = EpochClock(st.epoch_clock)
        if not saved:
            self.clock.plan(0, 0.0, st.steps_per_epoch, 1.0)
        st.epoch_clock = self.clock.segments
        self._build_pipeline(model, balance, devices)
        self.progress = Progress(
            ctx.is_main, cfg.progress, cfg.log_interval, cfg.epochs, self.say, self.out / "tb"
        )
        self._open.append(self.progress)
        self.say(
            f"train: {cfg.model} on {len(self.classes)} classes, {len(balance)} stage(s) balance "
            f"{balance} on {', '.join(devices)}, staleness {self.pipeline.staleness()}, "
            f"{ctx.world_size} replica(s); echo {cfg.echo if cfg.echo == 'auto' else factor} "
            f"({cfg.echo_insert}, {cfg.echo_mode}); {st.steps_per_epoch} steps/epoch of "
            f"{cfg.batch_size}"
        )
        if ctx.is_main:
            self._write_config(balance, devices)

    def _build_input(self, devices: list[str]) -> float:
        """The echo controller and the DALI input (restored on resume); the starting factor."""
        cfg, saved = self.cfg, self.saved
        # DALI runs on the first GPU among the stages' devices.
        device_id = next(
            (torch.device(d).index or 0 for d in devices if d.startswith("cuda")), None
        )
        self.controller = None
        if cfg.echo == "auto" and cfg.deterministic:
            # The controller acts on measured times, which differ from run to run.
            self.decisions.append("echo: e = 1 (--deterministic: no timing-based choice)")
        elif cfg.echo == "auto":
            # One warm-up observation: t_down is the stages' busy time, available once each
            # stage has run a forward and a backward (step 3 of a 2-stage pipeline), and only
            # its first spans carry start-up costs. Every step at e = 1 before the first
            # decision is an input-bound step (0.5 s each at R = 6 in bench/wallclock_train.py).
            self.controller = EchoController(1.0, e_max=cfg.echo_max, warmup=1)
        if saved and self.controller is not None:
            self.controller.load_state_dict(saved["controller"])
        if saved:
            factor = float(saved["input_factor"])
        else:
            factor = 1.0 if cfg.echo == "auto" else float(cfg.echo)
        self.data = TrainInput(cfg, self.data_dir, self.ctx, device_id)
        self._open.append(self.data)
        if saved:
            self.data.builds = int(saved["input_builds"])
            self.data.base = dict(saved["input_counters"])
        self.data.build(factor, None, saved["input"] if saved else None)
        self._report_skipped()
        return factor

    def _build_pipeline(self, model: nn.Sequential, balance: list[int], devices: list[str]) -> None:
        """The stale pipeline with its optimizers, LR schedule, loss (scaled for fp16) and
        gradient averaging; restored on resume."""
        from ..pipeline import StalePipeline

        cfg, saved = self.cfg, self.saved
        self.model = model
        self.scaler = LossScaler(len(balance)) if cfg.amp == "fp16" else None
        loss_fn: Any = nn.CrossEntropyLoss()
        if self.scaler is not None:
            loss_fn = self.scaler.wrap_loss(loss_fn)
            if saved:
                self.scaler.load_state_dict(saved["amp_scaler"])
        self.pipeline = StalePipeline(
            model,
            optimizer=sgd_factory(cfg),
            # Replicas average first, so every rank sees the same overflow and scales alike.
            grad_hook=chain_hooks(
                all_reduce_grads(self.ctx), self.scaler and self.scaler.grad_hook
            ),
            scheduler=self._scheduler,
            scheduler_interval="step",
            loss_fn=loss_fn,
            balance=balance,
            devices=devices,
        )
        self._open.append(self.pipeline)
        if saved:
            self.pipeline.load_state_dict(saved["pipeline"])
            set_rng_state(saved["rng"])
            st = self.run_state
            self.say(f"resume: {self.resume_path} (step {st.global_step}, epoch {st.epoch})")

    def _devices(self) -> tuple[int, list[str]]:
        """The default stage count and one device per stage (``--devices`` or the GPUs)."""
        cfg = self.cfg
        wanted = (
            len(cfg.balance)
            if isinstance(cfg.balance, list)
            else (cfg.stages if isinstance(cfg.stages, int) else None)
        )
        stages, devices = default_devices(wanted)
        if cfg.devices is not None:
            devices = list(cfg.devices)
            stages = wanted or (len(devices) if len(devices) > 1 else stages)
        return stages, [devices[i % len(devices)] for i in range(stages)]

    def _model(self) -> nn.Sequential:
        from ..models import build_model

        model = build_model(self.cfg.model, num_classes=len(self.classes))
        if self.cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        if self.cfg.amp != "off":
            model = nn.Sequential(*[Autocast(b, AMP_DTYPES[self.cfg.amp]) for b in model])
        return model

    def _scheduler(self, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        cfg, clock = self.cfg, self.clock

        switch, restart = hybrid_switch_epoch(cfg)
        restart_at = switch if restart else None

        def factor(updates: int) -> float:
            return lr_factor(
                clock.epochs_at(updates + 1),
                clock.epochs_at(updates),
                cfg.warmup_epochs,
                cfg.epochs,
                restart_at,
            )

        return torch.optim.lr_scheduler.LambdaLR(opt, factor)

    def _report_skipped(self) -> None:
        index = self.data.pipe.folder_index
        for what, items in (
            ("symbolic link(s)", index.links_skipped),
            ("corrupt image(s)", index.skipped),
        ):
            if items:
                path, why = items[0]
                self.say(f"data: {len(items)} {what} left out of train/ (e.g. {path}: {why})")

    # ---- files ---------------------------------------------------------------------------

    def checkpoint(self, *, best: bool) -> None:
        """Write ``last.pt`` (and ``best.pt``); the pipeline drains first (nothing in flight)."""
        st = self.run_state
        t0 = time.perf_counter()
        self._drain()  # state_dict() would drain too, and drop the losses
        st.checkpoints_written += 1
        wall = st.wall_s
        st.wall_s = wall + time.perf_counter() - self.wall0
        payload = {
            "kind": "echopipe-train",
            "config": self.cfg.fixed_on_resume(),
            "model": {"name": self.cfg.model, "num_classes": len(self.classes)},
            "pipeline": self.pipeline.state_dict(),
            "input": self.data.state_dict(),
            "input_builds": self.data.builds,
            "input_counters": self.data.base,
            "input_factor": self.data.factor,
            "controller": self.controller.state_dict() if self.controller else None,
            "amp_scaler": self.scaler.state_dict() if self.scaler else None,
            "rng": get_rng_state(),
            "run": st.state_dict(),
        }
        st.wall_s = wall
        self.ckpts.save(payload, best=best)
        self.paused_s += time.perf_counter() - t0

    def _write_metrics(self, summary: TrainSummary | None = None) -> None:
        history = (
            [dataclasses.asdict(h) for h in self.controller.history] if self.controller else []
        )
        write_run_files(self.out, self.run_state.rows, history, summary)

    def _write_config(self, balance: list[int], devices: list[str]) -> None:
        resolved = {
            "balance": balance,
            "devices": devices,
            "stages": len(balance),
            "classes": self.classes,
            "data": str(self.data_dir),
        }
        write_config(self.out, self.cfg.as_json(), resolved, self.decisions)

    def finish(self) -> TrainSummary:
        """The summary (read from the run state and the last row), also into metrics.json."""
        st, ctx = self.run_state, self.ctx
        summary = summarize(
            st,
            echo_factor=self.data.factor,
            staleness=_stale_list(self.cfg, len(self.pipeline.balance)),
            balance=list(self.pipeline.balance),
            devices=[str(d) for d in self.pipeline.devices],
            wall_s=st.wall_s + time.perf_counter() - self.wall0,
            output=self.out if ctx.is_main else None,
            decisions=self.decisions + echo_verdict(st.rows, self.data.factor) + self._amp_note(),
            stopped=self.stopped,
        )
        if ctx.is_main:
            self._write_metrics(summary)
        return summary

    def _amp_note(self) -> list[str]:
        s = self.scaler
        if s is None:
            return []
        return [
            f"amp: fp16, loss scale {s.scale:g}; {s.skipped} stage update(s) skipped on a "
            "gradient overflow"
        ]


def _stale_list(cfg: TrainConfig, stages: int) -> list[int]:
    from ..pipeline import stage_staleness

    # The staleness of the pipelined phase, also after a hybrid switch ended it; a run that was
    # never pipelined (--hybrid-switch 0) had none.
    return stage_staleness(stages, hybrid_switch_epoch(cfg)[0] != 0)


class _Restore:
    """Something to undo when the run closes (a process-wide setting the run changed)."""

    def __init__(self, undo: Callable[[], None]) -> None:
        self.close = undo
