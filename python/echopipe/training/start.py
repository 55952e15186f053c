"""The start of a run: its folder, the checkpoint it resumes and the options it runs with.

:class:`RunStart`, which the :class:`~.trainer.Trainer` holds, runs before anything heavy:
it picks and locks the run folder, removes what a killed write left, finds the checkpoint to
resume (agreed by every rank), merges the options and checks the data folder. A start that is
refused leaves nothing behind. It also writes ``config.json``: the first start's options and
decisions, and one entry per restart after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shlex
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .checkpoints import CheckpointError, RunCheckpoints
from .config import DataError, TrainConfig, UsageError
from .distributed import DistContext
from .file_list import resume_file_list
from .options import CollectiveError
from .preflight import check_cache_fits, check_data, read_resume, same_world_size
from .refusal import record_refusal
from .report import TrainSummary, summarize, write_config, write_run_files
from .resume import agree_on_checkpoint, agree_on_file, merge_options, restart_entry
from .runfolder import (
    RunFolder,
    ensure_same_run,
    read_run_config,
    read_run_metrics,
    refuse_inside_data,
)
from .schedule import EpochClock, LrSchedule, stretch_schedule
from .state import RunState

__all__ = ["RunStart", "say_through", "signals_deferred"]


class RunStart:
    """Run folder, resume and the options of a run (see the module notes).

    Given the options ``cfg``, the distributed context, the options the caller set (``given``)
    and where to say things. :meth:`prepare` fills in what the run starts from: ``cfg`` (merged
    with a resumed checkpoint's), ``folder``/``out``/``ckpts``, ``saved`` and ``resume_path``,
    ``changed`` (options given anew on a resume), ``finished`` (a resumed run that has nothing
    left to train), ``data_dir``, ``classes`` and ``indexes`` (the checked files of each
    split). ``last_saved`` is the last checkpoint written (``(step, RunState.position())``),
    which the trainer updates as it saves.
    """

    def __init__(
        self, cfg: TrainConfig, ctx: DistContext, given: set[str], say: Callable[[str], None]
    ) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.given = given
        self.say = say
        self.saved: dict[str, Any] | None = None
        self.folder: RunFolder | None = None
        self.out: Path | None = None
        self.resume_path: Path | None = None
        self.changed: dict[str, list[Any]] = {}
        self.finished: str | None = None
        self.last_saved: tuple[int, str] | None = None
        self._fell_back = False  # the ranks agreed on this rank's prev.pt
        self.data_dir = Path()
        self.classes: list[str] = []
        self.indexes: dict[str, Any] = {}  # the checked files of train/ and val/
        self.left_out: list[str] = []  # what the data scans left out, for the summary
        self.file_list: dict[str, Any] = {}  # train/'s, as the checkpoints record it
        self.fresh_input: str | None = None  # a resume's line: train/ changed at an epoch end

    def prepare(self) -> None:
        """Run folder, lock, stale files, the checkpoint to resume, options, the data folder."""
        cfg, ctx = self.cfg, self.ctx
        if cfg.data is not None:  # recorded absolute: a resume from another directory finds it
            self.cfg = cfg = dataclasses.replace(cfg, data=Path(os.path.abspath(cfg.data)))
        self.folder = RunFolder.choose(cfg, "output" in self.given, ctx.broadcast_object, self.say)
        self.out = self.folder.path
        refuse_inside_data(self.out, cfg.data)
        self._open_folder()
        top = self.out / "checkpoints"
        self.ckpts = RunCheckpoints(top / f"rank{ctx.rank}" if ctx.enabled else top, root=self.out)
        stale = self.folder.remove_stale_tmp(
            *((self.out, top) if ctx.is_main else ()), self.ckpts.folder
        )
        if stale:
            self.say(f"run folder: removed {stale} temporary file(s) of an interrupted write")
        try:
            self._find_resume()
        except (UsageError, CheckpointError) as exc:  # the checkpoints' own: not transient
            if ctx.enabled and ctx.is_main:
                record_refusal(exc, cfg.dist_timeout_s)
            raise
        if self.finished is None:
            check_cache_fits(self.cfg)
            self.data_dir, self.classes, self.indexes = check_data(
                self.cfg, self.say, self.left_out, ctx
            )
            if self.saved and self.saved["model"]["num_classes"] != len(self.classes):
                raise DataError(
                    f"--resume {str(self.resume_path)!r}: the model has "
                    f"{self.saved['model']['num_classes']} classes, --data has "
                    f"{len(self.classes)}"
                )
            self.file_list, self.fresh_input = resume_file_list(
                self.saved, self.indexes["train"], str(self.resume_path)
            )
            if self.fresh_input is not None:
                self.say(self.fresh_input)

    def input_state(self) -> dict[str, Any] | None:
        """The input state the run restores: none for a new run, nor over a train/ that
        changed since an epoch-end checkpoint (the next epoch reads the new list afresh)."""
        return None if self.saved is None or self.fresh_input else self.saved["input"]

    def _open_folder(self) -> None:
        """Create the run folder; rank 0 takes its lock. Under torchrun no rank touches the
        folder (stale temporary files, checkpoints) before every rank knows that rank 0 holds
        the lock: the other ranks of a second job given a live run's folder would otherwise
        delete that run's temporary files of a checkpoint being written."""
        assert self.folder is not None
        ctx = self.ctx
        refused: UsageError | None = None
        try:
            self.folder.open(lock=ctx.is_main)
        except UsageError as exc:
            if not ctx.enabled:
                raise
            refused = exc
        views = ctx.all_gather_object(None if refused is None else str(refused))
        if refused is not None:
            raise refused
        for view in views:
            if view is not None:
                raise UsageError(view)

    def settle(self) -> None:
        """Once the run is set up (nothing can refuse its start any more): a rank that went
        back to prev.pt (agree_on_checkpoint) drops its newer last.pt, of steps the other ranks
        never took; a start refused before leaves the folder as it was."""
        if self._fell_back:
            os.replace(self.ckpts.prev, self.ckpts.last)
            self._fell_back = False

    def _find_resume(self) -> None:
        cfg, ctx = self.cfg, self.ctx

        def read(path: Path) -> dict[str, Any]:
            return read_resume(path, ctx.world_size)

        self._check_layout()
        found: tuple[Path, dict[str, Any]] | None = None
        if isinstance(cfg.resume, Path) and ctx.enabled:
            found = agree_on_file(cfg.resume, ctx, read)
        elif isinstance(cfg.resume, Path):
            found = (cfg.resume, read(cfg.resume))
        elif cfg.resume in (True, "auto"):
            found = agree_on_checkpoint(self.ckpts, ctx, read, self.say)
            self._fell_back = found is not None and found[0] == self.ckpts.prev
            if found is None and cfg.resume is True:
                raise UsageError(
                    f"--resume: no checkpoint {str(self.ckpts.last)!r} in this run folder; start "
                    "without --resume, or give --resume CKPT"
                )
        if found is None:
            earlier = self.ckpts.existing()
            if earlier and cfg.resume:
                raise UsageError(
                    f"--output {str(self.out)!r} holds checkpoints ({earlier[0].name}) but no "
                    f"{self.ckpts.last.name} to resume from: give --resume "
                    f"{str(earlier[0])!r} to continue from it, or choose another --output"
                )
            if earlier:
                raise UsageError(
                    f"--output {str(self.out)!r} holds checkpoints of an earlier run "
                    f"({earlier[0].name}): pass --resume (or --resume auto) to continue it, or "
                    "choose another --output"
                )
            if cfg.resume == "auto":
                cfg.validate()  # a new run: its options' combination, as given and defaulted
                self.say(f"resume auto: no checkpoint in {self.out} yet; the run starts")
            return
        path, saved = found
        try:
            st = RunState.from_state_dict(saved["run"])
        except (ValueError, TypeError) as exc:
            raise UsageError(
                f"--resume {str(path)!r}: its run state is not usable: {exc}"
            ) from None
        ensure_same_run(self.out, st.run_id, path, bool(self.ckpts.existing()))
        self.cfg, self.changed = merge_options(cfg, saved, self.given, path)
        self.saved, self.resume_path = saved, path
        self.last_saved = (st.global_step, st.position())
        if st.epoch >= self.cfg.epochs:
            self.finished = (
                f"resume: the run finished its {st.epoch} epoch(s) at step {st.global_step}; "
                f"nothing to train (give --epochs above {st.epoch} to train it longer)"
            )
            self.say(self.finished)
            return
        for name, (was, now) in self.changed.items():
            self.say(f"resume: {name} {was} -> {now} (given anew; recorded in config.json)")

    def _check_layout(self) -> None:
        """Refuse a folder whose checkpoints another number of processes wrote: one process
        writes checkpoints/, torchrun's ranks checkpoints/rank<r>/, so neither sees the other's
        (and a start would overwrite that run)."""
        if self.ckpts.existing():
            return
        top = self.out / "checkpoints"  # type: ignore[operator]
        if self.ctx.enabled:
            other = RunCheckpoints(top, root=self.out).existing()
            processes = 1
        else:
            ranks = sorted(p for p in top.glob("rank*") if RunCheckpoints(p).existing())
            other = [RunCheckpoints(ranks[0]).existing()[0]] if ranks else []
            processes = len(ranks)
        if other:
            raise UsageError(
                f"--output {str(self.out)!r} holds the checkpoints of a run at world size "
                f"{processes} ({other[0]}), this run has world size {self.ctx.world_size}: "
                f"{same_world_size(processes)}"
            )

    def finished_summary(self) -> TrainSummary:
        """The summary of a run that had finished before this resume (nothing was trained)."""
        assert self.saved is not None
        st = RunState.from_state_dict(self.saved["run"])
        summary = summarize(
            st,
            echo_factor=float(self.saved.get("input_factor", math.nan)),
            staleness=[],
            balance=list(self.saved["pipeline"].get("balance", [])),
            devices=[],
            wall_s=st.wall_s,
            output=self.out if self.ctx.is_main else None,
            decisions=[],
            stopped=self.finished,
        )
        summary.resumed_finished = True
        return summary

    def complete_run_files(self, summary: TrainSummary) -> None:
        """A run stopped (Ctrl-C, SIGTERM) after its last checkpoint but before the metrics
        written after it has a finished checkpoint and a ``metrics.json`` without its last
        epoch's row or its summary, which no resume would write: they are written here, from
        the checkpoint. Complete run files are left as they are, and so are files of more
        epochs than the checkpoint holds (a resume from ``prev.pt`` or an older CKPT of a run
        that trained on): written from it, they lost the newer epochs' rows."""
        assert self.saved is not None and self.out is not None
        st = RunState.from_state_dict(self.saved["run"])
        doc = read_run_metrics(self.out)
        rows = -1 if doc is None else len(doc["epochs"])
        if rows > len(st.rows) or (rows == len(st.rows) and doc and doc.get("summary")):
            return
        config = read_run_config(self.out) or {}
        controller = self.saved.get("controller") or {}
        write_run_files(
            self.out,
            st.rows,
            list(controller.get("history", [])),
            dataclasses.replace(
                summary,
                decisions=list(config.get("decisions", [])),
                stopped=None,
                resumed_finished=False,
            ),
        )
        self.say(f"resume: {self.out / 'metrics.json'} completed from {self.resume_path}")

    def write_config(
        self, st: RunState, resolved: dict[str, Any], decisions: list[str], notes: list[str]
    ) -> None:
        """``config.json``: a new run's options, command, resolution and ``decisions``; on a
        resume the same document with one more restart entry (the original is kept)."""
        doc = read_run_config(self.out) if self.saved is not None else None
        if doc is not None and str(doc.get("run_id", "")) == st.run_id:
            restarts = list(doc.get("restarts", []))
            assert self.resume_path is not None
            restarts.append(restart_entry(self.resume_path, st, self.changed, notes))
            doc["restarts"] = restarts
            from .report import write_json

            write_json(self.out / "config.json", doc)
            return
        extra: dict[str, Any] = {"run_id": st.run_id, "restarts": []}
        if self.saved is not None:  # resumed into a new folder: the history starts here
            assert self.resume_path is not None
            extra["restarts"] = [restart_entry(self.resume_path, st, self.changed, notes)]
        write_config(self.out, self.cfg.as_json(), resolved, decisions, extra)

    def explained(self, exc: Exception, step: int, started: bool) -> Exception:
        """The error that ended the run at ``step``, told in its line: a failed collective as
        the rank it waited for; a file the started run could not write (a full disk, a folder
        gone read-only) with the checkpoint ``--resume`` continues from."""
        if isinstance(exc, OSError) and started:
            return DataError(f"{exc}; {self.interrupted_line(step, 'stopped')}")
        return self.named_rank(exc, step)

    def named_rank(self, exc: Exception, step: int) -> Exception:
        """A collective that failed at ``step``, told as the rank it waited for (when one is
        silent)."""
        failed = exc if isinstance(exc, CollectiveError) else exc.__cause__
        if not isinstance(failed, CollectiveError):
            return exc
        silent = self.ctx.silent_ranks()
        if not silent:
            return failed
        ranks = ", ".join(map(str, silent))
        return DataError(
            f"rank {ranks} did not answer at step {step} (it ended, or hung for --dist-timeout-s "
            f"{self.cfg.dist_timeout_s:g}); the job stops here; "
            "--resume auto continues from the last checkpoints"
        )

    def continue_schedule(
        self, st: RunState, clock: EpochClock, lr_schedule: LrSchedule
    ) -> list[str]:
        """On a resume with another ``--epochs``: the LR goes on from where it stood to its
        floor at the new end (no jump); the note says so."""
        cfg = self.cfg
        if self.saved is None or "--epochs" not in self.changed:
            return []
        end = st.schedule_epochs or int(self.changed["--epochs"][0])
        st.schedule_epochs = end
        now = clock.epochs_at(st.global_step)
        lr = cfg.lr * lr_schedule.factor(st.global_step)
        st.schedule_warp.append(stretch_schedule(st.schedule_warp, now, end, cfg.epochs))
        note = (
            f"lr: the schedule goes on from {lr:.4g} at epoch {now:.2f} to its floor at epoch "
            f"{cfg.epochs} (was {self.changed['--epochs'][0]})"
        )
        self.say(note)
        return [note]

    def mark_saved(self, st: RunState) -> None:
        """``st``'s checkpoint is written: the line that ends the run names it from now on."""
        self.last_saved = (st.global_step, st.position())

    def interrupted_line(self, step: int | None, how: str = "interrupted") -> str:
        """What Ctrl-C (or SIGTERM) says: where the run stopped and what ``--resume`` uses
        (the folder quoted as a shell would need it, so the options can be pasted)."""
        at = "during start-up" if step is None else f"at step {step}"
        out = self.out
        if self.folder is not None and self.folder.removed:  # (made by this start, gone again)
            return f"{how} {at}; nothing to resume: the run folder {out} was removed again"
        if self.last_saved is None or out is None:
            where = f" in {out}" if out is not None else ""
            return f"{how} {at}; no checkpoint{where} yet: there is nothing to resume"
        done, when = self.last_saved
        return (
            f"{how} {at}; --resume --output {shlex.quote(str(out))} continues from "
            f"{self.ckpts.last} (step {done}, {when})"
        )


def say_through(progress: Any, log: Callable[[str], None]) -> Callable[[str], None]:
    """``log`` that first clears a live progress bar and redraws it after the message."""

    def say(message: str) -> None:
        progress.write(message, log)

    return say


@contextlib.contextmanager
def signals_deferred(resend: bool = True) -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until a checkpoint write (or the closing of the run) is
    complete (main thread only), so a stop never leaves a half-written file or a half-closed
    run; then the first of them is raised, or with ``resend=False`` (the closing of a run that
    has stopped or finished, where a stop has nothing left to stop) dropped."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        # Inside the try: a stop between the two installs still gets both handlers back.
        for sig in handlers:
            signal.signal(sig, lambda number, frame: caught.append(number))
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if caught and resend:
            signal.raise_signal(caught[0])  # now, to the handler the write held back
