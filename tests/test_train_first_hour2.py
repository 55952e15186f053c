"""More of a new user's first hour with ``echopipe train``: a data folder with a link back to
its split, option values at the edge of what torch can take, and the log lines' rates around
the epoch ends."""

from __future__ import annotations

import io
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from PIL import Image

from echopipe.cli import main
from echopipe.data import scan_image_folder
from echopipe.training.progress import Progress


def _jpeg(path: Path, shade: int) -> None:
    Image.new("RGB", (20, 16), (shade, 255 - shade, 90)).save(path, "JPEG")


def test_a_link_to_the_split_folder_inside_a_class_is_a_loop_not_more_images(
    tmp_path: Path,
) -> None:
    """``train/cat/all -> ..`` (or an absolute link to train/): followed, it filed every
    class's images under ``cat`` as well, with the wrong label, and repeated cat's own; only
    the link one level further down was reported. It is a loop and left out, at once."""
    root = tmp_path / "train"
    for c, name in enumerate(("ant", "cat")):
        (root / name).mkdir(parents=True)
        for i in range(3):
            _jpeg(root / name / f"{name}{i}.JPEG", 40 * c + i)
    (root / "cat" / "all").symlink_to("..")
    (root / "cat" / "again").symlink_to(root)
    index = scan_image_folder(root)
    assert index.counts_per_class() == [3, 3]
    names = sorted(str(Path(f).relative_to(root)) for f in index.files)
    assert names == [f"{n}/{n}{i}.JPEG" for n in ("ant", "cat") for i in range(3)]
    skipped = {str(Path(p).relative_to(root)): why for p, why in index.links_skipped}
    assert set(skipped) == {"cat/all", "cat/again"}
    assert all("loops" in why for why in skipped.values())


@pytest.mark.parametrize(
    ("args", "names"),
    [
        # A float32 step size: larger was a traceback from the first update's optimizer step.
        (["--lr", "1e300"], "--lr"),
        (["--wd", "1e300"], "--weight-decay"),
        # torch.distributed's int64-nanosecond deadlines: 1e10 failed, 1e11 hung the job.
        (["--dist-timeout-s", "1e11"], "--dist-timeout-s"),
        # Within its bound, but the cache's slots for it and the batch are not: a traceback
        # from the DALI pipeline's config after the run folder was made.
        (["--shuffle-buffer", "2147483647"], "--shuffle-buffer"),
        # Path("") is the current folder: a run would write its files there.
        (["--output", ""], "--output"),
        (["--data", ""], "--data"),
    ],
)
def test_values_torch_or_the_cache_cannot_take_are_one_line_and_exit_2(
    tmp_path: Path, args: list[str], names: str
) -> None:
    """Refused with one line naming the option, status 2, before anything is made; the data
    folder is real but has no train/, so a value let through ends as bad data (status 1)."""
    data = tmp_path / "data"
    data.mkdir()
    out, err = io.StringIO(), io.StringIO()
    argv = ["train", "--data", str(data), "--output", str(tmp_path / "run"), "--no-progress"]
    with redirect_stdout(out), redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        main([*argv, *args])
    lines = err.getvalue().strip().splitlines()
    assert exit_.value.code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("echopipe train: error: "), lines
    assert names in lines[0], lines
    assert not (tmp_path / "run").exists() and not (Path.cwd() / "config.json").exists()


def test_lines_on_the_refill_after_an_epoch_end_show_no_rate_and_the_drain_counts() -> None:
    """A pipeline two minibatches deep, 0.1 s of compute per step of 8 images (80 img/s). At the
    epoch end the drain waits for the last two computes (0.2 s, training); validation takes
    0.5 s (not training). The next epoch's first two steps only enqueue (no loss yet) and
    return at once. Every rate a line shows is 80 img/s: the refill lines once said 8e9 img/s,
    and with the drain left out the line after them said 240."""
    now = [0.0]
    lines: list[str] = []
    p = Progress(True, False, 1, 2, lines.append, None, warmup_steps=0, clock=lambda: now[0])
    p.start_epoch(0, 3, 0)
    for k in range(1, 4):
        now[0] += 0.1
        p.step(k, 1.0, 1.0, delivered=8 * k, fresh=8.0 * k)
    now[0] += 0.2  # the drain
    p.drained()
    now[0] += 0.5  # validation and the checkpoint
    p.start_epoch(1, 3, 0)
    for k in range(1, 4):
        now[0] += 0.1 if k == 3 else 0.0  # steps 4 and 5 enqueue; 6 waits for 4's compute
        p.step(3 + k, 1.0 if k == 3 else None, 1.0, delivered=8 * k, fresh=8.0 * k)
    rates = {
        int(m.group(1)): float(m.group(2))
        for m in (re.match(r"step (\d+): .*img/s ([0-9.e+]+)", line) for line in lines)
        if m
    }
    assert sorted(rates) == [1, 2, 3, 6], lines
    assert all(r == pytest.approx(80.0, rel=0.01) for r in rates.values()), lines
