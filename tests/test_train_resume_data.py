"""A resume over a changed data folder, and a resumed epoch's time.

A checkpoint records the training file list its reader position belongs to: a resume inside an
epoch over another list is refused in one line, one at an epoch's end goes on over the new list
and says so. Real runs of ``echopipe train`` on a copy of the tiny JPEG set, stopped by
``--max-steps``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from echopipe.cli import main
from echopipe.training import TrainConfig, train
from echopipe.training.checkpoints import read_checkpoint, write_checkpoint
from echopipe.training.progress import format_duration
from echopipe.training.state import RunState

pytestmark = pytest.mark.dali


def _cfg(data: Path, out: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        data=data, image_size=32, batch_size=8, epochs=3, echo=1.0, stages=1, warmup_epochs=0,
        lr=0.05, output=out, progress=False,
    )  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _resume(data: Path, run: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = main(["train", "--data", str(data), "--output", str(run), "--resume", "--no-progress"])
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_resume_inside_an_epoch_over_changed_files_is_refused_until_they_are_restored(
    tiny_imagenet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stopped at step 6 (epoch 2 of 4 steps), a file renamed in train/ (the same count, which
    DALI's own check lets through) and a file added are each refused in one line naming the
    change; the folder restored, the resume goes on to the uninterrupted run's 12 steps."""
    data = tmp_path / "data"
    shutil.copytree(tiny_imagenet, data)
    run = tmp_path / "run"
    train(_cfg(data, run, max_steps=6), log=lambda m: None)
    before = _files(run)
    victim = sorted((data / "train").rglob("*.JPEG"))[3]
    renamed = victim.with_name("zz_renamed.JPEG")
    rel_victim, rel_renamed = (str(p.relative_to(data / "train")) for p in (victim, renamed))
    victim.rename(renamed)
    code, lines = _resume(data, run, capsys)
    assert code == 1 and [m for m in lines if "error" in m] == lines[-1:], lines
    assert "Traceback" not in "".join(lines)
    lines = lines[-1:]
    assert lines[0].startswith(
        f"echopipe train: error: --resume '{run / 'checkpoints' / 'last.pt'}'"
    )
    assert f"{data / 'train'} changed since this checkpoint (epoch 2, step 6)" in lines[0]
    assert (
        f"its 32 files: 1 added (e.g. {rel_renamed!r}), 1 removed (e.g. {rel_victim!r});"
        in (lines[0])
    )
    assert (
        "restore the folder as it was, or resume from a checkpoint written at an epoch's"
        in (lines[0])
    )
    assert _files(run) == before  # refused before anything was written
    renamed.rename(victim)
    extra = victim.with_name("zz_extra.JPEG")
    shutil.copyfile(victim, extra)
    code, lines = _resume(data, run, capsys)
    assert code == 1 and [m for m in lines if "error" in m] == lines[-1:], lines
    lines = lines[-1:]
    rel_extra = str(extra.relative_to(data / "train"))
    assert f"its 32 files: 1 added (e.g. {rel_extra!r});" in lines[0]
    assert _files(run) == before
    extra.unlink()
    code, lines = _resume(data, run, capsys)
    assert code == 0, lines
    assert json.loads((run / "metrics.json").read_text())["summary"]["steps"] == 12


