"""The run: ``prepare`` -> ``setup`` -> (``run_epoch`` -> ``end_epoch``)* -> ``finish``.

``prepare`` does everything cheap that can refuse the run: the run folder and its lock, the
checkpoint to resume and whether its options match, the data folder's classes and files.
``setup`` builds the input, the model and the pipeline and takes the ``auto`` decisions.
Counters live in one :class:`~.state.RunState`; the epoch loop is :mod:`.epoch`.
"""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from ..echo.controller import AUTO_HEADROOM, AUTO_WARMUP, EchoController
from .amp import AMP_DTYPES, Autocast, LossScaler, chain_hooks, scaler_note
from .config import Interrupted, TrainConfig
from .decide import choose_balance
from .distributed import DistContext, all_reduce_grads, stage_devices
from .echo_start import start_factor
from .epoch import EpochLoop
from .fill import fill_report, wait_for_fill
from .input import TrainInput
from .preflight import say_left_out
from .progress import Progress, StepLog, to_stderr
from .refusal import end_if_refused
from .report import TrainSummary, echo_verdict, summarize, write_run_files
from .resume import given_by_value
from .schedule import EpochClock, LrSchedule, hybrid_switch_epoch, sgd_factory, stage_staleness_of
from .start import RunStart, say_through, signals_deferred
from .state import RunState, get_rng_state, set_rng_state

__all__ = ["Trainer", "train"]


def train(
    cfg: TrainConfig,
    *,
    log: Callable[[str], None] | None = None,
    given: set[str] | None = None,
) -> TrainSummary:
    """Run ``echopipe train`` with ``cfg`` and return its summary.

    ``given`` names the options the caller set (the CLI's flags); on a resume the others are
    the checkpoint's. Without it, the options that differ from their defaults count as given.

    Raises :class:`~.config.UsageError` for bad options and :class:`~.config.DataError` for
    bad data, each with one line naming the value or file, before any heavy work where it can;
    :class:`~.config.Interrupted` on Ctrl-C, saying what ``--resume`` would continue from.
    """
    cfg.validate(combination=not cfg.resume)  # a resume's: once merged with its checkpoint
    end_if_refused(cfg.dist_timeout_s)  # a restarted torchrun attempt of a refused resume
    ctx = DistContext.from_env(cfg.dist_timeout_s)
    try:
        log = log or to_stderr
        trainer = Trainer(cfg, ctx, log, given_by_value(cfg) if given is None else given)
        return trainer.run()
    finally:
        ctx.close()


