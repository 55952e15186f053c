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
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from ..echo.controller import EchoController
from .amp import AMP_DTYPES, Autocast, LossScaler, chain_hooks
from .config import Interrupted, TrainConfig
from .decide import choose_split, measure_step_seconds
from .distributed import DistContext, all_reduce_grads, default_devices
from .echo_start import prime_echo
from .epoch import EpochLoop
from .input import TrainInput
from .progress import Progress, StepLog
from .report import TrainSummary, echo_verdict, summarize, write_run_files
from .resume import given_by_value
from .schedule import EpochClock, LrSchedule, hybrid_switch_epoch, sgd_factory
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
    cfg.validate()
    ctx = DistContext.from_env(cfg.dist_timeout_s)
    try:
        log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        trainer = Trainer(cfg, ctx, log, given_by_value(cfg) if given is None else given)
        return trainer.run()
    finally:
        ctx.close()


class Trainer(RunStart, EpochLoop):
    """One run of ``echopipe train`` (see the module notes for its phases)."""

    def __init__(
        self, cfg: TrainConfig, ctx: DistContext, log: Callable[[str], None], given: set[str]
    ) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.given = given
        self.log = log if ctx.is_main else (lambda m: None)
        self.say = self.log
        self.wall0 = time.perf_counter()
        self.run_state = RunState(world_size=ctx.world_size)
        self.decisions: list[str] = []
        self.changed: dict[str, list[Any]] = {}
        self.stopped: str | None = None
        self.saved: dict[str, Any] | None = None
        self.losses: list[float] = []
        self.paused_s = 0.0
        self.step_log: StepLog | None = None
        self.epoch_times: list[float] = []
        self.configured = False  # config.json written: the run has started
        self._val: list[Any] = []  # the validation iterator, built on first use
        self._open: list[Any] = []  # what close() must close, in order

    # ---- phases --------------------------------------------------------------------------

    def run(self) -> TrainSummary:
        """All phases; whatever was opened is closed, also on an error. A start refused before
        ``config.json`` was written leaves nothing behind."""
        try:
            try:
                self.prepare()
                if self.finished is not None:
                    return self.finished_summary()
                self.setup()
            except BaseException:
                if self.folder is not None and not self.configured:
                    self.folder.discard()
                raise
            while self.run_state.epoch < self.cfg.epochs and self.stopped is None:
                self.run_epoch()
                self.end_epoch()
        except KeyboardInterrupt:
            step = self.run_state.global_step if self.configured else None
            raise Interrupted(self.interrupted_line(step)) from None
        except Exception as exc:
            named = self._named_rank(exc)
            if named is exc:
                raise
            raise named from None
        finally:
            for thing in reversed(self._open):
                thing.close()
            if self.folder is not None:
                self.folder.release()
        return self.finish()

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
        if cfg.amp == "fp16" and all(d == "cpu" for d in devices):
            self.say(
                "warning: --amp fp16 on the CPU is about 60x slower than --amp bf16 (the CPU "
                "has few float16 kernels); use --amp bf16 for mixed precision on the CPU"
            )
        factor = self._build_input(devices)
        model = self._model()
        if saved:
            balance = list(saved["pipeline"]["balance"])
        else:
            sample = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size)
            if not cfg.deterministic and cfg.balance == "auto":
                self.say(
                    "stages: timing the model's blocks"
                    + (", then one stage against two," if cfg.stages == "auto" else "")
                    + " on a copy of the model (a few seconds)..."
                )
            timings: dict[str, float] = {}
            balance = choose_split(cfg, model, sample, stages, devices, self.decisions, timings)
            balance = ctx.broadcast_object(balance)  # timing-based: rank 0's choice for all
            if ctx.broadcast_object(timings.get("threads")) == 1:  # one thread won the trial
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                self._open.append(_Restore(lambda: torch.set_num_threads(threads)))
            if self.controller is not None:  # --echo auto's step-0 decision
                step_s = timings.get("step_s") or measure_step_seconds(
                    model, sample, balance, devices
                )
                first = prime_echo(self.controller, self.data.pipe, step_s, self.decisions)
                self.data.set_factor(factor := ctx.broadcast_object(first))
        devices = [devices[i % len(devices)] for i in range(len(balance))]
        ctx.make_stage_groups(len(balance))
        if saved:
            self.run_state = RunState.from_state_dict(saved["run"])
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
        notes = self._continue_schedule()
        self._build_pipeline(model, balance, devices)
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
            self.write_config(resolved, notes)
            self.step_log = StepLog(self.out / "steps.csv", st.global_step if saved else None)
            self._open.append(self.step_log)
        self.configured = True

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
            # Primed in setup (step 0); one warm-up observation: only the stages' first busy
            # spans carry start-up costs. Readings scatter by ~20 % on a loaded machine: a
            # slow average, and a raise asked three times.
            kw = {"smoothing": 0.1, "raise_patience": 3}
            self.controller = EchoController(1.0, e_max=cfg.echo_max, warmup=1, **kw)
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
        schedule = self.lr_schedule
        # A plain function, not the bound method: LambdaLR saves a callable object's __dict__
        # into the checkpoint, and a checkpoint may carry no lambda state (checkpoint_schema).
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda updates: schedule.factor(updates))

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
            "options": self.cfg.as_json(),
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
        if self.step_log is not None:
            self.step_log.flush()  # every step the checkpoint holds is in steps.csv
        with signals_deferred():
            self.ckpts.save(payload, best=best)
        self.last_saved = (st.epoch, st.step_in_epoch, st.global_step)
        self.paused_s += time.perf_counter() - t0

    def _write_metrics(self, summary: TrainSummary | None = None) -> None:
        history = (
            [dataclasses.asdict(h) for h in self.controller.history] if self.controller else []
        )
        write_run_files(self.out, self.run_state.rows, history, summary)

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
