"""A resumed run is the same run: its options, its LR schedule, its folder, its history.

Real runs of ``echopipe train`` on the tiny JPEG set (DALI, the echo cache, the stale
pipeline), stopped by ``--max-steps`` or by an interrupt raised from the run's own log, and
resumed in process and through the CLI.
"""

from __future__ import annotations

import csv
import gc
import itertools
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from echopipe.cli import main
from echopipe.training import TrainConfig, train
from echopipe.training.checkpoints import read_checkpoint
from echopipe.training.config import Interrupted

pytestmark = pytest.mark.dali


def _cfg(data: Path, out: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        data=data,
        image_size=32,
        batch_size=8,
        epochs=3,
        echo=1.0,
        stages=1,
        warmup_epochs=0,
        lr=0.05,
        output=out,
        progress=False,
    )
    base.update(kw)
    return TrainConfig(**base)


def _lrs(run: Path) -> dict[int, float]:
    with open(run / "steps.csv") as f:
        return {int(r["step"]): float(r["lr"]) for r in csv.DictReader(f)}


def _epoch_rows(path: Path) -> list[tuple[str, str, str]]:
    """Each row's epoch, step and partial flag, as text, from metrics.json or metrics.csv."""
    if path.suffix == ".csv":
        with open(path) as f:
            found: list[dict[str, Any]] = list(csv.DictReader(f))
    else:
        found = json.loads(path.read_text())["epochs"]
    return [(str(r["epoch"]), str(r["step"]), str(r.get("partial"))) for r in found]


def test_plain_resume_continues_the_same_run_and_a_finished_run_is_not_retrained(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """Stopped at step 6 of 12, a resume given only the data and the folder takes the run's
    options (3 epochs, not the default 8), and every step's LR is the uninterrupted run's."""
    ref = train(_cfg(tiny_imagenet, tmp_path / "ref"), log=lambda m: None)
    assert ref.steps == 12
    run = tmp_path / "run"
    first = train(_cfg(tiny_imagenet, run, max_steps=6), log=lambda m: None)
    assert first.steps == 6 and first.stopped == "--max-steps 6 reached"
    # The stop's row of epoch 2 is marked partial; the resumed epoch's own row replaces it.
    stopped = _epoch_rows(run / "metrics.json")
    messages: list[str] = []
    again = TrainConfig(data=tiny_imagenet, output=run, resume=True, progress=False)
    s = train(again, log=messages.append)
    assert s.steps == 12 and s.epochs == 3 and not s.resumed_finished
    assert not any("given anew" in m for m in messages), messages
    assert _lrs(run) == pytest.approx(_lrs(tmp_path / "ref"), rel=1e-9)
    assert sorted(_lrs(run)) == list(range(1, 13))  # each step once: none lost, none repeated
    for name in ("metrics.json", "metrics.csv"):  # one row per epoch, none partial
        assert _epoch_rows(run / name) == _epoch_rows(tmp_path / "ref" / name) == [
            ("1", "4", "False"), ("2", "8", "False"), ("3", "12", "False")]  # fmt: skip
    assert stopped == [("1", "4", "False"), ("1.5", "6", "True")]
    doc = json.loads((run / "config.json").read_text())
    assert doc["options"]["max_steps"] == 6 and doc["options"]["epochs"] == 3  # the original
    (restart,) = doc["restarts"]
    assert restart["from"] == {"checkpoint": str(run / "checkpoints" / "last.pt"), "epoch": 1,
                               "step": 6}  # fmt: skip
    assert restart["changed"] == {} and restart["command"] and restart["time"]
    assert doc["run_id"] == read_checkpoint(run / "checkpoints" / "last.pt")["run"]["run_id"]

    # Resuming the finished run says so and trains nothing; nothing in the folder changes.
    before = {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()}
    config_before = (run / "config.json").read_bytes()
    messages.clear()
    done = train(again, log=messages.append)
    assert done.resumed_finished and done.steps == 12
    assert any("finished its 3 epoch(s) at step 12; nothing to train" in m for m in messages)
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()} == before
    assert (run / "config.json").read_bytes() == config_before


