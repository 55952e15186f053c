"""One epoch of the run: steps, the echo factor's retuning, validation and the epoch's row.

:class:`EpochLoop` runs once training is set up; the :class:`~.trainer.Trainer` builds what
it is given (``pipeline``, ``data``, ``clock``, ``progress``, ``controller``...) and owns the
files.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..echo.controller import EchoController
from .config import TrainConfig
from .distributed import DistContext, average_buffers, fault_exit
from .input import TrainInput, evaluate
from .progress import Progress, StepLog
from .schedule import EpochClock, LrSchedule, check_losses, hybrid_switch_epoch
from .start import signals_deferred
from .state import RunState, is_partial

if TYPE_CHECKING:
    from ..data import ImageFolderIndex

__all__ = ["EpochLoop"]


class EpochLoop:
    """Training steps and epoch ends on the run state ``run_state``.

    Given what the trainer built: the options, the distributed context, the run state, the
    input (``data``, with its checked validation files ``data_dir``), the stale pipeline and its
    ``model``, the epoch clock and LR schedule, the progress display and step log, the echo
    controller (None without ``--echo auto``), where to say things, the run's start time
    ``wall0``, the seconds it waited for the first steps' input (``input_wait_s``: training
    time of the first epoch), and the trainer's ``save`` (writes the checkpoint files; the loop
    drains the pipeline first) and ``write_metrics`` (rewrites the run folder's metrics). What
    an epoch counts is in the run state (a checkpoint holds it); the loop owns ``stopped``, the
    reason the run stopped early.
    """

    def __init__(
        self,
        *,
        cfg: TrainConfig,
        ctx: DistContext,
        run_state: RunState,
        data: TrainInput,
        data_dir: Path | ImageFolderIndex,
        pipeline: Any,
        model: Any,
        clock: EpochClock,
        lr_schedule: LrSchedule,
        progress: Progress,
        step_log: StepLog | None,
        controller: EchoController | None,
        say: Callable[[str], None],
        wall0: float,
        save: Callable[..., None],
        write_metrics: Callable[[], None],
        input_wait_s: float = 0.0,
    ) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.run_state = run_state
        self.data = data
        self.data_dir = data_dir
        self.pipeline = pipeline
        self.model = model
        self.clock = clock
        self.lr_schedule = lr_schedule
        self.progress = progress
        self.step_log = step_log
        self.controller = controller
        self.say = say
        self.wall0 = wall0
        self.save = save
        self._write_metrics = write_metrics
        self.stopped: str | None = None
        self.last_loss: float | None = None
        self._step_of: dict[int, int] = {}  # pipeline minibatch index -> training step
        # Since when training time goes uncounted (None outside the epoch's steps): counted into
        # the run state at each checkpoint's save (its drain included) and at the epoch's end.
        self._mark: float | None = None
        # The wait for the first steps' input, before this loop (counted into the first epoch).
        self._input_wait_s = input_wait_s
        # The upstream's supply when the last epoch's steps ended (then validation).
        self._paused_at: tuple[int, float] | None = None
        self.epoch_times: list[float] = []
        self._val: list[Any] = []  # the validation iterator, built on first use
        # Whether the BatchNorm statistics are averaged over the replicas for the steps taken:
        # so a checkpoint written by a stop during validation holds them (see end_epoch).
        self._averaged = run_state.validation_due

    def checkpoint(self, *, best: bool) -> None:
        """Drain the pipeline (nothing in flight, its losses kept), then ``save``; the drain
        finishes steps' compute (training time), the save is not."""
        training = self._mark is not None
        self.drain()  # the pipeline's state_dict() would drain too
        self._count_time()
        st = self.run_state  # the unfinished epoch's wall time, which a resume goes on from
        st.epoch_wall_s = time.perf_counter() - self.epoch_t0 if st.step_in_epoch else 0.0
        self.save(best=best)
        if training:
            self._mark = time.perf_counter()

    def _count_time(self) -> None:
        """Adds the training time since the mark to the epoch's and the run's."""
        if self._mark is not None:
            now, st = time.perf_counter(), self.run_state
            dt, self._mark = now - self._mark, now
            st.epoch_train_s, st.train_s = st.epoch_train_s + dt, st.train_s + dt

    def run_epoch(self) -> None:
        cfg, st = self.cfg, self.run_state
        switch, restart = hybrid_switch_epoch(self.lr_schedule.span())
        at = self.lr_schedule.at(float(st.epoch))
        if switch is not None and at >= switch and max(self.pipeline.staleness()) > 0:
            self.pipeline.set_pipelined(False)
            again = ", learning rate restarted" if restart else ""
            self.say(f"hybrid: synchronous from epoch {st.epoch + 1} (staleness now 0{again})")
        self.progress.start_epoch(st.epoch, st.steps_per_epoch, st.step_in_epoch)
        if st.step_in_epoch == 0 and self.clock.segments[-1][0] != st.global_step:
            self.clock.plan(
                st.global_step, float(st.epoch), st.steps_per_epoch, float(st.epoch + 1)
            )
        # A resumed epoch goes on from its checkpoint's figures (an earlier version's have none).
        if st.step_in_epoch == 0 or st.epoch_samples == 0:
            st.epoch_loss_sum, st.epoch_losses = 0.0, 0
            st.epoch_samples, st.epoch_train_s, st.epoch_wall_s = 0, 0.0, 0.0
            st.epoch_fresh_start = int(self.data.counters()["fresh"])
        self.epoch_t0 = time.perf_counter() - st.epoch_wall_s  # (the earlier processes' part)
        self.last_loss = None
        fresh0 = st.epoch_fresh_start
        self._mark = time.perf_counter() - self._input_wait_s
        self._input_wait_s = 0.0
        if self.controller is not None and self._paused_at is not None:
            # The upstream read on through the pause (validation, the checkpoint): taken in
            # at the next retune step.
            t_pause = self.data.pause_reads(self._paused_at)
            if t_pause is not None:
                self.controller.set_pause(t_pause, st.global_step)
        while st.step_in_epoch < st.steps_per_epoch:
            if cfg.max_steps is not None and st.global_step >= cfg.max_steps:
                self.stopped = f"--max-steps {cfg.max_steps} reached"
                break
            self._step()
            fault_exit(self.ctx.rank, st.global_step)
            self._log_step()
            if self._retune_due() and st.step_in_epoch < st.steps_per_epoch:
                self._retune_echo()
            if (
                cfg.checkpoint_every
                and st.global_step % cfg.checkpoint_every == 0
                and st.step_in_epoch < st.steps_per_epoch
            ):
                self.checkpoint(best=False)
            self.progress.step(
                st.global_step,
                self.last_loss,
                self.data.factor,
                delivered=st.epoch_samples,
                fresh=self.data.counters()["fresh"] - fresh0,
            )
        self.drain()
        self.progress.drained()
        self._count_time()
        self._mark, self._paused_at = None, self.data.pipe.upstream_supply()
        self.epoch_fresh = self.data.counters()["fresh"] - fresh0

    def _log_step(self) -> None:
        if self.step_log is None:
            return
        st = self.run_state
        self.step_log.add(
            st.global_step,
            self.clock.epochs_at(st.global_step),
            self.cfg.lr * self.lr_schedule.factor(st.global_step - 1),  # (this step's update)
            self.data.factor,
            st.wall_s + time.perf_counter() - self.wall0,
        )

    def _retune_due(self) -> bool:
        """Whether rank 0's controller is consulted after this step: every step of the first
        ``--echo-interval``, so its first decision (right after its warm-up) is used at once
        rather than an interval later, then every interval. Steps are counted alike on every
        rank, so all ranks join the same broadcasts."""
        step, interval = self.run_state.global_step, self.cfg.echo_interval
        return self.controller is not None and (step < interval or step % interval == 0)

    def drain(self) -> None:
        """Finish every minibatch in flight and keep the losses they report."""
        self._keep_losses(self.pipeline.drain())

    def _keep_losses(self, finished: list[Any]) -> None:
        """The losses of finished minibatches: into the epoch's mean and each step's line."""
        losses = [r.value for r in finished]
        check_losses(losses, self.run_state.global_step, self.cfg)
        self.run_state.epoch_loss_sum += sum(losses)
        self.run_state.epoch_losses += len(losses)
        self.last_loss = losses[-1] if losses else self.last_loss
        for record, value in zip(finished, losses, strict=True):
            step = self._step_of.pop(record.index, None)
            if step is not None and self.step_log is not None:
                self.step_log.loss(step, value)

    def _step(self) -> None:
        cfg, st = self.cfg, self.run_state
        try:
            batch = next(self.data.iterator)[0]
        except RuntimeError as exc:  # the DALI pipeline's failure, e.g. a full echo cache
            raise self.data.explain(exc) from None
        x, y = batch["data"], batch["label"].reshape(-1).long()
        if cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        result = self.pipeline.train_step(x, y)
        self._averaged = False
        self._step_of[result.index] = st.global_step + 1
        self._keep_losses(result.finished)
        st.global_step += 1
        st.step_in_epoch += 1
        st.epoch_fresh += cfg.batch_size / self.data.factor
        st.epoch_samples += int(x.shape[0])
        st.samples_trained += int(x.shape[0])
        busy = self.pipeline.step_seconds()
        if busy is not None:
            st.step_time_s += busy
            st.steps_timed += 1
            t_up = self.data.upstream_step_seconds()
            if self.controller is not None and t_up is not None:
                self.controller.observe(t_up, busy, st.global_step)

    def _retune_echo(self) -> None:
        """Adopt rank 0's echo factor within an epoch, re-planning the fresh samples it owes."""
        assert self.controller is not None
        cfg, st, data = self.cfg, self.run_state, self.data
        wanted = self.ctx.broadcast_object(self.controller.factor)
        if wanted != data.factor:
            fresh_left = max(data.iterator.shard_size - st.epoch_fresh, 0.0)
            left = max(1, math.ceil(fresh_left * wanted / cfg.batch_size))
            left = self.ctx.all_reduce_min(left)
            st.steps_per_epoch = st.step_in_epoch + left
            data.set_steps(st.steps_per_epoch)
            self.clock.plan(
                st.global_step, self.clock.epochs_at(st.global_step), left, float(st.epoch + 1)
            )
            self.progress.set_total(st.steps_per_epoch)
            self._set_factor(wanted, f"step {st.global_step} (epoch {st.epoch + 1}, {left} "
                             "steps left in it; ")  # fmt: skip

    def _plan_next_epoch(self) -> tuple[float, int] | None:
        """At the end of an epoch with --echo auto (not the run's last): rank 0's echo factor
        and the next epoch's length at it (the replicas' least), agreed before validation's
        last collective and changing nothing, so that a rank past that collective records the
        epoch and writes its checkpoint without another rank (a stop may have ended it)."""
        st = self.run_state
        last = st.epoch + 1 >= self.cfg.epochs
        if self.controller is None or st.step_in_epoch < st.steps_per_epoch or last:
            return None
        wanted = self.ctx.broadcast_object(self.controller.factor)
        return wanted, self.ctx.all_reduce_min(self.data.steps_at(wanted))

    def _adopt(self, wanted: float, steps: int) -> None:
        """The next epoch's factor and length (also when e stayed: a retune re-planned it)."""
        if wanted != self.data.factor:
            self._set_factor(wanted, f"epoch {self.run_state.epoch + 1} (")
        self.run_state.steps_per_epoch = steps
        self.data.set_steps(steps)

    def _set_factor(self, wanted: float, where: str) -> None:
        assert self.controller is not None
        self.data.set_factor(wanted)
        self.run_state.factors_used.append(wanted)
        c = self.controller
        pause = f", t_pause {1000 * c.t_pause:.0f} ms: read between epochs" if c.t_pause else ""
        self.say(f"echo: factor {wanted:g} from {where}R = {c.ratio:.2f}{pause})")

    def end_epoch(self) -> None:
        """Validate, record the row, retune echo, checkpoint, rewrite the run folder's files.

        A stop (Ctrl-C, SIGTERM) during validation first writes the checkpoint of the epoch as
        trained, not validated (:meth:`_keep_trained`): the resume validates it and goes on,
        rather than training it again from the checkpoint before. Once validation's last
        collective has returned, the epoch's metrics are known on every rank: a stop from then
        on waits until the epoch-end checkpoint, which holds them, is written.
        """
        st = self.run_state
        if st.rows and st.rows[-1]["step"] == st.global_step:
            return  # --max-steps fell on an epoch end: that epoch is already recorded
        recording = False
        try:
            top1, val_loss, val_n, top5 = self._validate()
            plan = self._plan_next_epoch()
            counters = self._counters()  # the last collective: recording needs no other rank
            # Entered inside the try: a stop before it holds still keeps the trained epoch; in
            # it, no stop leaves the state half updated.
            with signals_deferred():
                recording = True
                self._record(top1, val_loss, val_n, top5, counters, plan)
        except KeyboardInterrupt:
            if not recording:  # (else the checkpoint of the validated epoch is written)
                self._keep_trained()
            raise
        if self.ctx.is_main:
            self._write_metrics()

    def _record(self, top1: float, val_loss: float, val_n: int, top5: float,
                counters: list[float], plan: tuple[float, int] | None) -> None:  # fmt: skip
        """The validated epoch: its row, ``plan``'s echo retune, the next pass, the checkpoint."""
        cfg, st = self.cfg, self.run_state
        finished = st.step_in_epoch >= st.steps_per_epoch
        if finished:
            st.epoch, st.step_in_epoch, st.epoch_fresh = st.epoch + 1, 0, 0.0
        row = self._row(top1, val_loss, val_n, counters)
        row["val_top5"] = top5
        epoch_s = time.perf_counter() - self.epoch_t0
        row.update(st.epoch_figures(self.ctx.world_size, self.epoch_fresh, epoch_s))
        # The epoch's row replaces the one a --max-steps stop inside it wrote (its counters went
        # on from that stop): one row per epoch.
        st.rows[:] = [*(r for r in st.rows if not is_partial(r)), row]
        target = cfg.stop_at_top1
        if target is not None and top1 >= target and self.stopped is None:
            self.stopped = (
                f"--stop-at-top1 {target:g} reached (top-1 {top1:.3f}, step {st.global_step})"
            )
        best, st.best_top1 = top1 > st.best_top1, max(st.best_top1, top1)
        self.epoch_times.append(row["epoch_s"])
        left = 0 if self.stopped else max(cfg.epochs - st.epoch, 0)
        self.progress.end_epoch(row, left * float(np.mean(self.epoch_times)))
        if plan is not None:
            self._adopt(*plan)
        if finished:
            self.data.iterator.reset()
        self.checkpoint(best=best)

    def _validate(self) -> tuple[float, float, int, float]:
        """The replicas' BatchNorm statistics averaged (whole: a stop between a buffer's sum and
        its division would leave it summed, and a checkpoint of the trained epoch would keep
        it), then :func:`~.input.evaluate`."""
        st = self.run_state
        if not self._averaged:
            with signals_deferred():
                average_buffers(self.model, self.ctx)
            self._averaged = True
        self.progress.validating(st.epoch, st.global_step)
        return evaluate(
            self.pipeline, self.cfg, self.data_dir, self.ctx, self.data.device_id, self._val
        )

    def _keep_trained(self) -> None:
        """A stop during validation: the checkpoint of what validation was given, whole (a
        second stop meanwhile is dropped). After an epoch's last step its validation is due
        (RunState.validation_due) and a resume begins with it; after a --max-steps stop inside
        an epoch it is a checkpoint of that step, as --checkpoint-every writes."""
        with signals_deferred(resend=False):
            self.checkpoint(best=False)

    def _counters(self) -> list[float]:
        """Fresh and echoed samples and upstream time, summed over the replicas."""
        c = self.data.counters()
        return self.ctx.all_reduce_sum([c["fresh"], c["echoed"], c["up_s"], c["up_iters"]])

    def _row(
        self, top1: float, val_loss: float, val_n: int, counters: list[float]
    ) -> dict[str, Any]:
        st = self.run_state
        fresh, echoed, up_s, up_n = counters
        t_up = up_s / up_n if up_n else math.nan
        world = self.ctx.world_size
        n = st.global_step  # the LR after n updates, as the stages' schedulers computed it
        lr = self.cfg.lr * self.lr_schedule.factor(n)
        return {
            # Epochs done: a whole number, or a fraction for a run stopped by --max-steps, whose
            # row is partial until the epoch's own replaces it.
            "epoch": st.epoch if st.step_in_epoch == 0 else round(self.clock.epochs_at(n), 3),
            "step": st.global_step,
            "wall_s": st.wall_s + time.perf_counter() - self.wall0,
            "train_s": st.train_s,
            "train_loss": st.epoch_loss_sum / st.epoch_losses if st.epoch_losses else None,
            "val_top1": top1,
            "val_loss": val_loss,
            "val_images": val_n,
            "fresh_samples": int(fresh),
            "echoed_samples": int(echoed),
            "fresh_per_s": fresh / max(st.train_s, 1e-9),
            "delivered_per_s": world * st.samples_trained / max(st.train_s, 1e-9),
            "echo_factor": self.data.factor,
            "input_builds": self.data.builds,
            "t_up_ms": 1000 * t_up,
            "t_down_ms": 1000 * st.t_down_s,
            "R": t_up / st.t_down_s if st.steps_timed else None,
            "pipelined": max(self.pipeline.staleness()) > 0,  # (1 stage: never stale)
            "lr": lr,
        }
