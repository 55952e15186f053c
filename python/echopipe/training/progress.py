"""What a run shows while it trains: the progress bar or log lines, the epoch line, steps.csv.

On a terminal, tqdm bars, with every message written above the bar rather than into it;
otherwise (a log file, a pipe, ``--no-progress``) one plain line every ``--log-interval``
steps and one per epoch. Rates leave out the first steps of the process, which only fill the
stale pipeline and pay start-up costs. ``steps.csv`` in the run folder has one line per step.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from ..filecheck import FileCheckError, open_regular
from ..pipeline.checkpoint import atomic_write

__all__ = ["WARMUP_STEPS", "Progress", "StepLog", "format_duration", "to_stderr"]

WARMUP_STEPS = 5
"""Steps of each process left out of the rates (the pipeline fills, caches warm up)."""


def to_stderr(message: str) -> None:
    """``message`` as one line on stderr, in one write: the ranks of a torchrun job share its
    stderr, and ``print``'s two writes (the text, then the newline) let another rank's line
    land inside this one."""
    sys.stderr.write(f"{message}\n")
    sys.stderr.flush()


def format_duration(seconds: float) -> str:
    """``h:mm:ss`` (or ``m:ss``)."""
    if not math.isfinite(seconds):
        return "?"
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Progress:
    """Progress of rank 0: tqdm bars on a terminal, else a plain line every ``interval`` steps.

    ``clock`` is injectable so that the rates can be checked on given timings.
    """

    def __init__(
        self,
        enabled: bool,
        bars: bool,
        interval: int,
        epochs: int,
        say: Callable[[str], None],
        tb_dir: Path | None,
        *,
        warmup_steps: int = WARMUP_STEPS,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.enabled = enabled
        self.bars = enabled and bars and sys.stderr.isatty()
        self.interval = interval
        self.epochs = epochs
        self.say = say
        self.clock = clock
        self.warmup_steps = warmup_steps
        self.bar: Any = None
        self.tb: Any = None
        self._seen = 0
        # The rates of a line are over the steps since the previous line, across epoch ends:
        # counts are kept since the run began (the trainer's are per epoch), and the time from
        # an epoch's last step to the next epoch's start (validation, checkpoint) is left out.
        self._window: tuple[float, float, float] = (clock(), 0.0, 0.0)
        self._base = (0.0, 0.0)  # samples delivered and fresh before this epoch
        self._last = (0.0, 0.0)  # this epoch's counts at its latest step
        self._last_step_at: float | None = None
        if enabled and tb_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                self.tb = SummaryWriter(str(tb_dir))

    def write(self, message: str, log: Callable[[str], None]) -> None:
        """``log(message)`` above a live bar (cleared first, redrawn after)."""
        if self.bar is None:
            log(message)
            return
        from tqdm import tqdm

        with tqdm.external_write_mode(file=sys.stderr):
            log(message)

    def drained(self) -> None:
        """The epoch's in-flight minibatches finished: training time up to here, since the
        drain is where the last steps' compute is waited for."""
        if self._last_step_at is not None:
            self._last_step_at = self.clock()

    def validating(self, epoch: int, step: int) -> None:
        """Validation of ``epoch`` (0-based) starts after ``step``: a line (it may take minutes,
        and a stop during it keeps the trained epoch)."""
        if self.enabled:
            self.say(f"validating epoch {epoch + 1}/{self.epochs} at step {step}")

    def start_epoch(self, epoch: int, steps: int, done: int) -> None:
        now = self.clock()
        t0, d0, f0 = self._window
        if self._last_step_at is not None:
            t0 += now - self._last_step_at
        self._window = (t0, d0, f0)
        self._base = (self._base[0] + self._last[0], self._base[1] + self._last[1])
        self._last = (0.0, 0.0)
        if self.bars:
            from tqdm import tqdm

            self.bar = tqdm(
                total=steps,
                initial=done,
                desc=f"epoch {epoch + 1}/{self.epochs}",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )

    def step(self, step: int, loss: float | None, e: float, *, delivered: int,
             fresh: float) -> None:  # fmt: skip
        """One step done; ``delivered`` and ``fresh`` count samples since the epoch began.

        The rates shown are over the steps since the previous line (or bar refresh), also
        across an epoch end, with the time between epochs (after :meth:`drained`) left out, and
        none before the process's first ``warmup_steps`` steps are done, nor on a step that
        finished no minibatch (``loss`` None: an epoch's first steps refill the drained pipeline).
        """
        if not self.enabled:
            return
        now = self.clock()
        self._seen += 1
        self._last, self._last_step_at = (delivered, fresh), now
        total, total_fresh = self._base[0] + delivered, self._base[1] + fresh
        fields: dict[str, float | None] = {"loss": loss, "e": e}
        # A step that finished no minibatch (loss None: the first steps after a drain only
        # refill the pipeline) returns at once; a line there would show thousands of img/s, and
        # a window restarted there would leave out the compute the next step waits for. (The
        # process that shows progress has the last stage, so every computed step has a loss.)
        refilling = loss is None
        if self._seen <= self.warmup_steps:
            self._window = (now, total, total_fresh)  # the rates start after the warm-up
        elif not refilling:
            t0, d0, f0 = self._window
            seconds = max(now - t0, 1e-9)
            fields["img/s"] = (total - d0) / seconds
            fields["fresh/s"] = (total_fresh - f0) / seconds
        shown = {k: v for k, v in fields.items() if v is not None}
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
            self.bar.update(1)
            if step % self.interval == 0 and "img/s" in fields:
                self._window = (now, total, total_fresh)
        elif step % self.interval == 0:
            self.say(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()))
            if "img/s" in fields:
                self._window = (now, total, total_fresh)
        if self.tb is not None and loss is not None:
            self.tb.add_scalar("train/loss", loss, step)

    def set_total(self, steps: int) -> None:
        if self.bar is not None:
            self.bar.total = steps
            self.bar.refresh()

    def end_epoch(self, row: dict[str, Any], eta_s: float) -> None:
        """The epoch line: losses, top-1/top-5, LR, epoch time, this epoch's rates, ETA."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if not self.enabled:
            return
        loss = "n/a" if row["train_loss"] is None else f"{row['train_loss']:.3f}"
        eta = "done" if eta_s <= 0 else f"ETA {format_duration(eta_s)}"
        self.say(
            f"epoch {row['epoch']}/{self.epochs}: train loss {loss}, val loss "
            f"{row['val_loss']:.3f}, top-1 {100 * row['val_top1']:.1f} %, top-5 "
            f"{100 * row['val_top5']:.1f} %, lr {row['lr']:.3g}, "
            f"{format_duration(row['epoch_s'])} ({row['epoch_img_per_s']:.0f} img/s, "
            f"{row['epoch_fresh_per_s']:.0f} fresh), e={row['echo_factor']:g}; {eta}"
        )
        if self.tb is not None:
            for key in ("val_top1", "val_top5", "val_loss", "train_loss", "echo_factor", "lr"):
                if row.get(key) is not None:
                    self.tb.add_scalar(f"epoch/{key}", row[key], row["step"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


class StepLog:
    """``steps.csv``: one line per training step, written by rank 0.

    A step's ``train_loss`` is that step's own minibatch loss. A pipelined step's loss is known
    some steps later (at the latest when the pipeline drains), so a line waits until its loss
    arrived and the lines before it were written; :meth:`flush` (at each checkpoint, after the
    drain) and :meth:`close` write every waiting line, with an empty loss where none came (a
    rank whose replica has no last stage). A resumed run keeps the lines up to the step it
    resumes from and appends, so every step a checkpoint holds is in the file. A file under the
    name that cannot be kept (a link, a FIFO, a sparse file) is replaced, with a warning through
    ``say`` (``warnings.warn`` without it), as the run folder's own files are never written
    through a link.
    """

    FIELDS = ("step", "epoch", "train_loss", "lr", "echo_factor", "wall_s")

    def __init__(
        self, path: Path, resumed_step: int | None, say: Callable[[str], None] | None = None
    ) -> None:
        self.path = path
        problem = _rewrite(path, ",".join(self.FIELDS) + "\n", resumed_step)
        if problem is not None:
            first = (resumed_step or 0) + 1
            (say or warnings.warn)(
                f"warning: {str(path)!r} {problem}; it is replaced by a new steps.csv from step "
                f"{first} (the earlier steps' lines are not in it)"
            )
        # O_NOFOLLOW: a link planted after the rewrite is refused, not written through.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.file: TextIO | None = os.fdopen(fd, "a")
        # step -> [epoch, loss, lr, e, wall_s], in step order, until written
        self._waiting: dict[int, list[Any]] = {}
        self._early: dict[int, float] = {}  # losses known before their step's line

    def add(self, step: int, epoch: float, lr: float, e: float, wall_s: float) -> None:
        """A step's line; it is written once the step's loss (:meth:`loss`) is known."""
        self._waiting[step] = [epoch, self._early.pop(step, None), lr, e, wall_s]
        self._write(every=False)

    def loss(self, step: int, value: float) -> None:
        """The loss of step ``step`` (its own minibatch's)."""
        line = self._waiting.get(step)
        if line is None:
            self._early[step] = value
            return
        line[1] = value
        self._write(every=False)

    def _write(self, every: bool) -> None:
        while self._waiting:
            step = next(iter(self._waiting))
            epoch, loss, lr, e, wall_s = self._waiting[step]
            if loss is None and not every:
                return
            del self._waiting[step]
            if self.file is not None:
                shown = "" if loss is None else f"{loss:.6g}"
                line = f"{step},{epoch:.4f},{shown},{lr:.6g},{e:g},{wall_s:.3f}\n"
                self._named(lambda f, line=line: f.write(line))

    def flush(self) -> None:
        """Writes every waiting line (after a drain their losses are all known) to the disk."""
        self._write(every=True)
        if self.file is not None:
            self._named(lambda f: f.flush())

    def close(self) -> None:
        self._write(every=True)
        if self.file is not None:
            self._named(lambda f: f.close())
            self.file = None

    def _named(self, action: Callable[[TextIO], object]) -> None:
        """``action`` on the file; an OSError (a full disk) names the file and closes it, so
        it is raised once: the close of a run that stops on it would raise it again, in place
        of the line that says where the run stopped, and skip the closes after it."""
        assert self.file is not None
        try:
            action(self.file)
        except OSError as exc:
            file, self.file = self.file, None
            with contextlib.suppress(OSError):
                file.close()  # the descriptor is closed even when the flush in it fails
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc


_LINE_BYTES = 128
"""More than the longest line StepLog writes (six numbers, about 80 bytes at their widest), so
the lines of steps 1..n of an echopipe-written steps.csv lie within its first n * 128 bytes."""


def _rewrite(path: Path, header: str, step: int | None) -> str | None:
    """Replace ``path`` atomically with ``header`` and, on a resume, the lines of ``path`` up to
    ``step`` (a resume repeats the lines after it). Returns why the old lines could not be kept,
    or None. Read bounded (regular files only, the bytes that the lines up to ``step`` may take);
    a link under the name is replaced, never followed."""
    problem = None

    def write(dst: BinaryIO) -> None:
        nonlocal problem
        dst.write(header.encode())
        if step is not None and os.path.islink(path):
            problem = "is a symbolic link, which echopipe never writes"
        elif step is not None:
            try:
                src, _ = open_regular(path)
                with src:
                    _copy_steps_up_to(src, dst, step)
            except FileNotFoundError:
                pass  # no lines yet: nothing to keep
            except FileCheckError as exc:  # a FIFO, a device, a sparse file
                problem = str(exc)
            except OSError as exc:
                problem = f"cannot be read ({exc.strerror or exc})"

    atomic_write(path, write)
    return problem


def _copy_steps_up_to(src: BinaryIO, dst: BinaryIO, step: int) -> None:
    """The lines of ``src`` for steps up to ``step``; a damaged line (not ASCII, no step number,
    longer than echopipe writes, unfinished) is dropped, as are the lines after ``step``."""
    budget = (step + 1) * _LINE_BYTES
    at_start = True
    while budget > 0:
        line = src.readline(min(budget, _LINE_BYTES))
        if not line:
            return
        budget -= len(line)
        whole, at_start = at_start and line.endswith(b"\n"), line.endswith(b"\n")
        head = line.split(b",", 1)[0]
        if whole and line.isascii() and head.isdigit() and int(head) <= step:
            dst.write(line)