def test_the_summary_best_is_best_pt_s_also_of_a_replaced_partial_row() -> None:
    """A --max-steps stop's partial row validated best (best.pt holds it); the epoch's own row,
    which replaced it, validated lower: the summary's best is still best.pt's."""
    from echopipe.training.report import summarize
    from echopipe.training.state import RunState

    st = RunState(epoch=1, global_step=4, rows=[{"epoch": 1, "partial": False, "step": 4,
                                                 "val_top1": 0.5}], best_top1=0.75)  # fmt: skip
    kw: dict[str, Any] = dict(echo_factor=1.0, staleness=[0], balance=[8], devices=["cpu"],
                              wall_s=1.0, output=None, decisions=[], stopped=None)  # fmt: skip
    s = summarize(st, **kw)
    assert (s.top1, s.best_top1) == (0.5, 0.75)
    assert math.isnan(summarize(RunState(), **kw).best_top1)  # nothing validated yet


def test_more_epochs_on_resume_are_named_recorded_and_the_lr_goes_on_down(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """4 epochs stopped after 2, resumed with --epochs 6: the change is said and recorded, and
    the LR goes on from where it stood down to its floor at epoch 6: it never rises."""
    run = tmp_path / "run"
    train(_cfg(tiny_imagenet, run, epochs=4, max_steps=8), log=lambda m: None)
    stopped_lr = _lrs(run)[8]
    messages: list[str] = []
    cfg = TrainConfig(data=tiny_imagenet, output=run, resume=True, epochs=6, progress=False)
    s = train(cfg, log=messages.append)
    assert s.steps == 24 and s.epochs == 6
    assert any("--epochs 4 -> 6 (given anew" in m for m in messages), messages
    assert any(m.startswith("lr: the schedule goes on from") for m in messages), messages
    lrs = [lr for _, lr in sorted(_lrs(run).items())]
    assert len(lrs) == 24 and all(b <= a * (1 + 1e-9) for a, b in itertools.pairwise(lrs))
    # No jump: step 9's update uses the rate the schedule stood at, which the note names.
    (note,) = (m for m in messages if m.startswith("lr: the schedule goes on from"))
    assert _lrs(run)[9] == pytest.approx(float(note.split(" from ")[1].split()[0]), rel=1e-3)
    assert _lrs(run)[9] < stopped_lr
    rows = json.loads((run / "metrics.json").read_text())["epochs"]
    assert rows[-1]["lr"] == pytest.approx(0.05 * 0.02, rel=1e-6)  # the floor at the new end
    assert lrs[-1] > rows[-1]["lr"]  # (the last step's update is just above it)
    doc = json.loads((run / "config.json").read_text())
    assert doc["options"]["epochs"] == 4
    assert doc["restarts"][0]["changed"] == {"--epochs": [4, 6]}


def test_resume_auto_starts_then_continues_and_clears_stale_temporary_files(
    tiny_imagenet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    argv = ["train", "--data", str(tiny_imagenet), "--image-size", "32", "-b", "8",
            "--epochs", "2", "--echo", "1", "--stages", "1", "--no-progress",
            "--output", str(run), "--resume", "auto"]  # fmt: skip
    assert main([*argv, "--max-steps", "3"]) == 0
    err = capsys.readouterr().err
    assert f"resume auto: no checkpoint in {run} yet; the run starts" in err
    # A write killed half-way left its temporary file; the next start removes it.
    stale = run / "checkpoints" / ".last.pt.k1ll3d.tmp"
    stale.write_bytes(b"half a checkpoint")
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "removed 1 temporary file(s) of an interrupted write" in err
    # In the stop line's words: step 3 lies in epoch 1 (it said 'epoch 0', the epochs done).
    assert f"resume: {run / 'checkpoints' / 'last.pt'} (step 3, epoch 1)" in err
    assert "steps, 2 epochs" in out and not stale.exists()
    assert read_checkpoint(run / "checkpoints" / "last.pt")["run"]["global_step"] == 8


def test_resume_never_writes_into_another_runs_folder(
    tiny_imagenet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x, y = tmp_path / "x", tmp_path / "y"
    for run in (x, y):
        train(_cfg(tiny_imagenet, run, max_steps=2), log=lambda m: None)
    y_files = {p: p.read_bytes() for p in y.rglob("*") if p.is_file()}
    argv = ["train", "--data", str(tiny_imagenet), "--no-progress",
            "--resume", str(x / "checkpoints" / "last.pt")]  # fmt: skip
    try:
        code = main([*argv, "--output", str(y)])
    except SystemExit as exc:  # pragma: no cover - the parser's own exit
        code = int(exc.code or 0)
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "holds another run" in line and str(y) in line
    assert {p: p.read_bytes() for p in y.rglob("*") if p.is_file()} == y_files
    # Without --output the checkpoint's own run folder goes on.
    assert main([*argv, "--max-steps", "3"]) == 0
    assert len(json.loads((x / "config.json").read_text())["restarts"]) == 1
    assert read_checkpoint(x / "checkpoints" / "last.pt")["run"]["global_step"] == 3


def test_interrupt_names_the_checkpoint_resume_would_use(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """Ctrl-C (raised from the run's own log at a chosen line, no timing) gives one line: the
    checkpoint --resume continues from, or that there is none and nothing is left behind."""

    def interrupt_at(prefix: str) -> Any:
        def log(message: str) -> None:
            if message.startswith(prefix):
                raise KeyboardInterrupt

        return log

    early = tmp_path / "early"
    with pytest.raises(Interrupted) as info:
        train(_cfg(tiny_imagenet, early), log=interrupt_at("train: "))
    assert info.value.line == (
        f"interrupted during start-up; nothing to resume: the run folder {early} was removed again"
    )
    assert not early.exists()  # a start that did not happen leaves nothing behind
    run = tmp_path / "run"
    with pytest.raises(Interrupted) as info:
        train(_cfg(tiny_imagenet, run, checkpoint_every=2), log=interrupt_at("epoch 1/3"))
    line = info.value.line
    assert line.startswith("interrupted at step 4; --resume --output "), line
    assert f"{run / 'checkpoints' / 'last.pt'} (step 2, epoch 1)" in line
    assert read_checkpoint(run / "checkpoints" / "last.pt")["run"]["global_step"] == 2


def test_a_stop_during_a_checkpoint_write_waits_for_the_write() -> None:
    """Ctrl-C (and SIGTERM, handled alike) arriving while a checkpoint is written is held back
    until the write is complete, then raised: no half-written file is left by a stop."""
    import signal

    from echopipe.training.start import signals_deferred

    done: list[str] = []
    with pytest.raises(KeyboardInterrupt), signals_deferred():
        signal.raise_signal(signal.SIGINT)
        done.append("the write went on")
    assert done == ["the write went on"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_checkpoints_while_the_cache_is_full_by_bytes(tmp_path: Path) -> None:
    """A cache that fills by bytes before its slots run out (as ImageNet-size images do with
    the default --cache-mb) leaves the free-running upstream iteration blocked inside DALI's
    sink: each checkpoint draws batches into its stash until that iteration ends, instead of
    waiting for it (60 s, then the run failed), and a resume from one trains to the end."""
    run = tmp_path / "run"
    argv = ["train", "--model", "resnet_small", "--image-size", "32", "--synthetic-classes", "4",
            "--synthetic-per-class", "16", "-b", "16", "--no-progress", "--stages", "1",
            "--echo", "2", "--cache-mb", "2", "--checkpoint-every", "3", "--epochs", "2",
            "--output", str(run)]  # fmt: skip
    assert main([*argv, "--max-steps", "7"]) == 0
    assert main([*argv, "--resume"]) == 0
    summary = json.loads((run / "metrics.json").read_text())["summary"]
    assert summary["steps"] == 16 and summary["checkpoints_written"] >= 3
    assert sorted(_lrs(run)) == list(range(1, 17))  # each step once


def test_a_resumed_epoch_reports_the_whole_epoch(tiny_imagenet: Path, tmp_path: Path) -> None:
    """Stopped inside epoch 2 and resumed, the rows hold the uninterrupted run's epoch losses
    (--deterministic: the same steps), and the rates count each sample once over the training
    time of both processes."""
    kw: dict[str, Any] = dict(echo=2.0, deterministic=True)
    ref = tmp_path / "ref"
    train(_cfg(tiny_imagenet, ref, **kw), log=lambda m: None)
    run = tmp_path / "run"
    train(_cfg(tiny_imagenet, run, max_steps=11, **kw), log=lambda m: None)
    train(TrainConfig(data=tiny_imagenet, output=run, resume=True, progress=False), log=print)

    def rows(folder: Path) -> list[dict[str, Any]]:
        doc = json.loads((folder / "metrics.json").read_text())
        return [r for r in doc["epochs"] if isinstance(r["epoch"], int)]

    assert [r["step"] for r in rows(run)] == [r["step"] for r in rows(ref)] == [8, 16, 24]
    assert [r["train_loss"] for r in rows(run)] == pytest.approx(
        [r["train_loss"] for r in rows(ref)], rel=1e-6
    )
    for row in rows(run):
        trained = row["delivered_per_s"] * row["train_s"]
        assert trained == pytest.approx(8 * row["step"], rel=1e-6)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as exc:  # pragma: no cover - the parser's own exit
        code = int(exc.code or 0)
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


def test_a_folder_is_continued_only_by_as_many_processes_as_wrote_it(
    tiny_imagenet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torchrun's ranks checkpoint into checkpoints/rank<r>/: one process, which looks in
    checkpoints/, is refused such a folder in one line (it used to start over in it, writing
    over the run's config.json, metrics and steps), whether or not it resumes."""
    run = tmp_path / "run"
    train(_cfg(tiny_imagenet, run, max_steps=2), log=lambda m: None)
    top = run / "checkpoints"
    for rank in (0, 1):  # the layout of a run of two ranks
        (top / f"rank{rank}").mkdir()
        for f in top.glob("*.pt"):
            shutil.copyfile(f, top / f"rank{rank}" / f.name)
    for f in top.glob("*.pt"):
        f.unlink()
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    argv = ["train", "--data", str(tiny_imagenet), "--no-progress", "--output", str(run)]
    for resume in ([], ["--resume"], ["--resume", "auto"]):
        line = _refused([*argv, *resume], capsys)
        assert f"holds the checkpoints of a run at world size 2 ({top / 'rank0'}" in line
        assert "this run has world size 1: each rank's checkpoint holds its own data" in line
        assert "the run continues only at world size 2" in line
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_data_is_the_same_folder_however_it_is_spelled(
    tiny_imagenet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run started with a relative --data resumes with the absolute spelling, and from
    another working directory without --data (the folder is recorded absolute)."""
    monkeypatch.chdir(tiny_imagenet.parent)
    run = tmp_path / "run"
    train(_cfg(Path(tiny_imagenet.name), run, max_steps=2), log=lambda m: None)
    again = TrainConfig(data=tiny_imagenet, output=run, resume=True, max_steps=3, progress=False)
    assert train(again, log=lambda m: None).steps == 3
    monkeypatch.chdir(tmp_path)
    again = TrainConfig(output=run, resume=True, max_steps=4, progress=False)
    assert train(again, log=lambda m: None).steps == 4


def test_a_checkpoint_without_the_epochs_own_figures_still_resumes(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """Checkpoints of earlier versions hold no in-epoch figures: they resume, as before."""
    from echopipe.training.checkpoints import write_checkpoint
    from echopipe.training.state import RunState

    run = tmp_path / "run"
    train(_cfg(tiny_imagenet, run, max_steps=5), log=lambda m: None)
    last = run / "checkpoints" / "last.pt"
    state = read_checkpoint(last)
    for name in RunState.LATER_FIELDS:
        del state["run"][name]
    write_checkpoint(state, last)
    again = TrainConfig(data=tiny_imagenet, output=run, resume=True, progress=False)
    assert train(again, log=lambda m: None).steps == 12


def test_a_second_stop_while_the_run_closes_keeps_the_first_stops_line(
    tiny_imagenet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second Ctrl-C arriving while an interrupted run closes (a real SIGINT, sent as the
    pipeline closes) is dropped: the closing goes on to the end, and the line is the first
    stop's (it interrupted the closing and was told as a stop during start-up)."""
    import os
    import signal

    from echopipe.pipeline.engine import StalePipeline

    close = StalePipeline.close
    closed: list[str] = []

    def close_on_a_second_stop(self: StalePipeline) -> None:
        if not closed:  # (once: the trainer's close, not the later one at garbage collection)
            os.kill(os.getpid(), signal.SIGINT)
        close(self)
        closed.append("pipeline")

    gc.collect()  # earlier tests' pipelines close now, not through the patched close
    monkeypatch.setattr(StalePipeline, "close", close_on_a_second_stop)

    def log(message: str) -> None:
        if message.startswith("epoch 1/3"):
            raise KeyboardInterrupt

    run = tmp_path / "run"
    with pytest.raises(Interrupted) as info:
        train(_cfg(tiny_imagenet, run, checkpoint_every=2), log=log)
    assert info.value.line.startswith("interrupted at step 4; --resume --output "), info.value
    assert closed[:1] == ["pipeline"]


def test_a_stop_held_back_by_a_checkpoint_write_names_that_checkpoint(
    tiny_imagenet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real Ctrl-C arriving while step 4's checkpoint is written: the line names step 4,
    the checkpoint --resume then reads (it named the one before)."""
    import os
    import signal

    from echopipe.training.checkpoints import RunCheckpoints

    save = RunCheckpoints.save

    def save_and_stop(self: RunCheckpoints, state: dict[str, Any], *, best: bool, **kw: Any) -> Any:
        written = save(self, state, best=best, **kw)
        if state["run"]["global_step"] == 4:
            os.kill(os.getpid(), signal.SIGINT)
        return written

    monkeypatch.setattr(RunCheckpoints, "save", save_and_stop)
    run = tmp_path / "run"
    with pytest.raises(Interrupted) as info:
        train(_cfg(tiny_imagenet, run, checkpoint_every=2), log=lambda m: None)
    assert f"{run / 'checkpoints' / 'last.pt'} (step 4," in info.value.line, info.value.line
    assert read_checkpoint(run / "checkpoints" / "last.pt")["run"]["global_step"] == 4


def test_a_stop_right_after_the_last_checkpoint_leaves_metrics_a_resume_completes(
    tiny_imagenet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real SIGTERM arriving while the last epoch's checkpoint is written (held back, then
    raised before metrics.json got that epoch's row and the summary): the checkpoint is of the
    finished run, so --resume trains nothing, and it completes metrics.json and metrics.csv
    from it (they had kept 1 row of 2 and no summary for good)."""
    import os
    import signal

    from echopipe.stops import on_sigterm
    from echopipe.training.checkpoints import RunCheckpoints

    save = RunCheckpoints.save

    def save_and_stop(self: RunCheckpoints, state: dict[str, Any], *, best: bool, **kw: Any) -> Any:
        written = save(self, state, best=best, **kw)
        if state["run"]["epoch"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return written

    monkeypatch.setattr(RunCheckpoints, "save", save_and_stop)
    before = signal.signal(signal.SIGTERM, on_sigterm)  # as the CLI handles it
    run = tmp_path / "run"
    try:
        with pytest.raises(Interrupted) as info:
            train(_cfg(tiny_imagenet, run, epochs=2), log=lambda m: None)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert "(step 8, end of epoch 2)" in info.value.line, info.value.line
    monkeypatch.setattr(RunCheckpoints, "save", save)
    messages: list[str] = []
    again = TrainConfig(data=tiny_imagenet, output=run, resume=True, progress=False)
    s = train(again, log=messages.append)
    assert s.resumed_finished and s.steps == 8
    doc = json.loads((run / "metrics.json").read_text())
    assert [r["epoch"] for r in doc["epochs"]] == [1, 2]
    assert doc["summary"]["steps"] == 8 and doc["summary"]["epochs"] == 2
    assert doc["summary"]["top1"] == doc["epochs"][-1]["val_top1"]
    assert len((run / "metrics.csv").read_text().splitlines()) == 3
    # A complete folder is left as it is.
    stamp = (run / "metrics.json").stat().st_mtime_ns
    train(again, log=lambda m: None)
    assert (run / "metrics.json").stat().st_mtime_ns == stamp


def test_a_stop_while_a_finished_run_closes_keeps_its_summary(
    tiny_imagenet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real Ctrl-C while a run that has finished closes is dropped: train() returns the
    summary (it raised a bare KeyboardInterrupt, which the CLI told as 'interrupted during
    start-up; nothing was written' with status 130)."""
    import os
    import signal

    from echopipe.pipeline.engine import StalePipeline

    close = StalePipeline.close
    sent: list[int] = []

    def close_on_a_stop(self: StalePipeline) -> None:
        if not sent:  # (once: the trainer's close, not the later one at garbage collection)
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        close(self)

    gc.collect()  # earlier tests' pipelines close now, not through the patched close
    monkeypatch.setattr(StalePipeline, "close", close_on_a_stop)
    s = train(_cfg(tiny_imagenet, tmp_path / "run", epochs=1), log=lambda m: None)
    assert sent
    assert s.steps == 4 and s.stopped is None


def test_resume_ckpt_named_from_inside_its_rank_folder(
    tiny_imagenet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun --resume CKPT names one rank's file; a bare name given inside that
    rank<r>/ folder is that file too (its parent, as typed, is empty)."""
    from echopipe.training.distributed import DistContext
    from echopipe.training.preflight import read_resume
    from echopipe.training.resume import agree_on_file

    run = tmp_path / "run"
    train(_cfg(tiny_imagenet, run, max_steps=2), log=lambda m: None)
    rank0 = run / "checkpoints" / "rank0"
    rank0.mkdir()
    (run / "checkpoints" / "last.pt").rename(rank0 / "last.pt")
    monkeypatch.chdir(rank0)
    path, saved = agree_on_file(Path("last.pt"), DistContext(), lambda p: read_resume(p, 1))
    assert path == rank0 / "last.pt" and saved["run"]["global_step"] == 2