class Trainer:
    """One run of ``echopipe train`` (see the module notes for its phases).

    It holds its parts, each given its inputs: the :class:`~.start.RunStart` (run folder,
    resume, options), then what ``setup`` builds (input, model, pipeline), and the
    :class:`~.epoch.EpochLoop` that trains on the one :class:`~.state.RunState`.
    """

    def __init__(
        self, cfg: TrainConfig, ctx: DistContext, log: Callable[[str], None], given: set[str]
    ) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.log = log if ctx.is_main else (lambda m: None)
        self.say = self.log
        self.wall0 = time.perf_counter()
        self.start = RunStart(cfg, ctx, given, self.log)
        self.run_state = RunState(world_size=ctx.world_size)
        self.decisions: list[str] = []
        self.loop: EpochLoop | None = None
        self.step_log: StepLog | None = None
        self.configured = False  # config.json written: the run has started
        self._open: list[Any] = []  # what close() must close, in order

    # ---- phases --------------------------------------------------------------------------

    def run(self) -> TrainSummary:
        """All phases; whatever was opened is closed, also on an error. A start refused before
        ``config.json`` was written leaves nothing behind."""
        start = self.start
        try:
            try:
                start.prepare()
                if start.finished is not None:
                    finished = start.finished_summary()
                    if self.ctx.is_main:
                        start.complete_run_files(finished)
                    return finished
                self.cfg, self.saved, self.out = start.cfg, start.saved, start.out
                self.data_dir, self.classes = start.data_dir, start.classes
                self.loop = self.setup()
                start.settle()
            except BaseException:
                if start.folder is not None and not self.configured:
                    start.folder.discard()
                raise
            while self.run_state.epoch < self.cfg.epochs and self.loop.stopped is None:
                self.loop.run_epoch()
                self.loop.end_epoch()
            # Inside the try: Ctrl-C or SIGTERM while the summary is written is an interrupt at
            # this step too, with its --resume line.
            return self.finish(self.loop.stopped)
        except KeyboardInterrupt:
            step = self.run_state.global_step if self.configured else None
            raise Interrupted(start.interrupted_line(step)) from None
        except Exception as exc:
            named = start.explained(exc, self.run_state.global_step, self.configured)
            if named is exc:
                raise
            raise named from None
        finally:
            # Closed whole, and a Ctrl-C or SIGTERM meanwhile dropped: it would skip the closes
            # after it (a daemon stage thread left in torch code aborts the process at exit)
            # and replace the stop's own line, or the summary of a run that has finished.
            with signals_deferred(resend=False):
                for thing in reversed(self._open):
                    thing.close()
                if start.folder is not None:
                    start.folder.release()

    def setup(self) -> EpochLoop:
        """Seeds, devices, input, model, the ``auto`` decisions, the pipeline, the state; the
        epoch loop given them."""
        cfg, ctx, saved = self.cfg, self.ctx, self.saved
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        random.seed(cfg.seed)
        if cfg.deterministic:
            was = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(True, warn_only=True)
            self._open.append(_Restore(lambda: torch.use_deterministic_algorithms(was)))
        stages, devices = stage_devices(cfg.balance, cfg.stages, cfg.devices)
        if cfg.amp == "fp16" and all(d == "cpu" for d in devices):
            self.say(
                "warning: --amp fp16 on the CPU is about 60x slower than --amp bf16 (the CPU "
                "has few float16 kernels); use --amp bf16 for mixed precision on the CPU"
            )
        factor = self._build_input(devices)
        model = self._model()
        timings: dict[str, float] = {}
        # Waits for the first steps' input (auto's timings, the fill), counted as later ones are.
        input_wait_s = 0.0
        if saved:
            balance = list(saved["pipeline"]["balance"])
        else:
            balance = choose_balance(cfg, ctx, model, stages, devices, self.decisions, self.say,
                                     timings)  # fmt: skip
            if ctx.broadcast_object(timings.get("threads")) == 1:  # one thread won the trial
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                self._open.append(_Restore(lambda: torch.set_num_threads(threads)))
            if self.controller is not None:  # --echo auto's step-0 decision
                report = fill_report(cfg, ctx, self.say)
                t0 = time.perf_counter()
                factor = start_factor(cfg, ctx, self.controller, self.data, model, balance,
                                      devices, timings, self.decisions, report)  # fmt: skip
                input_wait_s = time.perf_counter() - t0
        devices = [devices[i % len(devices)] for i in range(len(balance))]
        ctx.make_stage_groups(len(balance))
        if saved:
            self.run_state = RunState.from_state_dict(saved["run"])
            if self.start.fresh_input:  # an epoch's end over a changed train/: a new length
                self.run_state.steps_per_epoch = ctx.all_reduce_min(self.data.natural_steps())
        else:
            self.run_state.steps_per_epoch = ctx.all_reduce_min(self.data.natural_steps())
            self.run_state.factors_used = [factor]
            self.run_state.run_id = ctx.broadcast_object(uuid.uuid4().hex)
            self.run_state.schedule_epochs = cfg.epochs
        st = self.run_state
        self.data.set_steps(st.steps_per_epoch)
        self.clock = EpochClock(st.epoch_clock)
        if not saved:
            self.clock.plan(0, 0.0, st.steps_per_epoch, 1.0)
        st.epoch_clock = self.clock.segments
        self.lr_schedule = LrSchedule(cfg, self.clock, st)
        notes = self.start.continue_schedule(st, self.clock, self.lr_schedule)
        self._build_pipeline(model, balance, devices)
        self._announce(factor, balance, devices, notes)
        self.configured = True
        t0 = time.perf_counter()
        wait_for_fill(self.data.pipe, fill_report(cfg, ctx, self.say))  # said, not silent
        input_wait_s += time.perf_counter() - t0
        return EpochLoop(
            cfg=cfg,
            ctx=ctx,
            run_state=st,
            data=self.data,
            data_dir=self.start.indexes["val"],
            pipeline=self.pipeline,
            model=self.model,
            clock=self.clock,
            lr_schedule=self.lr_schedule,
            progress=self.progress,
            step_log=self.step_log,
            controller=self.controller,
            say=self.say,
            wall0=self.wall0,
            input_wait_s=input_wait_s,
            save=self.save_checkpoint,
            write_metrics=self._write_metrics,
        )

    def _announce(
        self, factor: float, balance: list[int], devices: list[str], notes: list[str]
    ) -> None:
        """The progress display, the run's first line, ``config.json`` and ``steps.csv``."""
        cfg, ctx, st = self.cfg, self.ctx, self.run_state
        self.progress = Progress(
            ctx.is_main, cfg.progress, cfg.log_interval, cfg.epochs, self.log, self.out / "tb"
        )
        self._open.append(self.progress)
        self.say = say_through(self.progress, self.log) if ctx.is_main else self.say
        echo = f"echo {cfg.echo if cfg.echo == 'auto' else factor} ({cfg.echo_insert}, " + (
            f"{cfg.echo_mode})"
        )
        per_epoch = f"an epoch is {st.steps_per_epoch} steps of {cfg.batch_size} at e = {factor:g}"
        if cfg.echo == "auto":
            per_epoch += " (their number follows e: one pass over the fresh data)"
        self.say(
            f"train: {cfg.model} on {len(self.classes)} classes, {len(balance)} stage(s) balance "
            f"{balance} on {', '.join(devices)}, staleness {self.pipeline.staleness()}, "
            f"{ctx.world_size} replica(s); {echo}; {per_epoch}; run folder {self.out}"
        )
        if ctx.is_main:
            resolved = {
                "balance": balance,
                "devices": devices,
                "stages": len(balance),
                "classes": self.classes,
                "data": str(self.data_dir),
            }
            self.start.write_config(st, resolved, self.decisions, notes)
            self.step_log = StepLog(
                self.out / "steps.csv", st.global_step if self.saved else None, self.say
            )
            self._open.append(self.step_log)

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
            # Primed in setup (step 0). Readings scatter by ~20 % on a loaded machine: a slow
            # average and a raise asked three times.
            kw = {"smoothing": 0.1, "raise_patience": 3, "headroom": AUTO_HEADROOM}
            self.controller = EchoController(1.0, e_max=cfg.echo_max, warmup=AUTO_WARMUP, **kw)
        if saved and self.controller is not None:
            self.controller.load_state_dict(saved["controller"])
        factor = float(saved["input_factor"] if saved else 1.0 if cfg.echo == "auto" else cfg.echo)
        self.data = TrainInput(cfg, self.start.indexes["train"], self.ctx, device_id)
        self._open.append(self.data)
        if saved:
            self.data.builds = int(saved["input_builds"])
            self.data.base = dict(saved["input_counters"])
            if self.start.fresh_input:  # the saved pipeline's counters, as its close would
                self.data.count_in(saved["input"])
        self.data.build(factor, None, self.start.input_state())
        self.start.left_out[:0] = say_left_out(self.data.pipe.folder_index, "train", self.say)
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
            pipelined=hybrid_switch_epoch(cfg)[0] != 0,  # --hybrid-switch 0: never stale
        )
        self._open.append(self.pipeline)
        if saved:
            self.pipeline.load_state_dict(saved["pipeline"])
            set_rng_state(saved["rng"])
            st = self.run_state
            where = f"step {st.global_step}, {st.resume_position()}"
            self.say(f"resume: {self.start.resume_path} ({where})")

    def _model(self) -> nn.Sequential:
        from ..models import build_model

        model = build_model(self.cfg.model, num_classes=len(self.classes))
        if self.cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        if self.cfg.amp != "off":
            model = nn.Sequential(*[Autocast(b, AMP_DTYPES[self.cfg.amp]) for b in model])
        return model

    def _scheduler(self, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        schedule = self.lr_schedule
        # A plain function, not the bound method: LambdaLR saves a callable object's __dict__
        # into the checkpoint, and a checkpoint may carry no lambda state (checkpoint_schema).
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda updates: schedule.factor(updates))

    # ---- files ---------------------------------------------------------------------------

    def save_checkpoint(self, *, best: bool) -> None:
        """Write ``last.pt`` (and ``best.pt``); the epoch loop has drained the pipeline."""
        st = self.run_state
        st.checkpoints_written += 1
        wall = st.wall_s
        st.wall_s = wall + time.perf_counter() - self.wall0
        payload = {
            "kind": "echopipe-train",
            "config": self.cfg.fixed_on_resume(),
            "options": self.cfg.as_json(),
            "model": {"name": self.cfg.model, "num_classes": len(self.classes)},
            "pipeline": self.pipeline.state_dict(),
            "input": self.data.state_dict(),
            "train_files": self.start.file_list,
            "input_builds": self.data.builds,
            "input_counters": self.data.base,
            "input_factor": self.data.factor,
            "controller": self.controller.state_dict() if self.controller else None,
            "amp_scaler": self.scaler.state_dict() if self.scaler else None,
            "rng": get_rng_state(),
            "run": st.state_dict(),
        }
        st.wall_s = wall
        if self.step_log is not None:
            self.step_log.flush()  # every step the checkpoint holds is in steps.csv
        with signals_deferred():  # (a stop held back names this checkpoint, so set it inside)
            # Set once last.pt is in place: a stop, or a best.pt that fails, names that step.
            self.start.ckpts.save(payload, best=best, on_last=lambda: self.start.mark_saved(st))

    def _write_metrics(self, summary: TrainSummary | None = None) -> None:
        history = (
            [dataclasses.asdict(h) for h in self.controller.history] if self.controller else []
        )
        write_run_files(self.out, self.run_state.rows, history, summary)

    def finish(self, stopped: str | None) -> TrainSummary:
        """The summary (read from the run state and the last row), also into metrics.json;
        ``stopped`` says why the run stopped early (None: it trained all its epochs)."""
        st, ctx = self.run_state, self.ctx
        notes = echo_verdict(st.rows, self.data.factor) + scaler_note(self.scaler)
        summary = summarize(
            st,
            echo_factor=self.data.factor,
            staleness=stage_staleness_of(self.cfg, len(self.pipeline.balance)),
            balance=list(self.pipeline.balance),
            devices=[str(d) for d in self.pipeline.devices],
            wall_s=st.wall_s + time.perf_counter() - self.wall0,
            output=self.out if ctx.is_main else None,
            decisions=self.decisions + notes,
            stopped=stopped,
            left_out=self.start.left_out,
        )
        if ctx.is_main:
            self._write_metrics(summary)
        return summary


class _Restore:
    """Something to undo when the run closes (a process-wide setting the run changed)."""

    def __init__(self, undo: Callable[[], None]) -> None:
        self.close = undo