def test_a_resume_at_an_epochs_end_reads_the_changed_files_and_says_so(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """Stopped at the end of epoch 1 (step 4), 8 files added: the resume says so in one line,
    and the next epochs read the new list of 40 files (5 steps of 8 each; DALI's restore of the
    old list's reader position would refuse another count), every sample counted once."""
    data = tmp_path / "data"
    shutil.copytree(tiny_imagenet, data)
    run = tmp_path / "run"
    train(_cfg(data, run, max_steps=4), log=lambda m: None)
    assert read_checkpoint(run / "checkpoints" / "last.pt")["run"]["step_in_epoch"] == 0
    added = []
    for i, src in enumerate(sorted((data / "train").rglob("*.JPEG"))[:8]):
        added.append(src.with_name(f"zz_more_{i}.JPEG"))
        shutil.copyfile(src, added[-1])
    first = str(sorted(added)[0].relative_to(data / "train"))
    said: list[str] = []
    s = train(TrainConfig(data=data, output=run, resume=True, progress=False), log=said.append)
    assert [m for m in said if "changed since" in m] == [
        f"resume: {data / 'train'} changed since {run / 'checkpoints' / 'last.pt'} was written "
        f"at the end of epoch 1 (8 added (e.g. {first!r})): epoch 2 reads the new list of 40 "
        "files, and the input starts afresh over it"
    ], said
    assert s.steps == 4 + 5 + 5 and s.epochs == 3
    rows = json.loads((run / "metrics.json").read_text())["epochs"]
    assert [r["step"] for r in rows] == [4, 9, 14]
    assert rows[-1]["fresh_samples"] == 32 + 40 + 40  # (echo 1: each delivered sample fresh)


def test_a_checkpoint_without_the_file_list_resumes_unchecked(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """Checkpoints written before the file list was recorded resume as before (unchecked)."""
    data = tmp_path / "data"
    shutil.copytree(tiny_imagenet, data)
    run = tmp_path / "run"
    train(_cfg(data, run, max_steps=5), log=lambda m: None)
    last = run / "checkpoints" / "last.pt"
    state = read_checkpoint(last)
    assert state["train_files"]["count"] == 32
    del state["train_files"]
    del state["run"]["epoch_wall_s"]
    write_checkpoint(state, last)
    victim = sorted((data / "train").rglob("*.JPEG"))[0]
    victim.rename(victim.with_name("zz_renamed.JPEG"))
    again = TrainConfig(data=data, output=run, resume=True, progress=False)
    assert train(again, log=lambda m: None).steps == 12


def test_epoch_figures_count_the_whole_epoch() -> None:
    """An epoch's row and line: its time and its rates are of the same seconds' epoch."""
    st = RunState(epoch_samples=64, epoch_train_s=4.0, step_in_epoch=0)
    assert st.epoch_figures(2, 32.0, 10.0) == {
        "epoch_s": 10.0, "epoch_img_per_s": 32.0, "epoch_fresh_per_s": 16.0, "partial": False
    }  # fmt: skip


def test_a_resumed_epochs_time_includes_the_time_before_the_stop(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """Stopped at step 6 (inside epoch 2), the checkpoint holds the epoch's wall seconds so
    far; given injected ones (1000 s, 900 s of them training), the resumed epoch's row and line
    count them in both its time and its img/s (before, its time was the resumed part's only,
    while its img/s was over the whole epoch's training seconds)."""
    run = tmp_path / "run"
    train(_cfg(tiny_imagenet, run, max_steps=6), log=lambda m: None)
    last = run / "checkpoints" / "last.pt"
    state = read_checkpoint(last)
    assert state["run"]["step_in_epoch"] == 2 and state["run"]["epoch_wall_s"] > 0
    state["run"]["epoch_wall_s"], state["run"]["epoch_train_s"] = 1000.0, 900.0
    write_checkpoint(state, last)
    said: list[str] = []
    again = TrainConfig(data=tiny_imagenet, output=run, resume=True, progress=True)
    train(again, log=said.append)
    row = json.loads((run / "metrics.json").read_text())["epochs"][1]
    assert row["epoch"] == 2 and row["partial"] is False
    assert row["epoch_s"] > 1000.0
    assert 900.0 < 32 / row["epoch_img_per_s"] < row["epoch_s"]  # 32 samples in epoch 2
    (line,) = [m for m in said if m.startswith("epoch 2/3:")]
    assert f", {format_duration(row['epoch_s'])} ({row['epoch_img_per_s']:.0f} img/s" in line
