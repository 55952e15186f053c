"""Still more of a new user's first hour with ``echopipe train``: a disk that fills while the
run writes its files."""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from echopipe.cli import main
from echopipe.data import scan_image_folder
from pipeline_support import train_runs as tr
from pipeline_support.jpegs import two_class_folder
from pipeline_support.train_runs import child_env

RUN = ["--model", "lenet5", "--image-size", "32", "-b", "8", "--stages", "1", "--echo", "1",
       "--epochs", "2", "--warmup-epochs", "0", "--no-progress"]  # fmt: skip


def _train(
    args: list[str], file_limit: int | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        # A file that cannot grow past ``file_limit`` bytes: writes fail with EFBIG, as a
        # full disk's fail with ENOSPC (SIGXFSZ ignored, or it would kill the process).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    cmd = [sys.executable, "-m", "echopipe.cli", "train", *RUN, *args]
    return subprocess.run(cmd, env={**child_env(), **env}, capture_output=True, text=True,
                          timeout=300, preexec_fn=limit if file_limit else None)  # fmt: skip


@pytest.mark.dali
def test_a_checkpoint_the_disk_cannot_hold_names_the_file_and_the_resume(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """A checkpoint write that fails for want of space was ``error: [Errno 27] File too
    large``: no file, no word of what the run kept. The line names the file, the step, and
    the checkpoint ``--resume`` continues from; no temporary file is left, and the resume
    finishes the run once there is room."""
    run = tmp_path / "run"
    data = ["--data", str(tiny_imagenet), "--output", str(run)]
    first = _train([*data, "--max-steps", "4"])
    assert first.returncode == 0, first.stderr
    # The lenet5 checkpoint is about 2 MB; config.json, metrics and steps.csv a few KB.
    full = _train([*data, "--resume"], file_limit=1 << 20)
    assert full.returncode == 1, full.stderr
    assert "Traceback" not in full.stderr
    last = run / "checkpoints" / "last.pt"
    assert full.stderr.strip().splitlines()[-1] == (
        f"echopipe train: error: [Errno {errno.EFBIG}] {os.strerror(errno.EFBIG)}: '{last}'; "
        f"stopped at step 8; "
        f"--resume --output {run} continues from {last} (step 4, end of epoch 1)"
    )
    assert not [p.name for p in last.parent.iterdir() if p.name.startswith(".")]
    again = _train([*data, "--resume"])
    assert again.returncode == 0, again.stderr
    assert "(8 steps, 2 epochs" in again.stdout, again.stdout


@pytest.mark.dali
def test_a_best_pt_that_cannot_be_written_names_the_last_pt_that_was(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """``last.pt`` is written before ``best.pt``; when ``best.pt`` then failed, the line named
    the checkpoint before (``continues from last.pt (step 4, ...)``, though last.pt held step 8)
    and the temporary file that was already removed. It names ``best.pt`` and the step last.pt
    holds, and the resume continues from that step."""
    from echopipe.training.checkpoints import read_checkpoint, read_state_file, write_checkpoint

    run = tmp_path / "run"
    data = ["--data", str(tiny_imagenet), "--output", str(run)]
    assert _train([*data, "--max-steps", "4"]).returncode == 0
    last, best = run / "checkpoints" / "last.pt", run / "checkpoints" / "best.pt"
    # No best top-1 yet, so epoch 2's end writes best.pt whatever its top-1; a folder in its
    # place makes that write fail (os.replace cannot put a file over a folder).
    state = read_state_file(last)
    state["run"]["best_top1"] = -1.0
    write_checkpoint(state, last)
    best.unlink()
    best.mkdir()
    failed = _train([*data, "--resume"])
    assert failed.returncode == 1, failed.stderr
    assert "Traceback" not in failed.stderr
    assert failed.stderr.strip().splitlines()[-1] == (
        f"echopipe train: error: [Errno {errno.EISDIR}] {os.strerror(errno.EISDIR)}: '{best}'; "
        f"stopped at step 8; --resume --output {run} continues from {last} (step 8, end of "
        "epoch 2)"
    )
    assert read_checkpoint(last)["run"]["global_step"] == 8
    assert not [p.name for p in last.parent.iterdir() if p.name.startswith(".")]
    again = _train([*data, "--resume"])
    assert again.returncode == 0, again.stderr
    assert "resume: the run finished its 2 epoch(s) at step 8" in again.stderr


@pytest.mark.dali
def test_a_resume_that_names_the_runs_model_takes_the_rest_from_the_checkpoint(
    tiny_imagenet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--resume --model lenet5`` of a lenet5 run trained at ``--image-size 32`` was refused,
    ``--image-size 64 does not fit --model lenet5``: the combination was checked with the
    defaults of the options not given, which a resume takes from the checkpoint. It resumes;
    a new run (``--resume auto`` with no checkpoint yet) is still checked as given, before its
    folder is made."""
    run = tmp_path / "run"
    data = ["--data", str(tiny_imagenet), "--output", str(run)]
    assert _train([*data, "--max-steps", "4"]).returncode == 0
    resumed = ["train", *data, "--resume", "--model", "lenet5", "--no-progress", "--max-steps", "5"]
    assert main(resumed) == 0
    err = capsys.readouterr().err
    assert f"resume: {run / 'checkpoints' / 'last.pt'} (step 4, end of epoch 1)" in err, err
    assert "lenet5 on 4 classes" in err and "error" not in err, err
    fresh = tmp_path / "fresh"
    argv = ["train", "--data", str(tiny_imagenet), "--output", str(fresh), "--resume", "auto",
            "--model", "lenet5", "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "echopipe train: error: --image-size 64 does not fit --model lenet5, which takes 32 to 35"
    ]
    assert not fresh.exists()


@pytest.mark.dali
def test_a_finished_resume_from_an_older_checkpoint_keeps_the_newer_metrics(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """A run of 2 epochs trained on to 3 (``--resume --epochs 3``); ``--resume prev.pt`` (the
    end of epoch 2, a finished run at its own 2 epochs) trains nothing, and rewrote
    metrics.json and metrics.csv from that checkpoint: epoch 3's row and the summary of step
    12 were gone, though last.pt still held them. The files are left as they are."""
    run = tmp_path / "run"
    data = ["--data", str(tiny_imagenet), "--output", str(run)]
    assert _train(data).returncode == 0
    assert _train([*data, "--resume", "--epochs", "3"]).returncode == 0
    metrics = (run / "metrics.json").read_text(), (run / "metrics.csv").read_text()
    assert [r["step"] for r in json.loads(metrics[0])["epochs"]] == [4, 8, 12]
    prev = run / "checkpoints" / "prev.pt"
    old = _train([*data, "--resume", str(prev)])
    assert old.returncode == 0, old.stderr
    assert "resume: the run finished its 2 epoch(s) at step 8" in old.stderr, old.stderr
    assert ((run / "metrics.json").read_text(), (run / "metrics.csv").read_text()) == metrics


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_run_folder_inside_the_data_splits_is_refused_before_it_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], split: str
) -> None:
    """``--output DATA/train/run1`` made the run folder a class folder of train/, and the start
    was refused for classes that differ between the splits, naming the run's own folder as a
    class (``(e.g. 'run1')``). It is refused as the run folder it is, before it is made."""
    data = two_class_folder(tmp_path / "data")
    out = data / split / "run1"
    argv = ["train", "--data", str(data), *RUN, "--output", str(out)]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"echopipe train: error: --output '{out}' is inside --data's {split}/ folder "
        f"({data / split}): the run folder would be read as a class of images; choose a "
        f"folder outside {split}/"
    ]
    assert not out.exists()


@pytest.mark.parametrize("inner", ["train", "val/ant"])
def test_a_split_or_class_folder_given_as_data_names_the_data_folder_above_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], inner: str
) -> None:
    """``--data DATA/train`` (or a class folder) said only that it has no train/ folder; the
    line names the data folder it is inside, as the --data to give."""
    data = two_class_folder(tmp_path / "data")
    given = data / inner
    argv = ["train", "--data", str(given), *RUN, "--output", str(tmp_path / "run")]
    assert main(argv) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"echopipe train: error: --data '{given}' has no train/ folder (ImageNet layout: "
        "train/<class>/*.JPEG and val/<class>/*.JPEG); it is inside the data folder "
        f"'{data}': give --data '{data}'"
    ]


@pytest.mark.dali
def test_a_steps_csv_the_disk_cannot_hold_is_named_once(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """steps.csv, appended to through a buffer, fails when the buffer is written out before
    the first checkpoint; the run's closing then wrote it once more and failed again, so the
    line was the close's bare ``error: [Errno 27] File too large`` (and the closes after it
    were skipped). The line names the file and where the run stopped."""
    run = tmp_path / "run"
    # 128 one-image steps in the one epoch: steps.csv's lines pass 4 KiB before its first
    # checkpoint; config.json stays below.
    args = ["--data", str(tiny_imagenet), "--output", str(run), "--epochs", "1", "-b", "1",
            "--echo", "4", "--lr", "0.001"]  # fmt: skip
    full = _train(args, file_limit=4096)
    assert full.returncode == 1, full.stderr
    assert "Traceback" not in full.stderr
    assert full.stderr.strip().splitlines()[-1] == (
        f"echopipe train: error: [Errno {errno.EFBIG}] {os.strerror(errno.EFBIG)}: "
        f"'{run / 'steps.csv'}'; stopped at step 128; no checkpoint in {run} yet: there is "
        "nothing to resume"
    )


FOLLOWED = "a link to the split folder itself is followed, links out of it are not"


def _link_classes_out(data: Path, split: str, names: list[str]) -> Path:
    """Moves ``split``'s class folders ``names`` to another disk's folder and links each back
    (a layout that spreads a data set over disks, one link per class)."""
    other = data.parent / "disk2" / split
    other.mkdir(parents=True)
    for name in names:
        (data / split / name).rename(other / name)
        (data / split / name).symlink_to(other / name)
    return other


@pytest.mark.parametrize(
    ("linked", "said"),
    [
        # One: the line named a class folder the user sees in both splits.
        (["cat"], "have different class folders (e.g. 'cat'): train/cat is a symbolic link "
                  "to {other}/cat, outside train/, and such links are left out"),
        # All but one: the line said train/ had one class folder.
        (["ant", "cat"], "train/ has 1 class folder(s); a classifier needs at least 2; 2 "
                         "symbolic link(s) in it are left out (e.g. {data}/train/ant: link "
                         "leaves the data folder (to {other}/ant)): " + FOLLOWED),
        # Every one: the line said train/ had no class sub-folders.
        (["ant", "bee", "cat"], "has no class sub-folders; 3 symbolic link(s) in it are left "
                                "out (e.g. {data}/train/ant: link leaves the data folder (to "
                                "{other}/ant)): " + FOLLOWED),
    ],
)  # fmt: skip
def test_class_folders_linked_from_another_disk_are_named_as_links_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], linked: list[str], said: str
) -> None:
    """Class folders that are links out of train/ are left out (a run reads only inside its
    split); a start refused for the classes missing then says so, naming a link, instead of
    naming a class that is there or saying there are none."""
    data = two_class_folder(tmp_path / "data")
    for split in ("train", "val"):
        shutil.copytree(data / split / "ant", data / split / "bee")
    other = _link_classes_out(data, "train", linked)
    argv = ["train", "--data", str(data), *RUN, "--output", str(tmp_path / "run")]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(said.format(data=data, other=other)), err
    assert not (tmp_path / "run").exists()


@pytest.mark.dali
def test_the_stop_line_quotes_a_run_folder_with_spaces_for_the_shell(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """The line of a stopped run gives the options that continue it; a folder with a space
    (and non-ASCII letters) was written bare, so the pasted options named another folder."""
    run = tmp_path / "my runs" / "ré sumé"
    cmd = [sys.executable, "-m", "echopipe.cli", "train", "--data", str(tiny_imagenet), *RUN,
           "--output", str(run)]  # fmt: skip
    code, err = tr.stop_when(cmd, lambda seen: "epoch 1/2:" in seen)
    assert code == 143, err
    last = err.strip().splitlines()[-1]
    found = re.fullmatch(
        r"echopipe train: interrupted at step \d+; (.*) continues from (.*) "
        r"\(step 4, end of epoch 1\)",
        last,
    )
    assert found is not None, last
    assert shlex.split(found[1]) == ["--resume", "--output", str(run)]
    assert found[2] == str(run / "checkpoints" / "last.pt")


@pytest.mark.parametrize("version", [b"0", b"2", b"10"])
def test_a_checkpoint_of_another_format_version_is_named_as_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], version: bytes
) -> None:
    """A checkpoint an older or newer echopipe wrote (another version on its first line) was
    refused as 'not an echopipe checkpoint'; the line says which format it is and which this
    echopipe reads."""
    import torch

    from echopipe.training.checkpoints import read_state_file, write_checkpoint

    path = tmp_path / "last.pt"
    write_checkpoint({"w": torch.zeros(3)}, path)
    assert torch.equal(read_state_file(path)["w"], torch.zeros(3))
    data = path.read_bytes()
    path.write_bytes(data.replace(b"echopipe-checkpoint 1\n", b"echopipe-checkpoint " + version
                                  + b"\n", 1))  # fmt: skip
    assert main(["export", str(path), str(tmp_path / "model.pt")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"echopipe export: error: checkpoint '{path}' is of another format ('echopipe-checkpoint "
        f"{version.decode()}'; this echopipe reads 'echopipe-checkpoint 1'); it is not loaded"
    ]


@pytest.mark.dali
def test_a_damaged_last_pt_names_the_prev_pt_a_resume_can_continue_from(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """A ``last.pt`` cut short (a copy of the run folder that stopped) was refused with no
    word of the ``prev.pt`` beside it; the line gives the ``--resume`` that continues from
    it, and that resume trains the run to its end."""
    run = tmp_path / "run"
    data = ["--data", str(tiny_imagenet), "--output", str(run)]
    assert _train([*data, "--max-steps", "5"]).returncode == 0  # checkpoints at steps 4, 5
    last, prev = run / "checkpoints" / "last.pt", run / "checkpoints" / "prev.pt"
    with open(last, "r+b") as f:
        f.truncate(1000)
    refused = _train([*data, "--resume"])
    assert refused.returncode == 1, refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith(f"echopipe train: error: checkpoint '{last}' is truncated"), line
    assert line.endswith(f"; --resume {prev} continues from the checkpoint before it"), line
    again = _train(["--data", str(tiny_imagenet), "--resume", str(prev)])
    assert again.returncode == 0, again.stderr
    assert f"resume: {prev} (step 4, end of epoch 1)" in again.stderr
    assert "(8 steps, 2 epochs" in again.stdout, again.stdout


def test_a_run_folder_it_cannot_write_in_is_one_line_naming_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An existing --output the run cannot write in (a read-only mount) was a bare ``[Errno
    30] Read-only file system: '.../.echopipe-train.lock'`` (and for an empty folder on a
    read-only tmpfs mount, tried by hand, the undoing of the lock file it never made failed
    too, in place of that line). As root (who writes in a mode-555 folder) a lock name that
    cannot be created stands in for the mount."""
    data = two_class_folder(tmp_path / "data")
    out = tmp_path / "archive"
    out.mkdir()
    if os.geteuid() == 0:
        (out / ".echopipe-train.lock").symlink_to(tmp_path / "gone" / "lock")
    else:
        out.chmod(0o555)
    argv = ["train", "--data", str(data), *RUN, "--output", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"echopipe train: error: --output '{out}': cannot write in the run "
                             "folder ("), err  # fmt: skip
    assert out.is_dir()


def test_a_link_into_another_class_folder_is_left_out_not_trained_under_two_labels(
    tmp_path: Path,
) -> None:
    """Links inside train/ to another class's folder (a class folder that links to another,
    a folder or file link inside a class that points into another class) were followed: the
    other class's images were trained under both labels, silently. They are left out and
    counted, each naming the class it points into; a link elsewhere inside train/ still
    counts."""
    root = two_class_folder(tmp_path / "data") / "train"
    (root / "bee").symlink_to("ant")  # an alias of a class
    (root / "cat" / "ants").symlink_to("../ant")  # a folder of another class, inside this one
    (root / "cat" / "one.JPEG").symlink_to("../ant/00.JPEG")  # an image of another class
    store = root / ".store"
    store.mkdir()
    shutil.copy(root / "cat" / "00.JPEG", store / "extra.JPEG")
    (root / "cat" / "extra.JPEG").symlink_to("../.store/extra.JPEG")  # kept: no class's own
    index = scan_image_folder(root)
    assert index.classes == ["ant", "cat"]
    assert index.counts_per_class() == [6, 7]
    assert len({os.path.realpath(f) for f in index.files}) == len(index.files) == 13
    skipped = {str(Path(p).relative_to(root)): why for p, why in index.links_skipped}
    assert skipped == {
        name: "link into the class folder 'ant' (its images would get two labels)"
        for name in ("bee", "cat/ants", "cat/one.JPEG")
    }


@pytest.mark.dali
def test_an_export_the_disk_cannot_hold_is_one_line(tiny_imagenet: Path, tmp_path: Path) -> None:
    """``echopipe export`` onto a full disk was a traceback: torch.save's zip writer turned the
    failed write into ``RuntimeError: ... unexpected pos``. One line names OUT and why; no
    file, temporary or final, is left."""
    run = tmp_path / "run"
    assert _train(["--data", str(tiny_imagenet), "--output", str(run), "--max-steps", "1"]
                  ).returncode == 0  # fmt: skip
    out = tmp_path / "exported" / "model.pt"
    out.parent.mkdir()

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # lenet5's weights: 250 KB

    cmd = [sys.executable, "-m", "echopipe.cli", "export", str(run / "checkpoints" / "last.pt"),
           str(out)]  # fmt: skip
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300,
                          preexec_fn=limit)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"echopipe export: error: cannot write OUT '{out}': {os.strerror(errno.EFBIG)} (see "
        "echopipe export --help)"
    ]
    assert list(out.parent.iterdir()) == []


@pytest.mark.dali
def test_a_run_whose_data_folder_moved_is_told_how_to_continue(
    tiny_imagenet: Path, tmp_path: Path
) -> None:
    """A data folder moved to another disk: the resume was refused (--data may not change)
    with no way on. The folder is compared through links, so the line says that a link at the
    old place continues the run, and that resume finishes it."""
    data, moved, run = tmp_path / "data", tmp_path / "disk2" / "data", tmp_path / "run"
    shutil.copytree(tiny_imagenet, data)
    assert _train(["--data", str(data), "--output", str(run), "--max-steps", "3"]).returncode == 0
    moved.parent.mkdir()
    data.rename(moved)
    hint = f" (moved? a link at '{data}' to its new place lets the run continue)"
    for given in ([], ["--data", str(moved)]):
        refused = _train(["--output", str(run), "--resume", *given])
        assert refused.returncode == 2, refused.stderr
        assert hint in refused.stderr.strip().splitlines()[-1], refused.stderr
    data.symlink_to(moved)
    done = _train(["--output", str(run), "--resume"])
    assert done.returncode == 0, done.stderr
    assert "(8 steps, 2 epochs" in done.stdout, done.stdout


@pytest.mark.dali
def test_a_synthetic_set_the_cache_disk_cannot_hold_names_the_cache_folder(tmp_path: Path) -> None:
    """The default data set, built into a cache folder on a full disk, ended with a bare
    ``error: [Errno 27] File too large``. The line names the cache folder and the ways on."""
    cache = tmp_path / "cache"
    args = ["--synthetic-classes", "2", "--synthetic-per-class", "2", "--output",
            str(tmp_path / "run")]  # fmt: skip
    full = _train(args, file_limit=1000, ECHOPIPE_CACHE_DIR=str(cache))  # a JPEG: 2 to 4 KB
    assert full.returncode == 1, full.stderr
    assert full.stderr.strip().splitlines()[-1] == (
        f"echopipe train: error: data: cannot build the synthetic set in '{cache}' "
        f"({os.strerror(errno.EFBIG)}); set ECHOPIPE_CACHE_DIR to a folder with room, or give "
        "--data"
    )
    assert not [p for p in cache.iterdir() if not p.name.endswith(".lock")]
